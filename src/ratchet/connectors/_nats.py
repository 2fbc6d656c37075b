"""NATS JetStream: a durable pull consumer as a source, publishing with de-duplication as a sink.

Source: `--input nats://HOST:PORT?stream=S&subject=SUBJ[&durable=NAME][&ack_wait=SECONDS]
[&reconnect_for=SECONDS]`.
Messages are fetched by a durable pull consumer (explicit acks) and acknowledged only after
the checkpoint that holds them completed. The position in ratchet's checkpoint is the set of
stream sequences admitted but not yet acknowledged (confirmed by the server): after a crash,
the server redelivers them once their ack-wait runs out, and the source recognises them by
stream sequence and acknowledges them without admitting them again. A server lost mid-run is
reconnected to until it is back, or for at most `reconnect_for` seconds if given, after which
the source ends the job with ServerUnreachableError (a supervised job waits for it, and
resumes from its checkpoint).

Sink: `--output nats://HOST:PORT?stream=S&subject=SUBJ` publishes each output (its JSON line)
with the header `Nats-Msg-Id: <job id>:<output id>`, and waits for the stream's
acknowledgement; a publish repeated after a crash within the stream's duplicate window is
dropped by the server. docs/connectors.md says what happens after a longer outage.

nats-py is asynchronous; the engine calls sources and sinks synchronously, so each connector
runs its client on an event loop of its own, in a thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import math
import re
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ratchet._clock import SYSTEM_CLOCK
from ratchet._errors import ConfigError, ServerUnreachableError
from ratchet.connectors import missing_extra, query_of, redact
from ratchet.runtime._io import (
    JobIdentity,
    Record,
    Sink,
    Source,
    _key_and_depth,
    _kind_of,
    _not_json,
    to_json_line,
)

try:
    import nats
    import nats.errors
    import nats.js.errors
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
except ImportError as _exc:  # pragma: no cover - exercised by a test that hides nats
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

log = logging.getLogger("ratchet.connectors.nats")

T = TypeVar("T")
_SOURCE_PARAMS = frozenset({"stream", "subject", "durable", "ack_wait", "batch", "reconnect_for"})
_SINK_PARAMS = frozenset({"stream", "subject"})
DEFAULT_ACK_WAIT = 30.0
# How long a source waits for a lost server in-process (the client reconnecting) before the job
# ends with ServerUnreachableError (a supervised job then waits for it with a doubling delay).
DEFAULT_RECONNECT_FOR = math.inf  # as a followed PostgreSQL source: ride it out
# The ack-wait must leave room for this many checkpoint intervals (and at least a second):
# a message is acknowledged after the checkpoint that follows its admission.
ACK_WAIT_INTERVALS = 10
_PUBLISH_CHUNK = 256
# Batches fetched ahead of the engine: it waits `follow_poll` whenever the buffer is empty.
_PREFETCH = 4
_TIMEOUT = 30.0
# The longest ack-wait taken: a day (NATS holds it in nanoseconds; 1e12 s overflows).
MAX_ACK_WAIT = 86_400.0
if _IMPORT_ERROR is None:
    # What a failed connect meets when no server is there to answer: nothing listens, the name
    # does not resolve, no answer in time, a connection dropped (a server shutting down).
    # Anything else is the server's answer (an authorization violation, TLS required).
    _NOT_THERE: tuple[type[BaseException], ...] = (
        OSError,
        TimeoutError,
        nats.errors.TimeoutError,
        nats.errors.NoServersError,
        nats.errors.StaleConnectionError,  # and UnexpectedEOF, its subclass
        nats.errors.ConnectionClosedError,
    )
# A consumer name NATS takes: no whitespace, ".", "*", ">", "/" or "\\".
_DURABLE = re.compile(r"[^\s.*>/\\]+")


def _require(flag: str, uri: str) -> None:
    if _IMPORT_ERROR is not None:
        raise missing_extra(flag, uri, "nats", "nats-py", _IMPORT_ERROR)


def _parse(uri: str, flag: str, known: frozenset[str]) -> tuple[str, dict[str, str]]:
    params = query_of(uri, flag, known)
    parts = urlsplit(uri)
    for name in ("stream", "subject"):
        if not params.get(name):
            raise ConfigError(
                f"{flag} {redact(uri)}: name the {name}: "
                f"nats://HOST:PORT?stream=NAME&subject=SUBJECT"
            )
    if not parts.hostname:
        raise ConfigError(f"{flag} {redact(uri)}: name the server, e.g. nats://127.0.0.1:4222")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number of 0-65535
    except ValueError as exc:
        raise ConfigError(
            f"{flag} {redact(uri)}: the port is not a number of 1-65535, e.g. nats://127.0.0.1:4222"
        ) from exc
    server = parts._replace(path="", query="", fragment="").geturl()
    return server, params


class _Loop:
    """An event loop in a thread of its own, for the asynchronous NATS client."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = _TIMEOUT) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        # Tasks the client left (a subscription's reader, after a connection lost as the job
        # stopped) are cancelled and awaited first: a loop closed under them printed
        # "Task was destroyed but it is pending!" and a traceback at exit.
        try:
            self.call(_cancel_the_rest(), timeout=5)
        except Exception:  # noqa: BLE001, S110 - a loop that does not answer is stopped anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


