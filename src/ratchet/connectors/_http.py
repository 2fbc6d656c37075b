"""HTTP ingestion: `--input http://HOST:PORT` serves `POST /v1/events` (webhooks).

An event is admitted durably before the answer: the request's events are committed (fsync'd)
to an inbox, an SQLite file in the state directory, and only then does the client get 202.
The source reads the inbox in row order; its position in ratchet's checkpoint is the last
row id read, and rows at or below a checkpointed position are pruned once that checkpoint
completed (`acknowledge`). So an event answered with 202 survives a SIGKILL the moment after
the answer, and is processed once.

`Idempotency-Key` makes a retry harmless: the key is stored with the rows it admitted (kept
for `IDEMPOTENCY_TTL` seconds) and a request that repeats it is answered as the first one
was, admitting nothing. The standard library's threading HTTP server is enough here: the
work per request is a parse and one SQLite commit.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import sqlite3
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import ConfigError, StateError
from ratchet.connectors import query_of
from ratchet.runtime._io import (
    JobIdentity,
    Record,
    Source,
    _key_and_depth,
    _key_of,
    _kind_of,
    _not_json,
)

log = logging.getLogger("ratchet.connectors.http")

INBOX_FILE = "http-inbox.sqlite"
TOKEN_ENV = "RATCHET_INGEST_TOKEN"
IDEMPOTENCY_TTL = 24 * 3600.0
EVENTS_PATH = "/v1/events"
_PARAMS = frozenset({"max_pending", "max_body"})
_READ_BATCH = 512

_SCHEMA = """
CREATE TABLE IF NOT EXISTS inbox (id INTEGER PRIMARY KEY AUTOINCREMENT, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS idempotency (
    key TEXT PRIMARY KEY, digest TEXT NOT NULL, first INTEGER NOT NULL, count INTEGER NOT NULL,
    at REAL NOT NULL
);
"""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class BadRequest(Exception):
    """A request refused with a 4xx status and a message naming the problem."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def parse_events(body: bytes, key_field: str) -> list[str]:
    """The events of a request body (one JSON object or an array of them), each re-encoded as
    compact JSON; BadRequest naming the first problem (nothing is admitted then)."""
    try:
        # Decoded as UTF-8 first: json.loads(bytes) would take UTF-16 and UTF-32 too.
        value = json.loads(body.decode("utf-8-sig"), parse_constant=_not_json)  # no NaN
    except UnicodeDecodeError as exc:
        raise BadRequest(400, f"the body is not UTF-8: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise BadRequest(
            400, f"the body is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    except RecursionError:
        raise BadRequest(
            400, "the body is not JSON: arrays or objects nested too deeply to read"
        ) from None
    except ValueError as exc:  # e.g. an integer over Python's 4,300 digits
        raise BadRequest(400, f"the body is not JSON: {exc}") from None
    if isinstance(value, dict):
        events = [value]
        where = "the event"
    elif isinstance(value, list):
        if not value:
            raise BadRequest(400, "the body is an empty array; send at least one event")
        events = value
        where = "event {i}"
    else:
        raise BadRequest(
            400, f"the body is a JSON {type(value).__name__}; send an object or an array of them"
        )
    out = []
    for i, event in enumerate(events):
        _key, err = _key_and_depth(event, key_field, where.format(i=i))
        if err is not None:
            raise BadRequest(400, f"{err}; nothing in this request was admitted")
        out.append(json.dumps(event, ensure_ascii=False, separators=(",", ":")))
    return out


class Inbox:
    """The durable inbox: rows admitted by requests, read by the source, pruned after
    checkpoints. One writer connection behind a lock; the reader has its own connection."""

    def __init__(self, path: Path, clock: Clock = SYSTEM_CLOCK) -> None:
        self.path = path
        self.clock = clock
        self.lock = threading.Lock()
        try:
            self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")  # a 202 means fsync'd
            self.db.executescript(_SCHEMA)
            self.reader = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as exc:
            raise StateError(
                f"the HTTP inbox {path} cannot be opened ({exc}); restore it or use a new --state"
            ) from exc
        self.last = self.last_id()

    def last_id(self) -> int:
        row = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'inbox'").fetchone()
        return int(row[0]) if row else 0

    def admit(self, events: list[str], idem: str | None, body: bytes) -> tuple[int, int, bool]:
        """Commit `events`; (first row id, count, whether it repeats an earlier request)."""
        digest = hashlib.blake2b(body, digest_size=16).hexdigest()
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                if idem is not None:
                    hit = self.db.execute(
                        "SELECT digest, first, count FROM idempotency WHERE key = ?", (idem,)
                    ).fetchone()
                    if hit is not None:
                        self.db.execute("ROLLBACK")
                        if hit[0] != digest:
                            raise BadRequest(
                                422,
                                f"Idempotency-Key {idem!r} was used for a request with another "
                                f"body; use a new key for new events",
                            )
                        return int(hit[1]), int(hit[2]), True
                first = self.last + 1
                self.db.executemany(
                    "INSERT INTO inbox (id, body) VALUES (?, ?)",
                    [(first + i, e) for i, e in enumerate(events)],
                )
                if idem is not None:
                    self.db.execute(
                        "INSERT INTO idempotency VALUES (?, ?, ?, ?, ?)",
                        (idem, digest, first, len(events), self.clock.now()),
                    )
                self.db.execute("COMMIT")
            except sqlite3.Error:
                self.db.execute("ROLLBACK")
                raise
            self.last = first + len(events) - 1
            return first, len(events), False

    def read(self, after: int, limit: int) -> list[tuple[int, str]]:
        rows = self.reader.execute(
            "SELECT id, body FROM inbox WHERE id > ? ORDER BY id LIMIT ?", (after, limit)
        ).fetchall()
        return [(int(i), str(b)) for i, b in rows]

    def prune(self, upto: int) -> None:
        with self.lock:
            self.db.execute("DELETE FROM inbox WHERE id <= ?", (upto,))
            self.db.execute(
                "DELETE FROM idempotency WHERE at < ?", (self.clock.now() - IDEMPOTENCY_TTL,)
            )

    def close(self) -> None:
        with self.lock:
            self.db.close()
            self.reader.close()


class HttpSource(Source):
    """An ingestion endpoint: events POSTed to it are inputs. Always follows (never ends by
    itself); stop the job with SIGTERM/Ctrl-C. See the module docstring for durability."""

    follow = True

    def __init__(
        self,
        host: str,
        port: int,
        *,
        key_field: str = "key",
        token: str | None = None,
        max_pending: int = 10_000,
        max_body: int = 1 << 20,
    ) -> None:
        self.host, self.port = host, port
        self.key_field = key_field
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        if token is not None and not token.strip():
            raise ConfigError(f"{TOKEN_ENV} must not be empty")
        if token is None and not is_loopback(host):
            raise ConfigError(
                f"--input http://{host}:{port} listens on an address other than loopback: "
                f"ingestion there needs a token; set the environment variable {TOKEN_ENV} "
                f"(clients send 'Authorization: Bearer <token>'), or listen on 127.0.0.1"
            )
        if max_pending < 1 or max_body < 1:
            raise ConfigError("--input http://...: max_pending and max_body must be at least 1")
        self.token = token
        self.max_pending = max_pending
        self.max_body = max_body
        self._inbox: Inbox | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._read = 0  # the last inbox row handed to the engine
        self._buffer: collections.deque[tuple[int, str]] = collections.deque()
        self._prev: tuple[int, str] | None = None
        self._before = 0
        self.ready = False  # GET /v1/health answers 503 until the engine restored its state
        self._ack = 0
        self._ack_wake = threading.Event()
        self._closing = False
        self._pruner: threading.Thread | None = None

    @classmethod
    def from_uri(cls, uri: str, *, key_field: str) -> HttpSource:
        parts = urlsplit(uri)
        params = query_of(uri, "--input", _PARAMS)
        if parts.path not in ("", "/"):
            raise ConfigError(
                f"--input {uri}: give only the address (http://HOST:PORT); events are POSTed "
                f"to {EVENTS_PATH} on it"
            )
        try:
            port = parts.port
        except ValueError as exc:
            raise ConfigError(f"--input {uri}: {exc}") from exc
        if port is None or not parts.hostname:
            raise ConfigError(f"--input {uri}: name the host and port, e.g. http://127.0.0.1:8090")
        try:
            max_pending = int(params.get("max_pending", 10_000))
            max_body = int(params.get("max_body", 1 << 20))
        except ValueError as exc:
            raise ConfigError(f"--input {uri}: max_pending and max_body are integers") from exc
        return cls(
            parts.hostname, port, key_field=key_field, max_pending=max_pending, max_body=max_body
        )

    # -- the connector interface ---------------------------------------------------------------

    def open(self, job: JobIdentity | None, *, checkpoint_interval: float) -> None:
        if job is None:
            raise ConfigError("an HTTP source keeps its inbox in the state directory; use a Job")
        try:
            self._server = _Server((self.host, self.port), _Handler, self)
        except OSError as exc:
            raise ConfigError(
                f"--input http://{self.host}:{self.port} cannot listen: {exc.strerror or exc}"
            ) from exc
        try:
            self._inbox = Inbox(job.state_dir / INBOX_FILE)
        except BaseException:
            self._server.server_close()
            self._server = None
            raise
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},  # how long close() waits for the loop to notice
            name="ratchet-http-ingest",
            daemon=True,
        )
        self._thread.start()
        self._pruner = threading.Thread(target=self._prune_loop, name="ratchet-http-prune")
        self._pruner.daemon = True
        self._pruner.start()
        log.info("accepting events on http://%s:%s%s", self.host, self.port, EVENTS_PATH)

    def restore(self, position: dict[str, Any]) -> None:
        self.ready = True  # the engine runs (and handles signals) from now on
        if not position:
            return
        if "inbox" not in position:
            raise ConfigError(
                f"this state directory read its inputs {_kind_of(position)}, not from an HTTP "
                f"ingestion endpoint; pass the same --input as before, or use a new --state"
            )
        assert self._inbox is not None
        read = int(position["inbox"])
        if read > self._inbox.last:
            raise StateError(
                f"the checkpoint read the HTTP inbox up to row {read}, but "
                f"{self._inbox.path} ends at row {self._inbox.last}: the inbox file was replaced "
                f"or deleted; restore it, or use a new --state"
            )
        self._read = self._ack = read

    def position(self) -> dict[str, Any]:
        return {"inbox": self._read}

    def next_record(self) -> Record | None:
        if not self._buffer:
            assert self._inbox is not None
            self._buffer.extend(self._inbox.read(self._read, _READ_BATCH))
            if not self._buffer:
                return None
        row_id, body = self._buffer.popleft()
        self._prev = (row_id, body)
        before, self._read = self._read, row_id
        self._before = before
        value = json.loads(body)
        key, err = _key_of(value, self.key_field, f"inbox row {row_id}")  # depth: at POST
        if err is not None:
            return Record(row_id, error=err, raw=body)
        return Record(row_id, key=key, value=value)

    def unread(self) -> None:
        if self._prev is not None:
            self._buffer.appendleft(self._prev)
            self._read = self._before
            self._prev = None

    def acknowledge(self, position: dict[str, Any]) -> None:
        upto = int(position.get("inbox", 0))
        if upto > self._ack:
            self._ack = upto
            self._ack_wake.set()

    def close(self) -> None:
        self._closing = True
        self._ack_wake.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._pruner is not None:
            self._pruner.join(timeout=10)
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None

    # -- serving ---------------------------------------------------------------------------------

    def pending(self) -> int:
        assert self._inbox is not None
        return self._inbox.last - self._read

    def _prune_loop(self) -> None:
        pruned = self._ack
        while not self._closing:
            self._ack_wake.wait()
            self._ack_wake.clear()
            upto = self._ack
            if upto > pruned and self._inbox is not None and not self._closing:
                try:
                    self._inbox.prune(upto)
                    pruned = upto
                except sqlite3.Error as exc:  # pruned again at the next acknowledge
                    log.warning("the HTTP inbox could not be pruned: %s", exc)

    def handle(self, path: str, headers: Any, body: bytes) -> tuple[int, dict[str, Any]]:
        """One request (the handler has read the body): status and JSON answer."""
        if path.split("?", 1)[0] != EVENTS_PATH:
            raise BadRequest(404, f"no such endpoint {path!r}; POST events to {EVENTS_PATH}")
        if self.pending() >= self.max_pending:
            raise BadRequest(
                429,
                f"the inbox holds {self.max_pending} events not yet read by the job; retry later",
                retry_after=1,
            )
        events = parse_events(body, self.key_field)
        idem = headers.get("Idempotency-Key")
        if idem is not None and not (0 < len(idem) <= 255):
            raise BadRequest(400, "the Idempotency-Key header must be 1 to 255 characters")
        assert self._inbox is not None
        first, count, repeated = self._inbox.admit(events, idem, body)
        return 202, {"accepted": count, "first": first, "duplicate": repeated}

    def authorized(self, header: str | None) -> bool:
        if self.token is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("utf-8"), self.token.encode("utf-8")
        )


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, source: HttpSource) -> None:
        self.source = source
        super().__init__(address, handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a webhook sender reuses its connection
    # The status line and headers go out before the body: without TCP_NODELAY, Nagle's
    # algorithm holds the body until the client's delayed ACK (40 ms per request).
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("%s " + format, self.address_string(), *args)

    def _answer(
        self, status: int, body: dict[str, Any], extra: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the base's naming
        if self.path == "/v1/health":
            ready = self.server.source.ready
            self._answer(200 if ready else 503, {"status": "ok" if ready else "starting"})
        else:
            self._answer(
                405 if self.path == EVENTS_PATH else 404, {"error": "POST events to /v1/events"}
            )

    def do_POST(self) -> None:  # noqa: N802 - the base's naming
        source = self.server.source
        if not source.authorized(self.headers.get("Authorization")):
            self._answer(401, {"error": "missing or wrong bearer token"})
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._answer(411, {"error": "send a Content-Length header"})
            return
        if int(length) > source.max_body:
            self.close_connection = True
            self._answer(
                413, {"error": f"the body has {length} bytes; the limit is {source.max_body}"}
            )
            return
        body = self.rfile.read(int(length))
        try:
            status, answer = source.handle(self.path, self.headers, body)
        except BadRequest as exc:
            extra = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
            self._answer(exc.status, {"error": str(exc)}, extra)
            return
        except sqlite3.Error as exc:
            log.warning("an ingestion request failed: %s", exc)
            self._answer(
                503, {"error": f"the inbox cannot be written: {exc}"}, {"Retry-After": "1"}
            )
            return
        self._answer(status, answer)
