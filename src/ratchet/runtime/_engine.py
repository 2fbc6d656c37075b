"""The embedded engine: one process, asyncio, SQLite checkpoints. It performs; the machine decides.

Threads: the event loop (machine, dispatch, checkpoint capture), a pool of sync-action
workers, and one writer thread that owns the SQLite connection (checkpoints, durable-call
records, sink writes after a checkpoint completes).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock, SystemClock
from ratchet._errors import (
    UPGRADE_FIXES,
    BadInputError,
    CheckpointError,
    ConfigError,
    IncompatibleChangeError,
    NonDeterminismError,
    RatchetError,
    ServerUnreachableError,
    SinkError,
    StateError,
)
from ratchet.runtime._dispatch import (
    REPLAY_FN,
    SIGNAL_FN,
    Binding,
    CallJournal,
    Dispatcher,
    FusedRunners,
    Outcome,
    TaskCalls,
    split_attempt,
    take_all,
)
from ratchet.runtime._io import Sink, Source, stopped_at_bad_input, writable
from ratchet.runtime._journal import (
    decode_event,
    decode_journal,
    decode_memory,
    decoded,
    encode_event,
    encode_journal,
    encode_memory,
)
from ratchet.runtime._machine import (
    MAX_TASK_ID,
    Delta,
    Machine,
    RestoredRun,
    Task,
    TraceStep,
    memory_trace,
    trace_dicts,
)
from ratchet.runtime._memops import LTM_ADD, expire
from ratchet.runtime._otel import RunExporter
from ratchet.runtime._otel import wanted as otel_wanted
from ratchet.store import codec
from ratchet.store._base import (
    Adopted,
    CallRecord,
    CheckpointRows,
    CheckpointStore,
    SignalRow,
    signal_key_type,
)
from ratchet.store._files import resume_after
from ratchet.store._traces import pack_rows, pack_trace

__all__ = ["Binding", "Engine", "EngineConfig", "EngineResult", "TaskCalls"]

log = logging.getLogger("ratchet.engine")


@dataclass
class EngineConfig:
    """Knobs of the embedded engine. Times are in seconds."""

    checkpoint_interval: float = 0.2
    max_concurrent_runs: int = 64
    max_buffered_inputs: int = 1000
    # Tasks one run may dispatch; past it the run ends with an error output (an event loop
    # between actions must not grow the state without bound).
    max_tasks_per_run: int = 10_000
    tolerable_checkpoint_failures: int = 3
    sync_workers: int = 16
    # Tasks a sync worker takes at once. 1 keeps a blocking action from holding up any task
    # but its own; more trades that isolation for less hand-off under heavy load.
    sync_batch: int = 1
    synchronous: str = "NORMAL"
    on_bad_input: str = "stop"  # or "skip", or "dead-letter"
    # A job stops (after a final checkpoint) once more than this many runs ended in error.
    max_errors: int | None = None
    # Traces of completed runs kept in the state: "off", the last N per key ("20"), an age
    # ("7d", "12h", "30m", "90s"), or both ("20,7d").
    trace_retention: str = "20"
    # Export run traces as OpenTelemetry spans over OTLP/HTTP to this URL (or to what the
    # standard OTEL_EXPORTER_OTLP_* variables name); needs the `otel` extra.
    otel_endpoint: str | None = None
    follow_poll: float = 0.05

    def validate(self) -> None:
        if self.checkpoint_interval < 0:
            raise ConfigError(f"checkpoint_interval must be >= 0, not {self.checkpoint_interval!r}")
        for name in (
            "max_concurrent_runs",
            "max_buffered_inputs",
            "sync_workers",
            "sync_batch",
            "max_tasks_per_run",
        ):
            value = getattr(self, name)
            if value < 1:  # named as the command line (where it has a flag) and the API say it
                flag = "" if name == "sync_batch" else f"--{name.replace('_', '-')} "
                raise ConfigError(f"{flag}({name}=) must be at least 1, not {value!r}")
        if self.tolerable_checkpoint_failures < 0:
            raise ConfigError(
                "--tolerable-checkpoint-failures (tolerable_checkpoint_failures=) must be at "
                f"least 0, not {self.tolerable_checkpoint_failures!r}"
            )
        if self.on_bad_input not in ("stop", "skip", "dead-letter"):
            raise ConfigError(
                f"on_bad_input must be 'stop', 'skip' or 'dead-letter', not {self.on_bad_input!r}"
            )
        if self.max_errors is not None and self.max_errors < 0:
            raise ConfigError(f"max_errors must be >= 0, not {self.max_errors!r}")
        self.retention()

    def retention(self) -> tuple[int | None, float | None] | None:
        """The trace retention as (last N per key, max age in seconds); None: traces off."""
        text = str(self.trace_retention).strip().lower()
        if text == "off":
            return None
        keep: int | None = None
        age: float | None = None
        units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
        for part in (p.strip() for p in text.split(",")):
            if part.isdigit() and keep is None:
                keep = int(part)
            elif part[:-1].replace(".", "", 1).isdigit() and part[-1:] in units and age is None:
                age = float(part[:-1]) * units[part[-1]]
            else:
                raise ConfigError(
                    f"trace retention {self.trace_retention!r}: use 'off', a count of runs per "
                    f"key ('20'), an age ('7d', '12h', '30m', '90s'), or both ('20,7d')"
                )
        return keep, age

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_upgrade(
    binding: Binding, runs: list[RestoredRun], calls: list[CallRecord], adopted: Adopted
) -> None:
    """Refuse, before anything runs, a pinned run whose half-done task lost its action.

    A task of a removed action is left out of a run that reaches it, unless it had already
    made durable calls: dropping those would hide calls that happened.
    """
    if not adopted.pinned:
        return
    known = set(binding.known_actions())
    by_seq = {r.seq: r for r in runs}
    for rec in calls:
        if rec.seq not in adopted.pinned or rec.fn == REPLAY_FN:  # a marker, not a call
            continue
        task_id = split_attempt(rec.task_id)[0]  # a later attempt's records: `r>ask#2`
        action = task_id.rpartition(">")[2]
        run = by_seq.get(rec.seq)
        done = run is not None and any(e.task_id == task_id for e in run.journal)
        if action not in known and not done:
            key = run.key if run is not None else "?"
            raise IncompatibleChangeError(
                f"key {key!r}, run of input {rec.seq}: task {rec.task_id} was in flight with "
                f"recorded durable call {rec.fn} when the agent changed, and its action "
                f"{action!r} was removed, so the task can neither finish nor be dropped "
                f"silently. {UPGRADE_FIXES}"
            )


def warn_orphaned_events(binding: Binding, runs: list[RestoredRun], adopted: Adopted) -> None:
    """Say at start which pinned runs send events that no action of this version takes.

    A pinned run keeps its version's dispatch, and an action this version removed is left out
    of it (docs/runtime.md, "remove an action"): compatible, so not refused. But when every
    action of that version that heard an event type was removed (a rename looks so: `after`
    became `after_renamed`), the run's events of that type reach nobody, and the work they
    stood for is dropped without a word. One warning line per pinned version names its runs,
    the event types and the new version's actions that hear them (which the runs do not get).
    """
    if not adopted.pinned:
        return
    known = set(binding.known_actions())
    new_table = binding.version.table
    by_table: dict[str, tuple[Any, list[RestoredRun]]] = {}
    for run in runs:
        pinned = adopted.pinned.get(run.seq)
        if pinned is not None:
            by_table.setdefault(repr(pinned.table), (pinned.table, []))[1].append(run)
    for table, pinned_runs in by_table.values():
        kept = {e for name, evs in table if name in known for e in evs}
        lost: dict[str, list[str]] = {}  # event type -> the removed actions that heard it
        for name, evs in table:
            if name not in known:
                for e in evs:
                    if e not in kept:
                        lost.setdefault(e, []).append(name)
        if not lost:
            continue
        which = ", ".join(f"key {r.key!r} input {r.seq}" for r in pinned_runs[:5])
        if len(pinned_runs) > 5:
            which += f" and {len(pinned_runs) - 5} more"
        parts = []
        for e, names in sorted(lost.items()):
            now = [n for n, evs in new_table if e in evs]
            also = f"; this version's {', '.join(now)} hears it, not for these runs" if now else ""
            parts.append(f"{e} (heard only by {', '.join(names)}{also})")
        log.warning(
            "runs in flight %s keep the dispatch of the version they started under, and every "
            "action of it that heard these event types was removed, so such events these runs "
            "send reach no action: %s. If an action was renamed, stop the job and run the "
            "previous version until `ratchet runs list` shows none of these runs (docs/runtime.md, "
            "'Upgrading an agent')",
            which, "; ".join(parts),
        )  # fmt: skip


EVENT_FIXES = (
    "Fixes: keep the event type's name and give a new field a default (or keep the old "
    "fields), so the stored event still validates; run the previous agent version until the "
    "run completes; or stop the job and `ratchet runs restart --state DIR --key KEY` (the run "
    "starts again from its input; calls it made may be made again) or `ratchet runs abandon "
    "--state DIR --key KEY` (its input goes to the dead letters). See docs/runtime.md, "
    "'Upgrading an agent'"
)


def check_events(binding: Binding, runs: list[RestoredRun]) -> None:
    """Refuse, before anything runs, a run in flight holding an event that an action still to
    run would get and that this version's event class no longer accepts (a renamed type, a
    new required field, another field type).

    Events are validated when a listener gets them; without this, a delayed event delivered
    after the upgrade failed its action with a ValidationError, and the run became a dead
    letter whose redrive repeated its committed calls. Only events with a listener whose task
    is not journaled are checked: a journaled task is not run again, and outputs are never
    decoded into their class.
    """
    known = set(binding.known_actions())
    for run in runs:
        done = {e.task_id for e in run.journal}
        listeners = run.listeners or binding.listeners
        is_output = run.is_output or binding.is_output
        held: list[tuple[str, str, Any]] = [("r", "its input", run.input_event)]
        for entry in run.journal:
            if entry.task_id[:1] != "!":
                for index, event in enumerate(entry.events):
                    held.append((f"{entry.task_id}.{index}", f"task {entry.task_id}", event))
        for event_id, sender, event in held:
            what = "event"
            try:
                timed = binding.delayed(event)
            except StateError as exc:  # a delayed event of a type no class is named for now
                raise IncompatibleChangeError(
                    f"key {run.key!r}, run of input {run.seq}: the delayed event that {sender} "
                    f"sent cannot be delivered: {exc}. {EVENT_FIXES}"
                ) from exc
            if timed is not None:
                event, what = timed[1], "delayed event"
            if is_output(event):
                continue
            eid = event_id
            if len(eid) > MAX_TASK_ID:  # as the machine names a long event id
                eid = f"~{hashlib.blake2b(eid.encode(), digest_size=12).hexdigest()}"
            waiting = [a for a in listeners(event) if a in known and f"{eid}>{a}" not in done]
            if not waiting:
                continue
            try:
                event.thaw()
            except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, or what a
                # validator raised that pydantic passes on (a TypeError): refused the same way
                raise IncompatibleChangeError(
                    f"key {run.key!r}, run of input {run.seq}: the {what} "
                    f"{binding.describe_event(event)} that {sender} sent (for "
                    f"{', '.join(waiting)}) does not validate against this version's class: "
                    f"{_one_line(exc)}. {EVENT_FIXES}"
                ) from exc


def _one_line(exc: Exception) -> str:
    """A validation error as one line: `field: problem; ...` (pydantic's text is a table)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'event'}: {e['msg']}" for e in errors()
            )
        except (TypeError, KeyError):
            pass
    return " ".join(str(exc).split())