async def _cancel_the_rest() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


class _Outage:
    """When the connection was lost (SYSTEM_CLOCK.monotonic()), None while connected; kept by the
    client's callbacks. `limit`: how long the connector waits for the server to come back."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.since: float | None = None


async def _connect(server: str, flag: str, uri: str, outage: _Outage | None = None) -> Any:
    """A connection, or why not: a server that cannot be reached (nothing listens, its name
    does not resolve, no answer in time, a connection dropped as it shuts down) is a
    ServerUnreachableError, which a supervised job waits out; one that answered no (an
    authorization violation, a TLS requirement) a ConfigError."""
    # nats-py's defaults log a traceback for each error and each failed reconnect (some 140
    # lines for one server restart): one line each here, and only the first error of an
    # outage as a warning.
    where = f"{flag} {redact(uri)}"
    state: dict[str, Any] = {"nc": None, "down": False}
    seen: list[BaseException] = []  # the errors of the first connect's attempts

    async def error(exc: Exception) -> None:
        if state["nc"] is None:
            seen.append(exc)
        (log.debug if state["down"] else log.warning)("%s: NATS error: %r", where, exc)

    async def disconnected() -> None:
        nc = state["nc"]
        if nc is None or nc.is_closed:
            return  # our own close
        state["down"] = True
        if outage is None:
            log.warning("%s: disconnected from NATS; reconnecting until it is back", where)
            return
        if outage.since is None:
            outage.since = SYSTEM_CLOCK.monotonic()
        if math.isinf(outage.limit):
            log.warning("%s: disconnected from NATS; reconnecting until it is back", where)
        else:
            log.warning(
                "%s: disconnected from NATS; reconnecting, for up to %g s (reconnect_for)",
                where, outage.limit,
            )  # fmt: skip

    async def reconnected() -> None:
        state["down"] = False
        if outage is not None:
            outage.since = None
        log.warning("%s: reconnected to NATS", where)

    try:
        # The first connect gives up after a second attempt (retrying forever would hide a
        # wrong address until the 30 s call timeout); once connected, a lost server is
        # reconnected forever: the client reads these options each time it reconnects.
        nc = await nats.connect(
            servers=[server],
            connect_timeout=5,
            max_reconnect_attempts=1,
            allow_reconnect=True,
            error_cb=error,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        seen.append(exc)
        address = _address(server)
        answers = [e for e in seen if not isinstance(e, _NOT_THERE)]
        if answers:  # the server was there, and said no
            raise ConfigError(
                f"{where}: NATS at {address} refused the connection: {answers[-1]}; check the "
                f"credentials in the URI and the server's authorization settings"
            ) from exc
        tried = [e for e in seen if not isinstance(e, nats.errors.NoServersError)]
        raise ServerUnreachableError(
            f"{where}: cannot reach NATS at {address}: {(tried or seen)[-1]!r} (is "
            f"nats-server running there, with -js?)",
            server="NATS",
            address=address,
        ) from exc
    nc.options["max_reconnect_attempts"] = -1
    state["nc"] = nc
    return nc


def _address(server: str) -> str:
    """HOST:PORT of a server URL, for messages (NATS's port 4222 when not given)."""
    parts = urlsplit(server)
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port or 4222}"