def _nothing() -> None:
    """A writer job that only waits for the jobs queued before it."""


def _done(value: Any) -> concurrent.futures.Future[Any]:
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    fut.set_result(value)
    return fut


class _Writer(threading.Thread):
    """The single thread that writes SQLite; durable-call records are group-committed."""

    def __init__(
        self, store: CheckpointStore, clock: Clock = SYSTEM_CLOCK, tolerable_failures: int = 3
    ) -> None:
        super().__init__(name="ratchet-writer", daemon=True)
        self.store = store
        self.clock = clock
        self.tolerable_failures = tolerable_failures
        self._q: queue.SimpleQueue[tuple[str, Any, concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._writing = False  # a batch taken from the queue is being written

    def busy(self) -> bool:
        """Whether anything is queued or being written (racy by a batch: a hint)."""
        return self._writing or not self._q.empty()

    def put_call(self, record: CallRecord) -> concurrent.futures.Future[None]:
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._q.put(("call", record, fut))
        return fut

    def drop_calls(self, seq: int, task_id: str, from_idx: int) -> concurrent.futures.Future[Any]:
        """Delete a refused attempt's records (`TaskCalls.discard_new`), after every record
        queued before (a job runs after the calls of its group); the signals they took go
        back (the future's result). A store without it: the replay marker makes them
        optional."""
        return self._if_store_has("drop_calls", seq, task_id, from_idx)

    def release_signals(
        self, seq: int, task_id: str, idxs: list[int]
    ) -> concurrent.futures.Future[Any]:
        """Put back the signals unused records of an unaccepted attempt took
        (`TaskCalls.release_unused`), after every record queued before."""
        return self._if_store_has("release_signals", seq, task_id, idxs)

    def release_attempt_signals(
        self, seq: int, task_id: str, key: Any
    ) -> concurrent.futures.Future[Any]:
        """Put back the signals a failed attempt that will be tried again took
        (`TaskCalls.release_attempt`), after every record queued before."""
        return self._if_store_has("release_attempt_signals", seq, task_id, key)

    def _if_store_has(self, name: str, *args: Any) -> concurrent.futures.Future[Any]:
        """The store's optional signal-returning operation `name`, queued as a job; a store
        without it gives nothing back (the signals stay taken)."""
        operation = getattr(self.store, name, None)
        if operation is None:
            return _done([])
        return self.submit(lambda: operation(*args))

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._q.put(("job", fn, fut))
        return fut

    def stop(self) -> None:
        self._q.put(("stop", None, concurrent.futures.Future()))

    def run(self) -> None:
        while True:
            items = take_all(self._q)
            self._writing = True
            calls = [(rec, fut) for kind, rec, fut in items if kind == "call"]
            if calls:
                error = self._put_calls([rec for rec, _ in calls])
                for _, fut in calls:
                    _resolve(fut, error=error)
            for kind, fn, fut in items:
                # Jobs run even if their waiter went away: a checkpoint, once captured, is written.
                if kind == "job":
                    try:
                        _resolve(fut, fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
                        _resolve(fut, error=exc)
                elif kind == "stop":
                    _resolve(fut)
                    return
            self._writing = False

    def _put_calls(self, records: list[CallRecord]) -> CheckpointError | None:
        """Write a group of call records, retrying as a checkpoint would; None once durable.

        A storage fault is the engine's, not the action's: retried (records are keyed
        naturally, so a retry is harmless) up to the checkpoint tolerance, then a
        CheckpointError that stops the job instead of turning into the action's error.
        """
        attempt = 0
        while True:
            try:
                self.store.put_calls(records)
            except Exception as exc:  # noqa: BLE001 - any storage fault is retried
                attempt += 1
                if attempt > self.tolerable_failures:
                    what, then = resume_after(exc)
                    return CheckpointError(
                        f"durable-call records could not be written {attempt} time(s) in a row "
                        f"(tolerable: {self.tolerable_failures}); last error: {what}. The last "
                        f"completed checkpoint is intact; {then}"
                    )
                log.warning("durable-call records not written (attempt %d): %s", attempt, exc)
                self.clock.sleep_sync(min(0.01 * 2**attempt, 1.0))
            else:
                return None


class _ValueTooLarge(ValueError):
    """A value of a checkpoint is larger than the store keeps in one value."""


def _too_large(exc: BaseException) -> bool:
    """Whether a checkpoint failed on a value too large for the store (SQLite's
    SQLITE_TOOBIG), which no retry and no restart can write."""
    return isinstance(exc, _ValueTooLarge) or (
        getattr(exc, "sqlite_errorname", None) == "SQLITE_TOOBIG"
    )


def _pack_trace(started: float | None, tasks: list[dict[str, Any]]) -> bytes:
    """A completed run's trace as the `traces` table stores it."""
    return pack_trace(started, tasks)


# How the end of a job retries outputs its sink refused: the first pause (it doubles), and the
# longest between two tries while the sink's server is away.
_LEFT_FIRST_DELAY = 0.1
_LEFT_MAX_DELAY = 5.0


def _trace_packer(
    describe: Callable[[Any], str],
) -> Callable[[float | None, list[TraceStep]], bytes]:
    """The machine's `pack_trace`: a completed run's steps as `pack_trace` packs their dicts,
    laid out directly (the same bytes; a step that was not timed falls back to the dicts)."""

    def pack(started: float | None, steps: list[TraceStep]) -> bytes:
        rows: list[list[Any]] = []
        base: float | None = None
        for task_id, action, index, event, replayed, res in steps:
            began = res.started
            if began is None:
                return pack_trace(started, trace_dicts(steps, describe))
            if base is None:
                base = began + 0.0
            ops = res.stm_ops
            row: list[Any] = [
                task_id,
                None if task_id[task_id.rfind(">") + 1 :] == action else action,
                index,
                describe(event),
                replayed,
                memory_trace(ops) if ops else [],
                list(map(describe, res.events)),
                round((began - base) * 1e6),
                round(res.duration * 1e6),
            ]
            if res.trace:
                row.append(dict(res.trace))
            rows.append(row)
        return pack_rows(started, base, rows)

    return pack


def _resolve(
    fut: concurrent.futures.Future[Any], result: Any = None, error: BaseException | None = None
) -> None:
    """Settle a future whose waiter may have been cancelled meanwhile."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


@dataclass
class CheckpointStats:
    """Flink-like checkpoint statistics, live (the store has the persisted part)."""

    completed: int = 0
    failed: int = 0
    in_progress: int = 0
    restored: int = 0
    latest_completed: dict[str, Any] | None = None
    latest_failed: dict[str, Any] | None = None
    latest_restored: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "counts": {
                "completed": self.completed,
                "failed": self.failed,
                "in_progress": self.in_progress,
                "restored": self.restored,
                "total": self.completed + self.failed + self.in_progress,
            },
            "latest": {
                "completed": self.latest_completed,
                "failed": self.latest_failed,
                "restored": self.latest_restored,
            },
        }


@dataclass
class EngineResult:
    inputs: int = 0
    runs_completed: int = 0
    outputs: int = 0
    tasks_executed: int = 0
    tasks_replayed: int = 0
    restored_runs: int = 0
    restore_seconds: float | None = None  # reading the state and rebuilding keys and runs
    runs_failed: int = 0  # runs that ended in an error (each also a dead letter)
    dead_letters: int = 0  # dead letters this run recorded (failed runs and bad lines)
    redriven: int = 0  # dead letters this run admitted again
    restored_from: dict[str, Any] | None = None
    bad_inputs: list[str] = field(default_factory=list)
    stopped_by: str = "end of input"
    checkpoints: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


# How a stop for --max-errors begins (a sharded job's reason is "shard N: " and this).
MAX_ERRORS_STOP = "more than"


def stopped_for_max_errors(stopped_by: str) -> bool:
    """Whether a result's `stopped_by` is a --max-errors stop (of the job or of a shard)."""
    return MAX_ERRORS_STOP in stopped_by


WAITING_FOR_SIGNALS = " run(s) waiting for signals"


def waiting_for_signals(runs: int) -> str:
    """The `stopped_by` of a bounded job that ended with `runs` runs parked on signals
    (`ratchet run` then says they stay parked)."""
    return f"{runs}{WAITING_FOR_SIGNALS}"


def runs_waiting_for_signals(stopped_by: str) -> int:
    """How many runs a `stopped_by` says are parked on signals (0: none, or another stop):
    a sharded job adds its shards' up, to end as one process does."""
    count, _, rest = stopped_by.partition(" ")
    return int(count) if count.isdigit() and f" {rest}" == WAITING_FOR_SIGNALS else 0


def _first_match(
    pending: collections.deque[tuple[int, bytes, float, str | None]],
    waiters: collections.deque[_SignalWait],
) -> tuple[int, _SignalWait] | None:
    """The oldest signal a waiter can take, and the oldest such waiter. A signal sent after a
    wait's deadline is not that wait's: it times out (as it does when the deadline passed
    while no job ran), the signal waits for the next."""
    for i, (_sid, _value, sent_at, key_type) in enumerate(pending):
        for w in waiters:
            if (
                not w.closing
                and not w.done.done()
                and (w.until is None or sent_at <= w.until)
                and (key_type is None or key_type == signal_key_type(w.task.run.key))
            ):
                return i, w
    return None


def stopped_by_signal(stopped_by: str) -> bool:
    """Whether a result's `stopped_by` is a stop SIGTERM or SIGINT asked for."""
    return stopped_by.startswith("signal ")


@dataclass(eq=False)
class _SignalWait:
    task: Task
    calls: TaskCalls
    idx: int
    name: str
    since: float
    until: float | None
    done: asyncio.Future[bytes | None]
    closing: bool = False  # a delivery or a timeout is being written
    parked: bool = True  # still waiting on the outside world (not on our own write)


@dataclass(eq=False)
class _Breaker:
    """An open circuit: a resource that failed transiently past the retries of its calls."""

    since: float
    delay: float
    max_delay: float
    next_probe: float
    error: str
    closed: asyncio.Event
    probing: bool = False


class _EngineWaits:
    """The embedded engine's durable waits: sleeps and delayed events on the engine's clock,
    signals from the store's `signals` table. Everything here runs on the engine's loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sleeping: dict[Task, float] = {}  # task -> deadline
        self.timers = 0  # delayed events scheduled and not delivered
        self.cursor = 0  # the highest signal id read from the store
        # (key text, name) -> signals not consumed, in the order sent: (id, value, sent at,
        # the key's type: 'str', 'int', or None for either)
        self.signals: dict[
            tuple[str, str], collections.deque[tuple[int, bytes, float, str | None]]
        ] = {}
        self.waiters: dict[tuple[str, str], collections.deque[_SignalWait]] = {}
        self.put_back: set[int] = set()  # ids of signals put back while this engine ran
        self.breakers: dict[str, _Breaker] = {}  # resources unavailable now
        # The engine's clock read directly (every task reads it twice, for its trace): the
        # system clock's `now` is `time.time`, called without its wrapper.
        clock = engine.clock
        self.now: Callable[[], float] = time.time if type(clock) is SystemClock else clock.now

    def sleep_sync(self, seconds: float) -> None:
        self.engine.clock.sleep_sync(seconds)

    # -- resources (circuit breakers) ------------------------------------------------------

    def unavailable(
        self, resource: str, probe_delay: float, max_probe_delay: float, error: str
    ) -> float:
        now = self.now()
        b = self.breakers.get(resource)
        if b is None:
            b = self.breakers[resource] = _Breaker(
                now, probe_delay, max_probe_delay, now + probe_delay, error, asyncio.Event()
            )
            log.warning(
                "paused: %s unavailable (%s); admitting no new input, next probe in %.3gs",
                resource, error, probe_delay,
            )  # fmt: skip
        elif b.probing:  # the probe failed: wait longer before the next
            b.probing = False
            b.delay = min(b.delay * 2, b.max_delay)
            b.next_probe = now + b.delay
            b.error = error
        self.engine._poke()
        return b.next_probe

    def available(self, resource: str) -> None:
        b = self.breakers.pop(resource, None)
        if b is not None:
            log.warning("resumed: %s is available again", resource)
            b.closed.set()
            self.engine._poke()

    async def until_available(self, task: Task, resource: str, probe_at: float) -> None:
        clock = self.engine.clock
        b = self.breakers.get(resource)
        if b is None:  # restarted while it was down: reopen it as recorded
            now = self.now()
            b = self.breakers[resource] = _Breaker(
                now, max(probe_at - now, 0.001), 60.0, probe_at, "unavailable before a restart",
                asyncio.Event(),
            )  # fmt: skip
        self._parked(task, True)
        try:
            while not b.closed.is_set():
                left = b.next_probe - clock.now()
                if left <= 0 and not b.probing:
                    b.probing = True  # this call probes; the others wait for its outcome
                    return
                if await self.engine._sleep_unless(
                    b.closed, max(left, 0.001) if left > 0 else b.delay
                ):
                    return
        finally:
            self._parked(task, False)

    def paused(self) -> list[dict[str, Any]]:
        return [
            {"resource": name, "since": b.since, "next_probe": b.next_probe, "error": b.error}
            for name, b in self.breakers.items()
        ]

    def _parked(self, task: Task, waiting: bool) -> None:
        engine = self.engine
        engine.machine.wait(task, waiting)
        # Runs that start now must not become the waiting action's asyncio children (which
        # are cancelled when it returns): the engine performs them outside its context.
        self._outside(engine._pump_and_poke)

    @staticmethod
    def _outside(fn: Callable[..., Any], *args: Any) -> None:
        asyncio.get_running_loop().call_soon(fn, *args, context=contextvars.Context())

    async def until(self, task: Task, deadline: float) -> None:
        clock = self.engine.clock
        self.sleeping[task] = deadline
        self._parked(task, True)
        try:
            left = deadline - clock.now()
            if left > 0:
                await clock.sleep(left)
        finally:
            del self.sleeping[task]
            self._parked(task, False)

    async def deliver_at(self, run: Any, event_id: str, due: float) -> None:
        engine = self.engine
        self.timers += 1
        try:
            left = due - engine.clock.now()
            if left > 0:
                await engine.clock.sleep(left)
        finally:
            self.timers -= 1
        try:
            engine.machine.fire(run, event_id)
            engine._pump()
        except RatchetError as exc:
            engine._fail(exc)
        engine._poke()

    async def signal(
        self, task: Task, calls: TaskCalls, idx: int, name: str, deadline: float | None
    ) -> bytes | None:
        engine = self.engine
        loop = asyncio.get_running_loop()
        wait = _SignalWait(task, calls, idx, name, self.now(), deadline, loop.create_future())
        where = (str(task.run.key), name)
        self.waiters.setdefault(where, collections.deque()).append(wait)
        self._parked(task, True)
        timer: asyncio.Task[None] | None = None
        if deadline is not None:
            timer = asyncio.get_running_loop().create_task(
                self._time_out(wait, deadline), context=contextvars.Context()
            )
        try:
            self._match(where)
            return await wait.done
        finally:
            if timer is not None:
                timer.cancel()
            waits = self.waiters.get(where)
            if waits is not None and wait in waits:
                waits.remove(wait)
            self._resume(wait)
            engine._poke()

    def _resume(self, wait: _SignalWait) -> None:
        """The wait is over (its outcome is being written, or it was cancelled): the run
        counts as working again, so neither the bounded job's end nor a test clock skips it."""
        if wait.parked:
            wait.parked = False
            self._parked(wait.task, False)

    async def _time_out(self, wait: _SignalWait, deadline: float) -> None:
        clock = self.engine.clock
        left = deadline - clock.now()
        if left > 0:
            await clock.sleep(left)
        if wait.closing or wait.done.done():
            return
        wait.closing = True
        self._resume(wait)
        record = codec.encode({"timeout": True, "since": wait.since, "until": deadline})
        try:
            await asyncio.wrap_future(
                wait.calls.write(wait.idx, SIGNAL_FN, wait.name, "error", record)
            )
        except Exception as exc:  # noqa: BLE001 - a storage fault stops the job
            self.engine._fail(exc)
            return
        if not wait.done.done():
            wait.done.set_result(None)

    def signals_back(self, rows: list[SignalRow]) -> None:
        loop = self.engine._loop
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            self._back(rows)
        else:  # a sync action's worker thread
            loop.call_soon_threadsafe(self._back, rows)

    def _back(self, rows: list[SignalRow]) -> None:
        """Signals put back (`signals_back`): pending again, in their place by id."""
        self.add_signals([], rows)

    def add_signals(self, rows: list[SignalRow], back: list[SignalRow] | None = None) -> None:
        """Signals read from the store (`rows`: sent since the cursor, in id order) and signals
        put back (`back`: taken before, their ids kept), pending in the order sent: by id,
        whichever arrives first. Waiters are matched once both are in place, so a signal read
        with a put-back older one never goes ahead of it. A put-back signal's id may be above
        the cursor (taken by an earlier process): a later read must not add it a second time,
        so it is remembered."""
        touched = set()
        for row in back or ():
            self.put_back.add(row[0])
            if self._pend(row, check=True):
                touched.add((row[1], row[2]))
        for row in rows:
            if row[0] <= self.cursor or row[0] in self.put_back:
                continue
            self.cursor = row[0]
            self._pend(row, check=False)
            touched.add((row[1], row[2]))
        for where in touched:
            self._match(where)

    def _pend(self, row: SignalRow, check: bool) -> bool:
        """Add one signal to its key and name's pending signals, in its place by id (at the end,
        as a new one's is). `check`: leave out one pending already. Whether it was added."""
        sid, key_text, name, value, sent_at, key_type = row
        pending = self.signals.setdefault((key_text, name), collections.deque())
        if check and any(e[0] == sid for e in pending):
            return False
        entry = (sid, value, sent_at, key_type)
        if not pending or pending[-1][0] < sid:
            pending.append(entry)
        else:
            pending.insert(next(i for i, e in enumerate(pending) if e[0] >= sid), entry)
        return True

    async def poll_signals(self) -> None:
        """Read signals sent, and redrives asked for, since the last look (other processes
        write both)."""
        engine = self.engine

        def look() -> tuple[list[SignalRow], list[tuple[int, bytes, bytes]], list[SignalRow]]:
            rows = engine.store.signals_after(self.cursor)
            redrives = engine.store.redrives()
            return rows, redrives, engine._redrive_signals(redrives)

        rows, redrives, back = await asyncio.wrap_future(engine._writer.submit(look))
        # Together: a run of the key waiting now takes the oldest (a signal read here can be
        # newer than one put back); before the redriven runs start, theirs to take again.
        self.add_signals(rows, back)
        if redrives:
            engine._redrive(redrives)

    def _match(self, where: tuple[str, str]) -> None:
        """Hand the oldest signal to the oldest waiter of a key and name, in a group.

        `where` holds the text of a key: the string key "1" and the integer key 1 share it,
        and a signal typed for one is not the other's (one stored untyped, before types were,
        is either's). A signal no waiter can take does not hold back a later one of the other
        key; for one key, the oldest goes first."""
        pending = self.signals.get(where)
        waiters = self.waiters.get(where)
        while pending and waiters:
            found = _first_match(pending, waiters)
            if found is None:
                return
            i, wait = found
            sid, value = pending[i][:2]
            del pending[i]
            wait.closing = True
            self._resume(wait)
            self._outside(self.engine._spawn, self._consume(wait, sid, value))
        if not pending:
            self.signals.pop(where, None)

    async def _consume(self, wait: _SignalWait, sid: int, value: bytes) -> None:
        engine = self.engine
        c = wait.calls
        record = CallRecord(c.seq, c.task_id, wait.idx, SIGNAL_FN, wait.name, "ok", value)
        try:
            await asyncio.wrap_future(
                engine._writer.submit(lambda: engine.store.consume_signal(sid, record))
            )
        except Exception as exc:  # noqa: BLE001 - a storage fault stops the job
            engine._fail(exc)
            return
        if not wait.done.done():
            wait.done.set_result(value)

    def describe(self) -> list[dict[str, Any]]:
        """What parked runs wait on, for `status` and the REST API."""
        out: list[dict[str, Any]] = []
        for task, until in self.sleeping.items():
            out.append(
                {"key": task.run.key, "seq": task.run.seq, "task": task.task_id, "on": "sleep",
                 "until": until}
            )  # fmt: skip
        for waits in self.waiters.values():
            for w in waits:
                out.append(
                    {"key": w.task.run.key, "seq": w.task.run.seq, "task": w.task.task_id,
                     "on": f"signal {w.name}", "since": w.since, "until": w.until}
                )  # fmt: skip
        for run in self.engine.machine.waiting_runs():
            for due, _event in run.timers.values():
                out.append(
                    {"key": run.key, "seq": run.seq, "task": None, "on": "delayed event",
                     "until": due}
                )  # fmt: skip
        return out


def check_cut_output(sink: Sink, pending: Callable[[str, bool], bool]) -> None:
    """A crash can cut only a line whose output is still in an outbox (a line is synced
    before its output is released): one cut otherwise was cut from outside, and is lost.
    `pending(id, whole)`: whether an outbox holds that output (`whole` False: only the start
    of its id is known)."""
    cut = getattr(sink, "cut", None)
    if cut is None:
        return
    text, whole = cut
    if pending(text, whole):
        log.info("output %r was cut by a crash; it is written again", text)
        return
    log.warning(
        "--output %s: its last line (output %s%r) was cut after the output was written, "
        "not by a crash; the line was dropped and that output is lost. Restore the file "
        "from a backup if you need it",
        getattr(sink, "path", "?"),
        "" if whole else "beginning ",
        text,
    )


class Engine:
    """Drive one agent over one source into one sink, checkpointing to one store."""

    def __init__(
        self,
        binding: Binding,
        store: CheckpointStore,
        source: Source,
        sink: Sink,
        config: EngineConfig | None = None,
        on_progress: Callable[[Engine], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.binding = binding
        self.store = store
        self.source = source
        self.sink = sink
        self._io_closed = False
        self.config = config or EngineConfig()
        self.config.validate()
        self.on_progress = on_progress
        self.clock = clock
        self.machine = Machine(
            binding.listeners,
            binding.is_output,
            self.config.max_concurrent_runs,
            self.config.max_tasks_per_run,
            binding.budget_output,
            memory_version=binding.memory_version,
            migrate=binding.migrate,
            known_actions=binding.known_actions(),
            delayed=binding.delayed,
            now=clock.now,
            expire=expire,
            is_error=binding.is_error,
        )
        self._retention = self.config.retention()
        self._otel: Any = None
        if otel_wanted(self.config.otel_endpoint):
            self._otel = RunExporter(self.config.otel_endpoint, binding.name)
        if self._retention is not None or self._otel is not None:
            self.machine.describe_event = binding.describe_event
            if self._otel is None:  # only stored: packed as each run completes
                self.machine.pack_trace = _trace_packer(binding.describe_event)
        self._ltm: Any = None
        ltm_config = getattr(binding, "ltm_config", None)
        if ltm_config is not None:
            from ratchet.agents._ltm import LtmService
            from ratchet.runtime._ltm import LongTermIndex, numpy

            numpy()  # refused at start, not at the first search, when numpy is missing
            index = LongTermIndex(self.store.ltm_rows, lambda fn: self._writer.submit(fn))
            self._ltm = LtmService(index, ltm_config)
            self.machine.collect_ltm = True
        self.stats = CheckpointStats()
        self.result = EngineResult()
        self._next_seq = 0
        self._lazy_keys = 0  # stored keys not read yet (restored lazily)
        self._writer = _Writer(store, clock, self.config.tolerable_checkpoint_failures)
        self._sink_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="ratchet-sink"
        )
        self._carry: Delta | None = None
        self._written_position: dict[str, Any] | None = None
        self._unreleased: dict[str, dict[str, Any]] = {}  # output id -> its sink record
        self._released: list[str] = []
        self._calls = CallJournal()
        self._failures_in_row = 0
        self._stop = False
        self._stop_reason = ""
        self._fatal: BaseException | None = None
        self._bad: BadInputError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._work: collections.deque[tuple[Task, Outcome]] = collections.deque()
        self._work_lock = threading.Lock()
        self._work_scheduled = False
        self._async_tasks: set[asyncio.Task[Any]] = set()
        self._waits = _EngineWaits(self)
        self._dead_lines: list[tuple[bytes, str, int, bytes, str, float, str, bytes]] = []
        self._redriving: set[int] = set()
        # Numbers for redriven inputs; None: the source's own numbering (one process). A shard
        # worker's inputs are numbered by its coordinator, so its redrives take another range.
        self.redrive_seqs: Iterator[int] | None = None
        self._written_report: dict[str, Any] = {"paused": []}
        # By (key text, key type): the integer key 1 and the string key "1" are two keys.
        self._traces_since_prune: dict[tuple[str, str], int] = {}
        self._traces_pruned: set[tuple[str, str]] = set()  # keys pruned once by this process
        self._dispatcher = Dispatcher(
            binding,
            spawn=self._spawn,
            on_async_done=self._settle,
            on_sync_done=self._settle_from_thread,
            sync_workers=self.config.sync_workers,
            sync_batch=self.config.sync_batch,
        )
        self._fused = FusedRunners(self._dispatcher, self._waits, self._make_calls)
        self._checkpoint_lock: asyncio.Lock | None = None
        self._cp_idle = False  # the checkpoint loop waits for an output (see _checkpoint_loop)
        self._outputs_waiting = False  # outputs emitted since the loop's last checkpoint
        self._cp_free = asyncio.Event()  # the loop's checkpoint is not being taken
        self._cp_free.set()

    # -- restore ----------------------------------------------------------------------------

    def _restore(self) -> None:
        began = self.clock.monotonic()
        b = self.binding
        adopted = self.store.adopt(b.version, dry_run=True)
        # Only the keys with inputs (runs in flight, queued inputs) are read now; every other
        # key is read when its first input arrives (`_stored_key`), so a restart costs what
        # is in flight, not how many keys the state holds.
        loaded = self.store.load(lazy_keys=True)
        memories = {}
        for k, nd, mem, version in loaded.keys:
            key = decoded("keys", k, codec.decode, k)
            memories[key] = (decoded("keys", key, decode_memory, mem), nd, version)
        queued = []
        for seq, k, ev in loaded.inputs:
            key = decoded("inputs", f"input {seq}", codec.decode, k)
            queued.append((seq, key, decoded("inputs", f"input {seq}", decode_event, b, ev)))
        inputs = {seq: (key, ev) for seq, key, ev in queued}
        runs = []
        for seq, _k, base, journal in loaded.runs:
            if seq not in inputs:
                raise StateError(
                    f"the state's run of input {seq} has no input row; the state directory was "
                    f"altered outside ratchet; restore it from a backup or use a new --state"
                )
            key, event = inputs[seq]
            entries = decoded("runs", f"input {seq}", decode_journal, b, journal)
            run = RestoredRun(key, seq, event, base, entries)
            pinned = adopted.pinned.get(seq)
            if pinned is not None:
                run.listeners, run.is_output = b.pinned(pinned.table)
                run.memory_version = pinned.memory_version
            runs.append(run)
        for rec in loaded.calls:
            self._calls.add(rec)
        check_upgrade(b, runs, loaded.calls, adopted)
        check_events(b, runs)
        warn_orphaned_events(b, runs, adopted)
        self._lazy_keys = loaded.stored_keys - len(memories)
        if self._lazy_keys > 0:
            self.machine.stored_key = self._stored_key
        try:
            self.machine.restore(memories, runs, queued)
        except NonDeterminismError as exc:
            if adopted.upgraded_from is None and not adopted.pinned:
                raise
            raise IncompatibleChangeError(f"{exc}. {UPGRADE_FIXES}") from exc
        # The runs in flight replay under this agent (and keys starting now migrated): adopt.
        self.store.adopt(b.version)
        self._waits.add_signals(self.store.signals_after(0))
        for out_id, _seq, blob in loaded.outbox:
            record = decoded("outbox", out_id, codec.decode, blob)
            self._unreleased[out_id] = record  # already a sink record
        self._check_cut_output()
        src = loaded.source
        self._next_seq = int(src.get("next_seq", 0))
        redrives = self.store.redrives()  # numbered after the restored inputs, not from 0
        if redrives:
            self._waits.signals_back(self._redrive_signals(redrives))
            self._redrive(redrives, pump=False)  # on the writer thread: run() pumps next
        self.source.restore(src.get("position", {}))
        restored = self.store.record_restore()
        persisted = self.store.stats()
        counts = persisted["counts"]
        self.stats.completed = counts["completed"]
        self.stats.failed = counts["failed"]
        self.stats.restored = counts["restored"]
        self.stats.latest_completed = persisted["latest_completed"]
        self.stats.latest_restored = persisted["latest_restored"]
        self.result.restored_from = restored
        self.result.restored_runs = len(runs)
        self.result.restore_seconds = self.clock.monotonic() - began
        if restored is not None:
            log.info(
                "restored checkpoint %s in %.3f s: %d key(s), %d run(s) in flight (%d on an "
                "earlier agent version), %d queued input(s), %d unreleased output(s), source at "
                "input %d",
                restored["id"], self.result.restore_seconds, loaded.stored_keys, len(runs),
                len(adopted.pinned), len(queued) - len(runs), len(loaded.outbox), self._next_seq,
            )  # fmt: skip
        else:
            log.info("started %s on a new state", b.name)

    def _stored_key(self, key: Any) -> tuple[dict[str, Any], int, int] | None:
        """The machine's `stored_key`: one idle key's committed memory, read on first use."""
        try:
            row = self.store.key_row(codec.encode(key))
        except RatchetError:
            raise
        except Exception as exc:  # a store's own error type: say which key it was
            raise StateError(f"the state's keys row for {key!r} could not be read ({exc})") from exc
        if row is None:
            return None
        next_dispatch, memory, version = row
        self._lazy_keys -= 1
        if self._lazy_keys <= 0:  # every stored key is loaded: new keys need no lookup
            self.machine.stored_key = None
        return decoded("keys", key, decode_memory, memory), next_dispatch, version

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> EngineResult:
        """Run until the source is exhausted and idle (or forever with follow), or a stop."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._cp_due = asyncio.Event()
        self._checkpoint_lock = asyncio.Lock()
        self._writer.start()
        try:
            await asyncio.wrap_future(self._writer.submit(self._restore))
            self._dispatcher.start()
            if self._unreleased:
                await self._release({})
            self._report()
            self._pump()
            self._cp_stop = asyncio.Event()
            checkpointer = asyncio.create_task(self._checkpoint_loop())
            try:
                await self._source_loop()
                while not self._stop and not self.machine.idle():
                    if not self.source.follow and await self._only_signal_waits_left():
                        # Nothing can move without a signal: the runs stay parked in the state,
                        # and the next start (or `ratchet signal` meanwhile) picks them up.
                        self._stop_reason = waiting_for_signals(len(self.machine.waiting_runs()))
                        break
                    await self._wait_wake()  # poked when a run completes, parks or wakes
            finally:
                # Never cancel a checkpoint half-way: let the loop finish the one it is in.
                self._cp_stop.set()
                self._cp_due.set()
                await checkpointer
            if self._fatal is not None:
                raise self._fatal
            attempt = 0
            while await self.checkpoint() is None:  # raises once failures exceed the tolerance
                attempt += 1
                await self.clock.sleep(min(0.05 * attempt, 1.0))
            await self._forget_released()
            if self._unreleased:
                if self._stop or self._bad is not None:
                    # A stop asked for (a signal, --max-errors) or a bad input ends the job
                    # now, as it would have: what the sink refused waits in the outbox.
                    self._say_kept()
                else:
                    await self._deliver_what_is_left()
            if self._bad is not None:
                raise self._bad
        finally:
            self._shutdown()
            # Filled in also when the job stops on a bad input (exit 3): `--json` prints it.
            self.result.tasks_executed = self.machine.tasks_executed
            self.result.tasks_replayed = self.machine.tasks_replayed
            stopped = "a bad input" if self._bad is not None else "end of input"
            self.result.stopped_by = self._stop_reason or stopped
            self.result.checkpoints = self.stats.as_dict()
            self.result.metrics = self.metrics_totals()
        log.info(
            "stopped (%s): %d input(s), %d run(s) completed (%d ended in error), %d output(s)",
            self.result.stopped_by, self.result.inputs,
            self.result.runs_completed, self.result.runs_failed, self.result.outputs,
        )  # fmt: skip
        return self.result

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop admitting, take a final checkpoint (in-flight runs are saved, not drained), exit."""
        self._stop = True
        self._stop_reason = reason
        self._poke()

    def _fail(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
        self._stop = True
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _wait_wake(self, limit: float | None = None) -> None:
        assert self._wake is not None
        if limit is None:
            await self._wake.wait()
        else:
            await self._sleep_unless(self._wake, limit)
        self._wake.clear()

    async def _sleep_unless(self, event: asyncio.Event, seconds: float) -> bool:
        """Sleep `seconds` on the engine's clock, or less if `event` is set; True if it was."""
        if event.is_set():
            return True
        sleeper = asyncio.ensure_future(self.clock.sleep(seconds))
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait((sleeper, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            waiter.cancel()
        return event.is_set()

    async def _source_loop(self) -> None:
        cfg = self.config
        m = self.machine
        admitted = 0
        while not self._stop:
            if m.buffered_inputs >= cfg.max_buffered_inputs or self._waits.breakers:
                # A full buffer, or a resource down: no new input until that changes.
                await self._wait_wake()
                continue
            try:
                rec = self.source.next_record()
            except RatchetError as exc:
                self._fail(exc)
                return
            if rec is None:
                if not self.source.follow:
                    return
                await self._wait_wake(cfg.follow_poll)
                continue
            if rec.error is not None:
                if cfg.on_bad_input == "dead-letter":
                    log.warning("bad input kept as a dead letter: %s", rec.error)
                    self._dead_lines.append(
                        (
                            codec.encode(None), "", -1, codec.encode(rec.raw or ""), rec.error,
                            self.clock.now(), "bad-input",
                            codec.encode({"position": self.source.position(), "line": rec.line}),
                        )
                    )  # fmt: skip
                    self.result.bad_inputs.append(rec.error)
                    continue
                if cfg.on_bad_input == "skip":
                    log.warning("skipping bad input: %s", rec.error)
                    self.result.bad_inputs.append(rec.error)
                    continue
                self._bad_input(rec)
                return
            seq = self._next_seq if rec.seq is None else rec.seq
            if m.stored_key is not None and rec.key not in m.keys:
                try:
                    m.key_state(rec.key)  # read from the state at its first input since start
                except RatchetError as exc:  # a damaged row: stop before taking the input
                    self.source.unread()
                    self._fail(exc)
                    return
            self._next_seq = seq + 1
            try:
                m.admit(rec.key, seq, self.binding.event_from_input(rec.value))
            except RatchetError as exc:  # a memory migration that failed, say
                self._fail(exc)
                return
            self.result.inputs += 1
            self._pump()
            admitted += 1
            if admitted % 64 == 0:
                await self._yield_to_threads()

    async def _yield_to_threads(self) -> None:
        """Let the loop's other tasks run and, when the writer has work or a checkpoint is
        being taken, wait for them: the writer and the sink's threads need the GIL between
        every row and line they write, and a source loop admitting inline runs (pure Python)
        meanwhile starved them: under load a checkpoint due every 0.2 s took 12 s, holding
        back every output, and a durable call's record as long."""
        if not self._cp_free.is_set():
            await self._cp_free.wait()
        elif self._writer.busy():
            await asyncio.wrap_future(self._writer.submit(_nothing))
        else:
            await asyncio.sleep(0)

    def _bad_input(self, rec: Any) -> None:
        # Rewind so the bad line is read again after it is fixed; nothing before it is lost.
        self.source.unread()
        self.result.bad_inputs.append(rec.error)
        self._bad = stopped_at_bad_input(rec.error)

    # -- dispatch ---------------------------------------------------------------------------

    def _pump(self) -> None:
        """Perform what the machine asked for until it asks for nothing more right now."""
        m = self.machine
        dispatcher = self._dispatcher
        if m.timers:
            for run, event_id, due in m.take_timers():
                self._spawn(self._waits.deliver_at(run, event_id, due))
        journal = self._calls
        calls_for, writer, waits, ltm = journal.calls_for, self._writer, self._waits, self._ltm
        # The fused path: an inline action without a retry policy, in a task with no durable-call
        # records to be handed (none left from before a restart), runs here and commits at once,
        # its call journal made only if it makes a call (`FusedRunners`).
        fused = self._fused if not journal.has_records() else None
        while True:
            dispatched, outputs, completed = m.take_effects()
            if outputs:
                self._outputs_waiting = True
                if self._cp_idle:
                    self._cp_due.set()  # an idle checkpoint loop takes their checkpoint now
            if completed:
                if m.ltm_done:
                    # Visible to the next runs now, as a completed run's memory is; durable
                    # with the checkpoint that holds the completion.
                    done, m.ltm_done = m.ltm_done, []
                    self._ltm.index.completed(done)
                self.result.runs_completed += len(completed)
                limit = self.config.max_errors
                if limit is not None and m.runs_failed > limit and not self._stop:
                    self.request_stop(f"{MAX_ERRORS_STOP} {limit} run(s) ended in error")
                self._poke()
            if not dispatched:
                return
            for task in dispatched:
                if fused is not None:
                    runner = fused[task.action]
                    if runner is not None:
                        m.finish(task, runner(task))
                        continue
                outcome = dispatcher.dispatch(task, calls_for(task, writer, waits, ltm))
                if outcome is None:
                    continue
                if isinstance(outcome, RatchetError):
                    raise outcome
                m.finish(task, outcome)

    def _make_calls(self, task: Task) -> TaskCalls:
        """A fused task's call journal, made when its action makes a call."""
        return self._calls.calls_for(task, self._writer, self._waits, self._ltm)

    def _redrive_signals(self, rows: list[tuple[int, bytes, bytes]]) -> list[SignalRow]:
        """On the writer thread, before `_redrive` admits these dead letters: the signals
        their failed or abandoned runs took go back to the store (`redrive_signals`, once per dead
        letter), so that the new runs take them again. Returns them (for `signals_back`)."""
        put_back = getattr(self.store, "redrive_signals", None)
        fresh = [dead_id for dead_id, _k, _e in rows if dead_id not in self._redriving]
        if put_back is None or not fresh:
            return []
        return list(put_back(fresh))

    def _redrive(self, rows: list[tuple[int, bytes, bytes]], pump: bool = True) -> None:
        """Admit dead letters asked to be redriven, each once: the checkpoint that holds the
        new input also marks its dead letter redriven."""
        b = self.binding
        for dead_id, k, ev in rows:
            if dead_id in self._redriving:
                continue
            self._redriving.add(dead_id)
            key = decoded("dead_letters", dead_id, codec.decode, k)
            event = decoded("dead_letters", dead_id, decode_event, b, ev)
            if self.redrive_seqs is not None:
                seq = next(self.redrive_seqs)
            else:
                seq = self._next_seq
                self._next_seq += 1
            self.machine.redrive(dead_id, key, seq, event)
            self.result.inputs += 1
            self.result.redriven += 1
        if pump and self._loop is not None:
            self._pump_and_poke()

    def _pump_and_poke(self) -> None:
        try:
            self._pump()
        except RatchetError as exc:
            self._fail(exc)
        self._poke()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.ensure_future(coro)
        self._async_tasks.add(t)
        t.add_done_callback(self._async_tasks.discard)

    def _settle(self, task: Task, outcome: Outcome) -> None:
        """An async task's outcome, on the loop."""
        self._apply(((task, outcome),))

    def _apply(self, outcomes: Iterable[tuple[Task, Outcome]]) -> None:
        """Finish tasks (a failed one stops the job) and perform what the machine asks next."""
        m = self.machine
        try:
            for task, outcome in outcomes:
                if isinstance(outcome, RatchetError):
                    self._fail(outcome)
                    continue
                m.finish(task, outcome)
            self._pump()
        except RatchetError as exc:
            self._fail(exc)

    def _settle_from_thread(self, batch: list[tuple[Task, Outcome]]) -> None:
        """Sync tasks' outcomes, from a worker thread: queued, and taken on the loop at once."""
        self._work.extend(batch)
        with self._work_lock:
            if self._work_scheduled:
                return
            self._work_scheduled = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._take_work)
            except RuntimeError:  # the loop closed meanwhile: the job is over
                pass

    def _take_work(self) -> None:
        with self._work_lock:
            self._work_scheduled = False
        work = self._work

        def drain() -> Iterator[tuple[Task, Outcome]]:
            while work:  # outcomes workers add meanwhile are taken too
                yield work.popleft()

        self._apply(drain())

    # -- checkpoints ------------------------------------------------------------------------

    async def _checkpoint_loop(self) -> None:
        interval = self.config.checkpoint_interval
        stop = self._cp_stop
        due = self._cp_due
        # Idle: the last checkpoint written is at least an interval old (at the start, it is an
        # earlier process's). Then the first output does not wait out another interval: it
        # wakes the loop (`_pump` sets `due`), and its checkpoint is taken at once. Checkpoints
        # are still at least an interval apart; a busy job's are exactly as before.
        idle = interval > 0
        while not stop.is_set():
            if idle:
                self._cp_idle = True
                if not self._outputs_waiting:
                    await self._sleep_unless(due, interval)
                self._cp_idle = False
                due.clear()
            elif await self._sleep_unless(stop, interval if interval > 0 else 0.0005):
                return
            if stop.is_set() or self._fatal is not None:
                return
            try:
                before = self.stats.completed
                self._outputs_waiting = False
                self._cp_free.clear()  # no input is admitted meanwhile (`_yield_to_threads`)
                try:
                    info = await self.checkpoint()
                    # Nothing written (an idle job): wait for the next output. A failed one
                    # waits out its interval like a written one: a failing store is not hammered.
                    idle = interval > 0 and info is not None and self.stats.completed == before
                    await self._waits.poll_signals()
                finally:
                    self._cp_free.set()
            except CheckpointError as exc:
                self._fail(exc)
                return

    async def _only_signal_waits_left(self) -> bool:
        """True when every run left waits for a signal (none runs, sleeps or has a timer)."""
        m = self.machine
        w = self._waits
        if m.active_runs or w.sleeping or w.timers or w.breakers:
            return False
        await w.poll_signals()  # one sent just now is delivered, not left behind
        # While it polled, the last run may have ended (a timer that fell due while the job
        # was down): then the job ended, no run waits ("0 run(s) waiting for signals").
        return not (m.active_runs or w.sleeping or w.timers or w.breakers) and bool(
            m.waiting_runs()
        )

    async def checkpoint(self) -> dict[str, Any] | None:
        """Capture synchronously, write in the writer thread, then release outputs to the sink."""
        assert self._checkpoint_lock is not None
        async with self._checkpoint_lock:
            delta = self.machine.capture()
            if self._carry is not None:
                self._carry.absorb(delta)
                delta, self._carry = self._carry, None
            position = {"next_seq": self._next_seq, "position": self.source.position()}
            report = {"paused": self._waits.paused()}
            if (
                report == self._written_report
                and delta.is_empty()
                and not self._released
                and not self._unreleased
                and position == self._written_position
                and self.machine.active_runs == 0
                and self.stats.latest_completed is not None
            ):
                # An idle job (a --follow source with nothing new, no run in flight) has
                # nothing to save: the last checkpoint is still exact. While a run is in flight
                # checkpoints keep completing, as Flink's do (a parked run is in every one).
                return self.stats.latest_completed
            released, self._released = self._released, []
            dead, self._dead_lines = self._dead_lines, []
            triggered = self.clock.now()
            self.stats.in_progress = 1
            sink_records: dict[str, dict[str, Any]] = {}  # made once, by the writer
            fut = self._writer.submit(
                lambda: self._write(
                    delta, position, released, triggered, dead, report, sink_records
                )
            )
            try:
                info: dict[str, Any] = await asyncio.wrap_future(fut)
            except Exception as exc:  # noqa: BLE001 - any write failure is a failed checkpoint
                if _too_large(exc):
                    # Retrying writes the same values, and a restart redoes the same runs:
                    # stop now, naming what is too large and the way out.
                    raise CheckpointError(
                        f"checkpoint not written: {exc}. Runs since the last completed "
                        f"checkpoint ({(self.stats.latest_completed or {}).get('id')}) are "
                        f"redone at restart and would write it again: change the agent to "
                        f"keep large data outside its memory, outputs and events (a file or "
                        f"an object store, with a reference in memory), then restart "
                        f"(docs/runtime.md, Upgrading an agent)"
                    ) from exc
                self.stats.in_progress = 0
                self._carry = delta
                self._released = released + self._released
                self._dead_lines = dead + self._dead_lines
                self.stats.failed += 1
                self.stats.latest_failed = {
                    "trigger_timestamp": triggered,
                    "failure_timestamp": self.clock.now(),
                    "failure_message": f"{type(exc).__name__}: {exc}",
                }
                self._failures_in_row += 1
                log.warning("checkpoint failed (%d in a row): %s", self._failures_in_row, exc)
                self._report()
                await asyncio.wrap_future(self._writer.submit(self.store.count_failed_checkpoint))
                if self._failures_in_row > self.config.tolerable_checkpoint_failures:
                    what, then = resume_after(exc)
                    raise CheckpointError(
                        f"{self._failures_in_row} checkpoint(s) failed in a row "
                        f"(tolerable: {self.config.tolerable_checkpoint_failures}); last error: "
                        f"{what}. The last completed checkpoint "
                        f"({(self.stats.latest_completed or {}).get('id')}) is intact; {then}"
                    ) from exc
                return None
            self.stats.in_progress = 0
            self._failures_in_row = 0
            log.debug(
                "checkpoint %s: %.1f ms, %d bytes, %d run(s) completed, %d output(s)",
                info.get("id"), info.get("duration_ms", 0.0), info.get("size_bytes", 0),
                len(delta.completed), len(delta.outputs),
            )  # fmt: skip
            self._written_position = position
            self._written_report = report
            # Connectors (docs/connectors.md): the inputs up to this position are in a completed
            # checkpoint now, so the source may acknowledge them to its system.
            taken: Any = position["position"]  # what source.position() returned
            try:
                self.source.acknowledge(taken)
            except Exception:  # noqa: BLE001 - acknowledged again after the next checkpoint
                log.exception("the source failed to acknowledge checkpointed inputs upstream")
            self.stats.completed += 1
            self.stats.latest_completed = info
            self.result.dead_letters += len(dead) + len(delta.failed)
            self.result.runs_failed += len(delta.failed)  # as committed, not as seen
            if self._otel is not None and delta.traces:
                for seq, (key, failed, _started, tasks) in delta.traces.items():
                    if not isinstance(tasks, bytes):  # never packed while exporting
                        self._otel.export_run(key, seq, failed, tasks)
            await self._release(sink_records)
            self._report()
            return info

    def _write(
        self,
        delta: Delta,
        position: dict[str, Any],
        released: list[str],
        triggered: float,
        dead: list[tuple[bytes, str, int, bytes, str, float, str, bytes]],
        report: dict[str, Any],
        sink_records: dict[str, dict[str, Any]],
    ) -> dict[str, Any]:
        """Write one checkpoint (in the writer thread); the outputs' sink records go in
        `sink_records`, by output id, for the release after it."""
        enc = codec.encode
        b = self.binding
        rows = CheckpointRows(source=position, released=released, dead_letters=list(dead))
        for seq, (key, event, errors, trace) in delta.failed.items():
            # The store adds the signals the run took (`write_checkpoint`), for the redrive.
            records = [b.error_record(e) for e in errors]
            rows.dead_letters.append(
                (
                    enc(key), str(key), seq, encode_event(b, event),
                    f"{records[0]['type']}: {records[0]['message']}", triggered, "failed-run",
                    enc({"errors": records, "trace": trace}),
                )
            )  # fmt: skip
        rows.redriven = list(delta.redriven.items())
        rows.report = report
        if self._retention is not None and delta.traces:
            rows.trace_retention = keep, _age = self._retention
            fresh = self._traces_since_prune
            for seq, (key, failed, started, tasks) in delta.traces.items():
                status = "error" if failed else "ok"
                blob = tasks if isinstance(tasks, bytes) else _pack_trace(started, tasks)
                text, key_type = str(key), signal_key_type(key)
                rows.traces.append((text, seq, triggered, status, blob, key_type))
                fresh[text, key_type] = fresh.get((text, key_type), 0) + 1
            if keep is not None:
                # A key is cut down to its last N once it has N new traces (amortised: one
                # DELETE per N runs, not per run), and at its first new trace in this
                # process (what earlier processes left: a job restarted more often than it
                # runs N runs of a key grew without bound); at most 2N are kept meanwhile.
                seen = self._traces_pruned
                rows.trace_prune = [
                    k for k, n in fresh.items() if n >= max(keep, 1) or k not in seen
                ]
                for k in rows.trace_prune:
                    seen.add(k)
                    if fresh[k] >= max(keep, 1):
                        del fresh[k]
        limit = getattr(self.store, "max_value_bytes", None)
        for key, (memory, next_dispatch, version) in delta.keys.items():
            blob = encode_memory(memory)
            if limit is not None and len(blob) > limit:
                raise _ValueTooLarge(
                    f"the memory of key {key!r} is {len(blob):,} bytes encoded, over the "
                    f"{limit:,} bytes the state stores in one value"
                )
            rows.keys.append((enc(key), str(key), next_dispatch, blob, version))
        for seq, (key, event) in delta.new_inputs.items():
            rows.new_inputs.append((seq, enc(key), encode_event(b, event)))
        rows.done_inputs = list(delta.done_inputs)
        rows.completed = list(delta.completed)
        for seq, run in delta.runs.items():
            rows.runs.append((seq, enc(run.key), run.base_dispatch, encode_journal(b, run.journal)))
        built = codec.encode_built
        for out in delta.outputs.values():
            record = sink_records[out.id] = b.output_record(out)
            # An output whose fields the codec encoded when it was sent is admitted: its
            # record (ratchet's fields around them) packs as it is, to the same bytes.
            blob = built(record) if getattr(out.event, "encoded", False) else enc(record)
            rows.outbox.append((out.id, out.seq, blob))
        for op in delta.ltm:
            if op[0] == LTM_ADD:
                _k, scope, ltm_id, text, meta, vector, at = op
                rows.ltm_add.append((scope, ltm_id, text, enc(meta), vector, at))
            else:
                rows.ltm_delete.append((op[1], op[2]))
        info = self.store.write_checkpoint(rows, triggered)
        if delta.ltm and self._ltm is not None:
            # In the writer thread, before any later scope load reads the database.
            self._ltm.index.committed(len(delta.ltm))
        return info

    _sink_error = ""  # the sink's last refusal
    _sink_away: ServerUnreachableError | None = None  # why, when its server was away

    async def _deliver_what_is_left(self) -> None:
        """At the end of a job, outputs of completed checkpoints the sink refused are tried a
        few times more; a job whose sink still refuses them does not end as if it were done
        (it exited 0 with the outputs missing from the sink). A sink whose server is away
        (it reconnects, or cannot reach it: `ServerUnreachableError`) is waited for, as it is
        mid-run, until it takes them or the job is asked to stop (they stay in the state)."""
        delay = _LEFT_FIRST_DELAY
        tries = 0
        waiting_since: float | None = None
        said = 0.0
        while True:
            await self._pause(delay)
            await self._release({})
            if not self._unreleased:  # delivered: record it, as any release is recorded
                if waiting_since is not None:
                    log.warning("the sink took the outputs it was waiting for; the job ends")
                await self.checkpoint()
                await self._forget_released()
                return
            if self._stop:  # a stop asked for while it waited: they wait in the outbox
                self._say_kept()
                return
            tries += 1
            away = self._sink_away
            if away is None:
                if tries >= 5:
                    raise SinkError(
                        f"{len(self._unreleased)} output(s) of completed checkpoints could not "
                        f"be written to the sink ({self._sink_error}); they are kept in the "
                        f"state and written, once each, when the job runs again: fix the sink, "
                        f"then run the same command"
                    )
                delay *= 2
                continue
            now = SYSTEM_CLOCK.monotonic()
            if waiting_since is None:
                waiting_since = said = now
                log.warning(
                    "the input is done, but %s at %s is away (%s): waiting for it to take the "
                    "last %d output(s) before the job ends; a stop (Ctrl-C, SIGTERM) keeps "
                    "them in the state for the next run", away.server, away.address,
                    self._sink_error, len(self._unreleased),
                )  # fmt: skip
            elif now - said >= 60:
                said = now
                log.warning(
                    "still waiting for %s at %s to take %d output(s) (%.0f s so far)",
                    away.server, away.address, len(self._unreleased), now - waiting_since,
                )  # fmt: skip
            delay = min(delay * 2, _LEFT_MAX_DELAY)

    def _say_kept(self) -> None:
        log.warning(
            "%d output(s) the sink refused (%s) are kept in the state and written when the "
            "job runs again", len(self._unreleased), self._sink_error,
        )  # fmt: skip

    async def _pause(self, seconds: float) -> None:
        """Real time (a test's fake clock must not hold it), cut short by a stop request."""
        if self._stop:
            return
        wake = self._wake
        if wake is None:
            await asyncio.sleep(seconds)
            return
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), seconds)
        except TimeoutError:
            pass

    def _check_cut_output(self) -> None:
        unreleased = self._unreleased
        check_cut_output(
            self.sink,
            lambda text, whole: (
                text in unreleased if whole else any(i.startswith(text) for i in unreleased)
            ),
        )

    async def _release(self, records: dict[str, dict[str, Any]]) -> None:
        """Hand the outputs of a completed checkpoint (their sink records, by output id) to
        the sink, in order, after any still unreleased; retried if the sink fails."""
        self._unreleased.update(records)
        if not self._unreleased:
            return
        pending = list(self._unreleased.values())
        sink = self.sink

        def deliver() -> tuple[list[Any], int]:
            # An output the sink cannot write becomes an error record in its place (the same
            # one when it comes back from the outbox after a crash): it never holds back others.
            checked, refused = writable(sink, pending)
            written = sink.write(checked)
            return refused, len(checked) if written is None else written

        try:
            # The sink has its own thread, so its fsync never delays a durable-call record.
            refused, written = await asyncio.wrap_future(self._sink_thread.submit(deliver))
        except Exception as exc:  # noqa: BLE001 - kept in the outbox, retried next checkpoint
            log.warning("sink write failed, will retry after the next checkpoint: %s", exc)
            self._sink_error = f"{type(exc).__name__}: {exc}"
            self._sink_away = exc if isinstance(exc, ServerUnreachableError) else None
            return
        metrics = getattr(self.binding, "metrics", None)
        if metrics is not None:
            for key in refused:
                metrics.add(key, "outputs.unwritable")
        self._released.extend(self._unreleased)
        # What the sink wrote now: after a kill -9 the restored outbox holds outputs the
        # killed process had written already, which the sink skips; they were counted there.
        self.result.outputs += written
        self._unreleased.clear()

    def _report(self) -> None:
        """Tell the observer (progress line, supervisor) after a restore and every checkpoint."""
        if self.on_progress is not None:
            try:
                self.on_progress(self)
            except Exception:  # noqa: BLE001 - an observer must not break the job
                log.exception("progress observer failed")

    async def _forget_released(self) -> None:
        """Drop outbox rows the sink already has, so a finished job leaves no outbox behind."""
        released, self._released = self._released, []
        if released:
            await asyncio.wrap_future(
                self._writer.submit(lambda: self.store.forget_outputs(released))
            )

    # -- shutdown ---------------------------------------------------------------------------

    def _shutdown(self) -> None:
        if self._otel is not None:
            try:
                self._otel.close()  # flushes what the batch processor still holds
            except Exception as exc:  # noqa: BLE001 - telemetry must not fail the job
                log.warning("OpenTelemetry export could not be flushed: %s", exc)
        for t in list(self._async_tasks):
            t.cancel()
        self._dispatcher.stop()
        self._writer.stop()
        self._writer.join(timeout=30)
        self._sink_thread.shutdown(wait=True)
        self.close_io()
        self._loop = None

    def close_io(self) -> None:
        """Close the source and the sink, once: the sink also when the source's close fails,
        for a JSONL sink holds a lock on its file until it is closed (a later job into the
        same file in this process would be refused)."""
        if self._io_closed:
            return
        self._io_closed = True
        try:
            self.source.close()
        finally:
            self.sink.close()

    def status(self) -> dict[str, Any]:
        m = self.machine
        return {
            "inputs": self.result.inputs,
            "runs_completed": self.result.runs_completed,
            "outputs": self.result.outputs,
            "runs_failed": self.result.runs_failed,
            "dead_letters": self.result.dead_letters,
            "in_flight_runs": m.active_runs + m.parked_runs,  # parked ones are in flight too
            "buffered_inputs": m.buffered_inputs,
            "checkpoints": self.stats.as_dict(),
            "source": self.source.position(),
            "metrics": self.metrics_totals(),
            "waiting": self._waits.describe(),
            "paused": self._waits.paused(),
            "restore_seconds": self.result.restore_seconds,
        }

    def metrics_totals(self) -> dict[str, float]:
        metrics = getattr(self.binding, "metrics", None)
        return metrics.totals() if metrics is not None else {}