async def _stream(js: Any, name: str, flag: str, uri: str) -> Any:
    try:
        return await js.stream_info(name)
    except nats.js.errors.NotFoundError as exc:
        raise ConfigError(
            f"{flag} {redact(uri)}: JetStream has no stream {name!r}; create it first (for "
            f"example `nats stream add {name} --subjects ...`), ratchet does not create streams"
        ) from exc


class NatsSource(Source):
    """A JetStream stream read by a durable pull consumer (see module doc)."""

    # Unacknowledged messages come back after their ack-wait in another order: one process
    # tells a redelivery by its stream sequence, `--workers N`'s coordinator cannot.
    replays_in_order = False

    def __init__(
        self,
        uri: str,
        server: str,
        stream: str,
        subject: str,
        *,
        key_field: str = "key",
        follow: bool = False,
        durable: str | None = None,
        ack_wait: float | None = None,
        batch: int = 256,
        reconnect_for: float = DEFAULT_RECONNECT_FOR,
    ) -> None:
        self.uri, self.server, self.stream, self.subject = uri, server, stream, subject
        self._outage = _Outage(reconnect_for)
        self.key_field = key_field
        self._follow = follow
        self.durable = durable
        self.ack_wait = ack_wait
        self.batch = batch
        self._loop: _Loop | None = None
        self._nc: Any = None
        self._sub: Any = None
        self._fetcher: concurrent.futures.Future[None] | None = None
        self._lock = threading.Lock()
        self._ready: collections.deque[Any] = collections.deque()  # fetched, not yet read
        self._handles: dict[int, Any] = {}  # admitted, not yet acknowledged
        self._acking: dict[int, Any] = {}  # acknowledged after a checkpoint, not yet confirmed
        self._restored: set[int] = set()  # in a completed checkpoint, unconfirmed by the server
        self._floor = 0  # the consumer's ack floor (a stream sequence) as last seen
        self._wait = DEFAULT_ACK_WAIT  # the consumer's ack-wait, seconds
        self._prev: tuple[int, Any] | None = None
        self._drained = False
        self._closing = False
        self._want: asyncio.Event | None = None
        self._acks: list[concurrent.futures.Future[None]] = []
        self._created = False  # this open created the durable consumer
        self._taken = False  # restore took the state's position: the start was not refused

    @classmethod
    def from_uri(cls, uri: str, *, key_field: str, follow: bool) -> NatsSource:
        _require("--input", uri)
        server, p = _parse(uri, "--input", _SOURCE_PARAMS)
        try:
            ack_wait = float(p["ack_wait"]) if "ack_wait" in p else None
            batch = int(p.get("batch", 256))
            reconnect_for = float(p.get("reconnect_for", DEFAULT_RECONNECT_FOR))
        except ValueError as exc:
            raise ConfigError(
                f"--input {redact(uri)}: ack_wait and reconnect_for are seconds and batch a "
                f"count: {exc}"
            ) from exc
        if not reconnect_for > 0:  # NaN too; inf: wait for the server as long as it takes
            raise ConfigError(
                f"--input {redact(uri)}: reconnect_for is a number of seconds > 0, or inf to "
                f"wait as long as it takes (the default), not "
                f"{p['reconnect_for']}"
            )
        if batch < 1 or (ack_wait is not None and ack_wait <= 0):
            raise ConfigError(f"--input {redact(uri)}: ack_wait and batch must be positive")
        if ack_wait is not None and not (math.isfinite(ack_wait) and ack_wait <= MAX_ACK_WAIT):
            raise ConfigError(
                f"--input {redact(uri)}: ack_wait is a number of seconds up to "
                f"{MAX_ACK_WAIT:g} (a day), not {p['ack_wait']}"
            )
        durable = p.get("durable") or None
        if durable is not None and not _DURABLE.fullmatch(durable):
            raise ConfigError(
                f"--input {redact(uri)}: durable={durable} is not a NATS consumer name: it must "
                f"not hold whitespace, '.', '*', '>', '/' or '\\'; use e.g. durable=triage-1"
            )
        return cls(
            uri, server, p["stream"], p["subject"], key_field=key_field, follow=follow,
            durable=durable, ack_wait=ack_wait, batch=batch, reconnect_for=reconnect_for,
        )  # fmt: skip

    @property
    def follow(self) -> bool:  # type: ignore[override]
        # Without --follow the input ends once the consumer has nothing more to deliver; until
        # the fetcher knows that, "nothing now" means "ask again".
        return self._follow or not self._drained

    @property
    def where(self) -> str:
        return f"--input {redact(self.uri)}"

    # -- the connector interface ---------------------------------------------------------------

    def open(self, job: JobIdentity | None, *, checkpoint_interval: float) -> None:
        if self.durable is None:
            if job is None:
                raise ConfigError(f"{self.where}: name the consumer with ?durable=NAME")
            self.durable = f"ratchet-{job.id}"
        self._loop = _Loop("ratchet-nats-source")
        try:
            self._loop.call(self._open(checkpoint_interval))
        except BaseException:
            self.close()
            raise
        # The fetcher starts at the first next_record, after restore: a state refused there
        # (another --input) must not leave a batch of messages fetched and ack-pending.

    async def _open(self, checkpoint_interval: float) -> None:
        self._want = asyncio.Event()
        self._nc = await _connect(self.server, "--input", self.uri, self._outage)
        js = self._nc.jetstream()
        stream = await _stream(js, self.stream, "--input", self.uri)
        least = max(1.0, ACK_WAIT_INTERVALS * checkpoint_interval)
        try:
            info = await js.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            wait = self.ack_wait or max(DEFAULT_ACK_WAIT, least)
            self._check_ack_wait(wait, least, checkpoint_interval, "?ack_wait=SECONDS")
            try:
                info = await js.add_consumer(
                    self.stream,
                    ConsumerConfig(
                        durable_name=self.durable,
                        ack_policy=AckPolicy.EXPLICIT,
                        deliver_policy=DeliverPolicy.ALL,
                        ack_wait=wait,
                        filter_subject=self.subject,
                        max_ack_pending=20_000,
                    ),
                )
            except nats.js.errors.BadRequestError as exc:  # 10093: subject not in the stream
                subjects = ", ".join(stream.config.subjects or ())
                raise ConfigError(
                    f"{self.where}: JetStream refused a consumer of subject {self.subject!r} on "
                    f"stream {self.stream} ({exc.description}); the stream holds the subjects "
                    f"{subjects}: pass one of those"
                ) from exc
            self._wait = wait
            self._created = True
            log.info("created durable consumer %s on stream %s", self.durable, self.stream)
        else:
            cfg = info.config
            if cfg.filter_subject not in (None, "", self.subject):
                raise ConfigError(
                    f"{self.where}: the durable consumer {self.durable!r} reads subject "
                    f"{cfg.filter_subject!r}, not {self.subject!r}; pass its subject, or another "
                    f"?durable=NAME"
                )
            if self.ack_wait is not None and abs((cfg.ack_wait or 0) - self.ack_wait) > 1e-3:
                raise ConfigError(
                    f"{self.where}: the durable consumer {self.durable!r} has ack-wait "
                    f"{cfg.ack_wait:g} s, not the {self.ack_wait:g} s asked for; change it with "
                    f"`nats consumer edit`, or drop ?ack_wait"
                )
            self._check_ack_wait(
                float(cfg.ack_wait or 0), least, checkpoint_interval, "`nats consumer edit`"
            )
            self._wait = float(cfg.ack_wait or DEFAULT_ACK_WAIT)
        self._forget_acked(info)
        self._sub = await js.pull_subscribe_bind(self.durable, self.stream)

    def _check_ack_wait(self, wait: float, least: float, interval: float, fix: str) -> None:
        if wait < least:
            raise ConfigError(
                f"{self.where}: the consumer's ack-wait ({wait:g} s) is too short for the "
                f"checkpoint interval ({interval * 1000:g} ms): a message is acknowledged after "
                f"the checkpoint that holds it, so the ack-wait must be at least "
                f"{ACK_WAIT_INTERVALS} intervals and 1 s ({least:g} s), or the server redelivers "
                f"every message before it can be acknowledged. Raise it ({fix}) or lower "
                f"--checkpoint-interval"
            )

    def _forget_acked(self, info: Any) -> None:
        """Stream sequences at or below the consumer's ack floor are acknowledged for good:
        they are never redelivered, so the position need not remember them."""
        floor = int(getattr(info.ack_floor, "stream_seq", 0) or 0)
        with self._lock:
            # Infos answered out of order must not lower it.
            floor = self._floor = max(self._floor, floor)
            self._restored = {s for s in self._restored if s > floor}
            self._acking = {s: m for s, m in self._acking.items() if s > floor}

    def restore(self, position: dict[str, Any]) -> None:
        if not position:
            self._taken = True
            return
        if position.get("stream") != self.stream or "pending" not in position:
            raise ConfigError(
                f"this state directory read its inputs {_kind_of(position)}, not from the "
                f"JetStream stream {self.stream}; pass the same --input as before, or use a new "
                f"--state"
            )
        if position.get("durable") != self.durable:
            raise ConfigError(
                f"this state directory read stream {self.stream} through the consumer "
                f"{position.get('durable')!r}, not {self.durable!r}; pass "
                f"?durable={position.get('durable')} to resume it"
            )
        if self._created:
            # The state read through this consumer, and open found none: it was deleted (or the
            # server lost its store). A new one delivers the stream from its start: every
            # message this job processed and acknowledged would be processed again.
            raise ConfigError(
                f"{self.where}: the durable consumer {self.durable!r} that this state read "
                f"stream {self.stream} through is gone from the server (deleted, or the "
                f"server's store lost), and with it the job's progress: a new consumer would "
                f"deliver every message again, and those this job already processed would run "
                f"twice. Create it again to deliver from the first stream sequence the job has "
                f"not processed (`nats consumer add {self.stream} {self.durable} --pull --ack "
                f"explicit --filter {self.subject} --deliver SEQ`), or start over with a new "
                f"--state"
            )
        with self._lock:
            self._restored |= {int(s) for s in position["pending"]}
        self._taken = True

    def position(self) -> dict[str, Any]:
        with self._lock:
            pending = sorted(self._restored | self._handles.keys() | self._acking.keys())
        return {"stream": self.stream, "durable": self.durable, "pending": pending}

    def next_record(self) -> Record | None:
        if self._fetcher is None and self._loop is not None:
            self._fetcher = self._loop.submit(self._fetch_loop())
        while True:
            with self._lock:
                msg = self._ready.popleft() if self._ready else None
                low = len(self._ready) < self.batch * _PREFETCH // 2
            if low and self._want is not None and self._loop is not None:
                self._loop.loop.call_soon_threadsafe(self._want.set)
            if msg is None:
                if self._fetcher is not None and self._fetcher.done():
                    self._fetcher.result()  # re-raises what stopped it
                return None
            seq = int(msg.metadata.sequence.stream)
            with self._lock:
                if seq in self._handles:
                    self._handles[seq] = msg  # admitted, not checkpointed yet: ack it later
                    continue
                if seq <= self._floor:
                    # Acknowledged for good: a stale copy, redelivered while the first one
                    # waited in the buffer and fetched before the ack. Never admitted again.
                    continue
                if seq in self._restored or seq in self._acking:
                    # Already in a completed checkpoint: a redelivery, acknowledged again.
                    self._acks.append(self._loop_ack([msg]))
                    continue
                self._handles[seq] = msg
            self._prev = (seq, msg)
            try:
                value = json.loads(msg.data, parse_constant=_not_json)  # NaN is not JSON
            except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
                return Record(seq, error=f"stream {self.stream} message {seq}: invalid JSON ({exc})",
                              raw=msg.data[:65536].decode("utf-8", errors="replace"))  # fmt: skip
            key, err = _key_and_depth(value, self.key_field, f"stream {self.stream} message {seq}")
            if err is not None:
                return Record(seq, error=err, raw=msg.data[:65536].decode("utf-8", "replace"))
            return Record(seq, key=key, value=value)

    def unread(self) -> None:
        if self._prev is not None:
            seq, msg = self._prev
            with self._lock:
                self._handles.pop(seq, None)
                self._ready.appendleft(msg)
            self._prev = None

    def acknowledge(self, position: dict[str, Any]) -> None:
        batch = []
        with self._lock:
            for seq in position.get("pending", ()):
                msg = self._handles.pop(seq, None)
                if msg is not None:
                    self._acking[seq] = msg
                    batch.append(msg)
        if batch:
            self._acks.append(self._loop_ack(batch))
        self._acks = [f for f in self._acks if not f.done()]

    def _loop_ack(self, msgs: list[Any]) -> concurrent.futures.Future[None]:
        assert self._loop is not None
        return self._loop.submit(self._ack(msgs))

    async def _ack(self, msgs: list[Any]) -> None:
        """Send the acks, flush them, then learn the consumer's ack floor: a sequence leaves the
        position only once the server's floor passed it. An ack that is lost keeps its
        sequence in the position, so its redelivery is recognised."""
        try:
            for m in msgs:
                await m.ack()
            await self._nc.flush(timeout=10)
            info = await self._nc.jetstream().consumer_info(self.stream, self.durable)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("acknowledging %d message(s) of %s failed: %r", len(msgs), self.stream, exc)
            return
        self._forget_acked(info)

    async def _fetch_loop(self) -> None:
        assert self._want is not None
        touched = asyncio.get_running_loop().time()
        while not self._closing:
            if self._outage.since is not None:  # the client reconnects meanwhile
                self._check_outage()
                await asyncio.sleep(0.2)
                continue
            now = asyncio.get_running_loop().time()
            if now - touched >= self._wait / 3:
                touched = now
                await self._touch()
            with self._lock:
                full = len(self._ready) >= self.batch * _PREFETCH
            if full:
                self._want.clear()
                try:
                    await asyncio.wait_for(self._want.wait(), 1.0)
                except TimeoutError:
                    pass
                continue
            try:
                msgs = await self._sub.fetch(self.batch, timeout=0.5)
            except (nats.errors.TimeoutError, TimeoutError):
                await self._idle()
                continue
            except nats.errors.ConnectionClosedError as exc:
                if self._closing:
                    return
                raise self._lost(f"the connection closed ({exc!r})") from exc
            except nats.js.errors.ServiceUnavailableError as exc:  # JetStream not ready yet
                log.warning("fetching from stream %s failed, will retry: %r", self.stream, exc)
                await asyncio.sleep(1.0)
                continue
            except nats.js.errors.APIError as exc:  # the server's answer: retrying cannot help
                raise self._refused("fetching from", exc) from exc
            except nats.errors.Error as exc:
                log.warning("fetching from stream %s failed, will retry: %r", self.stream, exc)
                await asyncio.sleep(1.0)
                continue
            with self._lock:
                self._ready.extend(msgs)
            if len(msgs) < self.batch and not self._follow:
                await self._idle()  # maybe the end of the input already

    def _check_outage(self) -> None:
        """The server has been gone longer than reconnect_for: the job ends, to be started
        again (a supervised one waits for the server); what was admitted and not
        acknowledged is delivered again and recognised by the position."""
        since = self._outage.since
        if since is not None and SYSTEM_CLOCK.monotonic() - since >= self._outage.limit:
            raise self._lost(f"not back within {self._outage.limit:g} s (reconnect_for)")

    def _lost(self, how: str) -> ServerUnreachableError:
        address = _address(self.server)
        return ServerUnreachableError(
            f"{self.where}: lost NATS at {address}: {how}; the next start resumes from the "
            f"last checkpoint",
            server="NATS",
            address=address,
        )

    def _refused(self, doing: str, exc: Exception) -> ConfigError:
        """A JetStream API error: the server's answer (a consumer or stream deleted while the
        job ran), which a restart does not change."""
        said = getattr(exc, "description", None) or repr(exc)
        code = getattr(exc, "err_code", None)
        return ConfigError(
            f"{self.where}: JetStream refused {doing} the durable consumer {self.durable!r} of "
            f"stream {self.stream}: {said}{f' (error {code})' if code else ''}; if the consumer "
            f"or the stream was deleted, create it again (see docs/connectors.md, NATS) or "
            f"start over with a new --state"
        )

    async def _touch(self) -> None:
        """A slow agent leaves fetched messages in the buffer longer than the ack-wait: tell
        the server they are in progress, or it delivers every one of them again."""
        with self._lock:
            waiting = list(self._ready)
        for m in waiting:
            try:
                await m.in_progress()
            except nats.errors.Error:  # a redelivery is recognised anyway
                return

    async def _idle(self) -> None:
        """Nothing came: learn whether the consumer is drained (the end of a job without
        --follow), and forget restored sequences the server has acknowledged for good."""
        try:
            info = await self._nc.jetstream().consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError as exc:  # the consumer or the stream is gone
            raise self._refused("reading the state of", exc) from exc
        except nats.errors.Error as exc:
            log.warning("consumer info of %s failed: %r", self.durable, exc)
            return
        self._forget_acked(info)
        with self._lock:
            ours = len(self._handles) + len(self._acking) + len(self._restored) + len(self._ready)
            if info.num_pending == 0 and (info.num_ack_pending or 0) <= ours:
                self._drained = True

    def close(self) -> None:
        self._closing = True
        loop = self._loop
        if loop is None:
            return
        for fut in list(self._acks):
            try:
                fut.result(timeout=15)
            except Exception as exc:  # noqa: BLE001 - the position keeps what was not acked
                log.warning("an acknowledgement did not complete: %r", exc)
        if self._fetcher is not None:
            self._fetcher.cancel()  # stops it at its next await
            try:
                self._fetcher.result(timeout=5)
            except (Exception, concurrent.futures.CancelledError):  # noqa: BLE001, S110
                pass  # stopping: what it fetched is naked below
        if self._nc is not None and self._created and not self._taken and self._fetcher is None:
            try:
                loop.call(self._drop_unread_consumer(), timeout=15)
            except Exception as exc:  # noqa: BLE001 - closing anyway
                log.warning("%s: deleting the unread consumer failed: %r", self.where, exc)
        if self._nc is not None:
            try:
                loop.call(self._close(), timeout=15)
            except Exception as exc:  # noqa: BLE001 - closing anyway
                log.warning("closing the NATS connection failed: %r", exc)
        loop.close()
        self._loop = None

    async def _drop_unread_consumer(self) -> None:
        """The job was refused (or failed) at start, after open created the consumer and before
        restore took the state's position: delete the consumer, or it stays on the server for
        good, unused (named after this state's job id). Only one this open created, and only
        while the server says it delivered nothing: one that existed before may hold the job's
        progress (its ack floor), or be one the user made with settings of their own. A start
        whose position was taken is never undone here: its checkpoints name the consumer."""
        js = self._nc.jetstream()
        info = await js.consumer_info(self.stream, self.durable)
        delivered = int(getattr(info.delivered, "stream_seq", 0) or 0)
        floor = int(getattr(info.ack_floor, "stream_seq", 0) or 0)
        if delivered or floor or info.num_ack_pending:
            log.warning(
                "%s: keeping the durable consumer %s: it delivered messages (up to stream "
                "sequence %d) since this start created it",
                self.where, self.durable, delivered,
            )  # fmt: skip
            return
        await js.delete_consumer(self.stream, self.durable)
        self._created = False
        log.info(
            "deleted the durable consumer %s on stream %s: this start created it, and the job "
            "ended before reading from it",
            self.durable, self.stream,
        )  # fmt: skip

    async def _close(self) -> None:
        with self._lock:
            unread, self._ready = list(self._ready), collections.deque()
        # Fetched but never read: delivered again at once rather than after the ack-wait.
        await asyncio.gather(*(m.nak() for m in unread), return_exceptions=True)
        await _close_connection(self._nc)


async def _close_connection(nc: Any) -> None:
    """Send what is buffered (acks, naks), then close; a subscription with a pull request
    still open would hold up a drain. Disconnected, nothing can be sent: close at once."""
    try:
        if nc.is_connected:
            await nc.flush(timeout=5)
    finally:
        await nc.close()


class NatsSink(Sink):
    """Outputs published to a JetStream subject, de-duplicated by message id (module doc)."""

    def __init__(self, uri: str, server: str, stream: str, subject: str) -> None:
        self.uri, self.server, self.stream, self.subject = uri, server, stream, subject
        self._loop: _Loop | None = None
        self._nc: Any = None
        self._js: Any = None
        self._job: str | None = None
        self.duplicate_window: float | None = None
        self.duplicates = 0

    @classmethod
    def from_uri(cls, uri: str) -> NatsSink:
        _require("--output", uri)
        server, p = _parse(uri, "--output", _SINK_PARAMS)
        return cls(uri, server, p["stream"], p["subject"])

    def open(self, job: JobIdentity | None) -> None:
        if self._loop is not None:
            return
        self._job = job.id if job is not None else None
        self._loop = _Loop("ratchet-nats-sink")
        try:
            self._loop.call(self._open())
        except BaseException:
            self.close()
            raise

    async def _open(self) -> None:
        self._nc = await _connect(self.server, "--output", self.uri)
        self._js = self._nc.jetstream()
        info = await _stream(self._js, self.stream, "--output", self.uri)
        self.duplicate_window = info.config.duplicate_window
        log.info(
            "publishing outputs to %s (stream %s, duplicate window %s s)",
            self.subject, self.stream, self.duplicate_window,
        )  # fmt: skip

    def _payload(self, record: dict[str, Any]) -> bytes:
        if self._job is not None:
            record = {"id": record["id"], "job": self._job, **record}
        return to_json_line(record).encode("utf-8")

    def validate(self, record: dict[str, Any]) -> str | None:
        try:
            self._payload(record)
        except Exception as exc:  # noqa: BLE001 - whatever fails is the reason
            return f"it cannot be written as JSON: {type(exc).__name__}: {exc}"
        return None

    def write(self, records: list[dict[str, Any]]) -> int:
        if self._loop is None:
            self.open(None)
        assert self._loop is not None
        return int(self._loop.call(self._publish(records), timeout=_TIMEOUT + 5))

    async def _publish(self, records: list[dict[str, Any]]) -> int:
        """Publish; return how many the stream took as new (not duplicates of a message id
        it holds, as a record released again after a crash is)."""
        if not self._nc.is_connected:
            # Reconnecting: a publish would wait its whole timeout for an acknowledgement,
            # holding the checkpoints (and a stop) that long; the outputs stay in the outbox
            # and go with a release after the client is back.
            if self._nc.is_closed:  # it will not be back: a failure like any other
                raise nats.errors.ConnectionClosedError()
            address = _address(self.server)
            raise ServerUnreachableError(
                f"--output {redact(self.uri)}: NATS at {address} is away; the client "
                f"reconnects (nats: connection reconnecting)",
                server="NATS",
                address=address,
            )
        new = 0
        for i in range(0, len(records), _PUBLISH_CHUNK):
            chunk = records[i : i + _PUBLISH_CHUNK]
            acks = await asyncio.gather(
                *(
                    self._js.publish(
                        self.subject,
                        self._payload(r),
                        timeout=_TIMEOUT,
                        stream=self.stream,
                        headers={
                            "Nats-Msg-Id": f"{self._job}:{r['id']}" if self._job else r["id"],
                            "Ratchet-Output-Id": r["id"],
                            **({"Ratchet-Job": self._job} if self._job else {}),
                        },
                    )
                    for r in chunk
                )
            )
            duplicates = sum(1 for a in acks if getattr(a, "duplicate", False))
            self.duplicates += duplicates
            new += len(chunk) - duplicates
        return new

    def close(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if self._nc is not None:
            try:
                loop.call(_close_connection(self._nc), timeout=15)
            except Exception as exc:  # noqa: BLE001 - closing anyway
                log.warning("closing the NATS connection failed: %r", exc)
        loop.close()
        self._loop = None
