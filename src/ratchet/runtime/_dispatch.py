"""What both engines share to execute tasks: the binding, durable-call journals, dispatch by mode.

The run machine decides which tasks run; this module runs them the same way on either engine:
an inline action on the caller's thread, an async action as a coroutine on an event loop the
engine names, a sync action on a pool of worker threads. A task's outcome is its result or
the `RatchetError` that ended it; anything else a binding raises is wrapped as an
`InternalError`, so the engines handle exactly one kind of failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Protocol, TypeVar

from ratchet._errors import CheckpointError, InternalError, RatchetError
from ratchet.runtime._machine import Output, Task, TaskResult
from ratchet.store._base import REPLAY_FN as _REPLAY_FN
from ratchet.store._base import SIGNAL_FN as _SIGNAL_FN
from ratchet.store._base import AgentVersion, CallRecord, DispatchTable, SignalRow
from ratchet.store._files import resume_after

log = logging.getLogger("ratchet.runtime")

INLINE = "inline"
ASYNC = "async"
THREAD = "thread"

Outcome = TaskResult | RatchetError

_T = TypeVar("_T")

# The function name of a `ctx.patched` marker among a task's call records (digest: the id).
PATCH_FN = "ratchet.patched"
# `load_agent` names the module of an agent file `ratchet_user_<file name>`.
AGENT_FILE_MODULE_PREFIX = "ratchet_user_"
# Durable waits among a task's call records: a sleep ("ok", {since, until}) and a signal wait
# ("intent" {since, until} while waiting; "ok" with the value, or "error" {timeout} after).
SLEEP_FN = "ratchet.sleep"
SIGNAL_FN = _SIGNAL_FN  # (defined with the store, which reads a delivered signal's record)
# A failed attempt of a task with a retry policy ("ok", {error, until}; digest: the attempt
# number). Attempt n > 1 records its durable calls under the task id `<task id>#<n>`, so a
# retry calls again instead of being answered with the failed attempt's records.
RETRY_FN = "ratchet.retry"
ATTEMPT_SEP = "#"


def split_attempt(task_id: str) -> tuple[str, int]:
    """(task id, attempt number) of a call record's task id: `r>ask#2` is attempt 2 of
    `r>ask`, so code that reads the action from it must not take `ask#2` for a name (action
    names never hold a "#")."""
    base, sep, n = task_id.rpartition(ATTEMPT_SEP)
    if sep and n.isdigit():
        return base, int(n)
    return task_id, 1


# Written (status "intent") with the first new record of a task that re-executes with records
# from before a restart, at index -F where F is that first new index (negative: the indexes of
# calls stay as they were): the records from F on come from an attempt whose replay was never
# accepted (it was killed before its task ended). A later replay answers calls from them but
# does not require them, since that attempt may have been one the end-of-task check would
# have refused; a refused attempt deletes them (`TaskCalls.discard_new`). A signal such an
# attempt took is kept in the marker's payload as it was sent (the store writes it with the
# delivery), so that deleting the record puts the signal back (`TaskCalls.release_unused`).
REPLAY_FN = _REPLAY_FN


class Waits(Protocol):
    """How an engine parks a task in a durable wait (`ctx.sleep`, `ctx.wait_for_signal`)."""

    def now(self) -> float: ...

    def sleep_sync(self, seconds: float) -> None:
        """Block this (worker) thread for `seconds` on the engine's clock."""
        ...

    async def until(self, task: Task, deadline: float) -> None:
        """Return at `deadline` on the engine's clock; the task holds no slot meanwhile."""
        ...

    def unavailable(
        self, resource: str, probe_delay: float, max_probe_delay: float, error: str
    ) -> float:
        """A call on `resource` failed transiently past its retries: open (or keep open) its
        circuit; the time this call may probe it again."""
        ...

    def available(self, resource: str) -> None:
        """A call on `resource` succeeded: close its circuit (waiting calls go on)."""
        ...

    async def until_available(self, task: Task, resource: str, probe_at: float) -> None:
        """Park until `resource`'s circuit closes, or until `probe_at` if this call is the
        one to probe it then (the others keep waiting for the outcome)."""
        ...

    async def signal(
        self, task: Task, calls: TaskCalls, idx: int, name: str, deadline: float | None
    ) -> bytes | None:
        """The signal's encoded value once delivered (its record written), or None at the
        deadline (the timeout recorded)."""
        ...

    def signals_back(self, rows: list[SignalRow]) -> None:
        """Signals a dropped record had taken are in the store again (`drop_calls`,
        `release_signals`, `release_attempt_signals`): deliver them as if never taken, in
        their place by id. Any thread."""
        ...


class Binding(Protocol):
    """What an engine needs from an agent (implemented by `ratchet.agents.AgentBinding`)."""

    name: str
    fingerprint: str
    action_names: list[str]
    memory_version: int
    version: AgentVersion

    def listeners(self, event: Any) -> list[str]: ...
    def known_actions(self) -> list[str]: ...
    def pinned(
        self, table: DispatchTable
    ) -> tuple[Callable[[Any], list[str]], Callable[[Any], bool]]: ...
    def migrate(self, key: Any, memory: dict[str, Any], version: int) -> dict[str, Any]: ...
    def delayed(self, event: Any) -> tuple[float, Any] | None: ...
    def is_error(self, event: Any) -> bool: ...
    def describe_event(self, event: Any) -> str: ...
    def error_record(self, event: Any) -> dict[str, Any]: ...
    def is_output(self, event: Any) -> bool: ...
    def action_mode(self, action: str) -> str: ...
    def run_sync(self, task: Task, calls: TaskCalls) -> TaskResult: ...
    async def run_async(self, task: Task, calls: TaskCalls) -> TaskResult: ...
    def event_to_wire(self, event: Any) -> Any: ...
    def event_from_wire(self, wire: Any) -> Any: ...
    def event_from_input(self, value: Any) -> Any: ...
    def output_record(self, output: Output) -> dict[str, Any]: ...
    def budget_output(self, key: Any, seq: int, dropped: int) -> Any: ...


class CallWriter(Protocol):
    """Where an engine makes durable-call records durable; the future resolves once they are."""

    def put_call(self, record: CallRecord) -> concurrent.futures.Future[None]: ...

    # Optional: `drop_calls(seq, task_id, from_idx) -> Future[list[SignalRow]]` deletes the
    # task's records from `from_idx` on and its replay marker at -from_idx (what a refused
    # attempt added), and `release_signals(seq, task_id, idxs) -> Future[list[SignalRow]]`
    # the records at `idxs` that took a signal the marker keeps; both put those signals back
    # and return them. A writer without them leaves the records, and the marker keeps a later
    # replay from requiring them (a signal one took stays taken). And
    # `release_attempt_signals(seq, task_id, key) -> Future[list[SignalRow]]` deletes a failed
    # attempt's delivered-signal records and puts their signals back (before its retry); a
    # writer without it leaves them taken (the Flink engine's: it has no signals).


class TaskCalls:
    """The durable-call journal of one task: recorded results, matched, and write-through.

    A call is matched to a record by what it is — its function and argument digest, and which
    occurrence of that pair it is in the task — not by its position among the task's calls:
    coroutines gathered in an action, or threads an action starts, may interleave differently
    after a crash. Identical calls are interchangeable, so any order among them is fine.
    """

    __slots__ = (
        "seq",
        "task_id",
        "key",
        "_recorded",
        "_by_call",
        "_claimed",
        "_writer",
        "_next",
        "_lock",
        "_pending",
        "_patches",
        "_mark",
        "_added_from",
        "_optional_from",
        "waits",
        "attempts",
        "ltm",
        "replayed",
    )

    def __init__(
        self,
        seq: int,
        task_id: str,
        key: Any,
        recorded: dict[int, CallRecord],
        writer: CallWriter,
    ) -> None:
        self.seq = seq
        self.task_id = task_id
        self.key = key
        self._recorded = recorded
        self._writer = writer
        # Rows are keyed (seq, task, idx): new calls take indexes after every recorded one.
        # (next() on a count is atomic, so threads an action starts may share it.) Most tasks
        # make no call: the count, and what follows, are made when first needed.
        self._next: Iterator[int] | None = None
        self._by_call: dict[tuple[str, str], list[CallRecord]] | None = None
        self._claimed: set[int] = _NONE_CLAIMED
        self._lock: threading.Lock | None = None
        self._pending: list[CallRecord] | None = None  # patch markers, written with the next
        self._patches: dict[str, bool] | None = None
        # A replayed task: the index of its replay marker, -F (None once written, or without)
        self._mark: int | None = None
        self._added_from: int | None = None  # F, once the marker is written
        # Records from this index on are another attempt's that replay never accepted.
        self._optional_from: int | None = None
        self.waits: Waits | None = None  # set by an engine that supports durable waits
        self.ltm: Any = None  # long-term memory (ratchet.agents._ltm.LtmService), if any
        # records of later attempts (retries) of this task, by attempt number
        self.attempts: dict[int, dict[int, CallRecord]] = _NO_ATTEMPTS
        # Whether this task has records from before a restart (most tasks have none).
        self.replayed = bool(recorded)
        if recorded:  # a replayed task: match calls to records
            first = max(recorded) + 1
            self._mark = -first
            self._next = itertools.count(first)
            marks = [-idx for idx, rec in recorded.items() if rec.fn == REPLAY_FN]
            self._optional_from = min(marks) if marks else None
            self._claimed = set()
            self._lock = threading.Lock()
            self._by_call = {}
            for idx in sorted(recorded):
                rec = recorded[idx]
                self._by_call.setdefault((rec.fn, rec.digest), []).append(rec)

    def _index(self) -> int:
        """A new call's index (after every recorded one)."""
        counter = self._next
        if counter is None:
            with _MAKING:  # threads an action starts may make its first calls at once
                counter = self._next
                if counter is None:
                    counter = self._next = itertools.count(0)
        return next(counter)

    def claim(self, fn: str, digest: str) -> tuple[int, CallRecord | None]:
        """The record this call was made as before a crash (and its index), or a new index."""
        if self._lock is None or self._by_call is None:
            return self._index(), None
        with self._lock:
            claimed = self._claimed
            pending = self._by_call.get((fn, digest))
            while pending:
                rec = pending.pop(0)
                if rec.idx not in claimed:  # (one taken below, under another name, is not)
                    claimed.add(rec.idx)
                    return rec.idx, rec
            # The same function of an agent file that was moved or renamed (its module is
            # `ratchet_user_<file name>`), with the same arguments.
            qual = _in_agent_file(fn)
            if qual is not None:
                for idx, rec in sorted(self._recorded.items()):
                    if (
                        idx not in claimed
                        and rec.digest == digest
                        and _in_agent_file(rec.fn) == qual
                    ):
                        claimed.add(idx)
                        return idx, rec
            return self._index(), None

    def unclaimed(self) -> list[CallRecord]:
        """Recorded calls with a result that this task's code has not made again (so far).

        Patch markers are not calls: a patch retired from the code leaves its markers unused.
        Records of an attempt whose replay was never accepted (after a replay marker) are not
        required either."""
        if self._lock is None:
            return []
        with self._lock:
            return [
                r
                for idx, r in sorted(self._recorded.items())
                if idx not in self._claimed
                and r.status in ("ok", "error")
                and r.fn not in (PATCH_FN, RETRY_FN)
                and self._required(idx)
            ]

    def _required(self, idx: int) -> bool:
        """Whether a recorded call must be made again (see `REPLAY_FN`)."""
        return self._optional_from is None or idx < self._optional_from

    def retry_markers(self) -> list[CallRecord]:
        """The failed attempts recorded for this task, in order."""
        if not self._recorded:
            return []
        found = [r for r in self._recorded.values() if r.fn == RETRY_FN]
        return sorted(found, key=lambda r: int(r.digest))

    def for_attempt(self, n: int) -> TaskCalls:
        """The durable-call journal of attempt `n` (1: this one)."""
        if n == 1:
            return self
        sub = TaskCalls(
            self.seq, f"{self.task_id}{ATTEMPT_SEP}{n}", self.key, self.attempts.get(n, {}),
            self._writer,
        )  # fmt: skip
        sub.waits = self.waits
        sub.ltm = self.ltm
        return sub

    def patched(self, change_id: str) -> bool:
        """Whether this execution takes the new branch of `change_id` (`ctx.patched`).

        True, unless the task is re-executing an earlier attempt that got past this point
        without the patch: recorded calls of it remain that this execution has not made again.
        A True is recorded (a marker, written with the task's next call record: with no call
        after it there is nothing a later attempt could disagree with), so a later attempt that
        finds those calls recorded knows they came from the new branch.
        """
        if self._patches is None:
            self._patches = {}
        decided = self._patches.get(change_id)
        if decided is not None:
            return decided
        if self._lock is None or self._by_call is None:
            decided = True
        else:
            with self._lock:
                marks = self._by_call.get((PATCH_FN, change_id))
                if marks:
                    self._claimed.add(marks.pop(0).idx)
                    self._patches[change_id] = True
                    return True
                decided = not any(
                    idx not in self._claimed
                    and r.fn not in (PATCH_FN, REPLAY_FN)
                    and self._required(idx)
                    for idx, r in self._recorded.items()
                )
        if decided:
            if self._pending is None:
                self._pending = []
            self._pending.append(
                CallRecord(self.seq, self.task_id, self._index(), PATCH_FN, change_id, "ok", None)
            )
        self._patches[change_id] = decided
        return decided

    def write(
        self, idx: int, fn: str, digest: str, status: str, payload: bytes | None
    ) -> concurrent.futures.Future[None]:
        """Persist a record now (not at the next checkpoint); the future resolves once durable."""
        record = CallRecord(self.seq, self.task_id, idx, fn, digest, status, payload)
        first: list[CallRecord] = []
        if self._mark is not None and (self._pending or idx not in self._recorded):
            mark = self._take_mark()
            if mark is not None:
                first.append(mark)
        if self._pending:
            first += self._pending
            self._pending = None
        if not first:
            return self._writer.put_call(record)
        # Queued first, so a marker is never durable after the record it precedes.
        return _all([*(self._writer.put_call(m) for m in first), self._writer.put_call(record)])

    def _take_mark(self) -> CallRecord | None:
        """The replay marker, the first time this execution adds a record (else None)."""
        assert self._lock is not None  # a replayed task
        with self._lock:
            idx, self._mark = self._mark, None
        if idx is None:
            return None
        self._added_from = -idx
        return CallRecord(self.seq, self.task_id, idx, REPLAY_FN, "", "intent", None)

    def discard_new(self) -> None:
        """Delete the records this execution added (it is refused: the task re-executed with
        a change its records cannot replay), so the state's records are what they were before
        it and the previous version, or `ctx.patched`, still replays them. Records it completed
        (an intent from before, now with its result) stay: that call or signal did happen.
        Best effort: records a writer cannot delete (or a kill leaves) follow the replay
        marker, so no later replay requires them."""
        if self._added_from is None:
            return  # nothing added
        drop = getattr(self._writer, "drop_calls", None)
        if drop is None:
            return
        try:
            back = drop(self.seq, self.task_id, self._added_from).result()
        except Exception as exc:  # noqa: BLE001 - the marker keeps them from being required
            log.warning(
                "the durable-call records a refused replay of task %s (input %d) added could "
                "not be deleted (%s); the next start does not require them", self.task_id,
                self.seq, exc,
            )  # fmt: skip
            return
        self._signals_back(back)

    def release_unused(self) -> None:
        """The task's code ended (not refused): put back the signals that records of an attempt
        replay never accepted took (after a replay marker: one killed before its end) and that
        this execution did not wait for again. Nothing else would ever read those records, so
        the signals would be lost; back in the store, the next wait for them gets them. One
        transaction per task: the record goes and the signal returns, or neither."""
        if self._optional_from is None or self._lock is None:
            return
        with self._lock:
            idxs = [
                idx
                for idx, r in sorted(self._recorded.items())
                if idx not in self._claimed
                and not self._required(idx)
                and r.fn == SIGNAL_FN
                and r.status == "ok"
            ]
        release = getattr(self._writer, "release_signals", None)
        if not idxs or release is None:
            return
        try:
            back = release(self.seq, self.task_id, idxs).result()
        except Exception as exc:  # noqa: BLE001 - the records stay; the signals stay taken
            log.warning(
                "signals that records of an earlier attempt of task %s (input %d) took, and "
                "its accepted attempt did not use, could not be put back (%s)", self.task_id,
                self.seq, exc,
            )  # fmt: skip
            return
        self._signals_back(back)

    def release_attempt(self) -> None:
        """This attempt failed and will be tried again, from the start: give back the signals
        it took (the store deletes its delivered signals' records and puts them back, in one
        transaction), so that the next attempt's wait gets them again, in their place by id.
        Nothing reads a failed attempt's records again: left, those signals would be lost.
        Called before the retry is recorded: a kill in between re-executes this attempt, which
        takes them again. A store fault stops the job (an engine fault): nothing was put
        back and the records stay, so the restarted job re-executes this attempt."""
        release = getattr(self._writer, "release_attempt_signals", None)
        if release is None:
            return
        try:
            back = release(self.seq, self.task_id, self.key).result()
        except Exception as exc:
            what, then = resume_after(exc)
            raise CheckpointError(
                f"the signals failed attempt {self.task_id} (input {self.seq}) took could not "
                f"be given back for its retry: {what}. The last completed checkpoint is "
                f"intact; {then}"
            ) from exc
        self._signals_back(back)

    def _signals_back(self, rows: list[SignalRow]) -> None:
        back = getattr(self.waits, "signals_back", None)
        if rows and back is not None:
            back(rows)


_MAKING = threading.Lock()
# Shared empty values of a task with no records (never changed: replaced when there are some).
_NONE_CLAIMED: set[int] = set()
_NO_ATTEMPTS: dict[int, dict[int, CallRecord]] = {}


class CallJournal:
    """Durable-call records of restored runs, handed to the task they belong to exactly once."""

    __slots__ = ("_by_task", "_attempts")

    def __init__(self) -> None:
        self._by_task: dict[tuple[int, str], dict[int, CallRecord]] = {}
        self._attempts: dict[tuple[int, str], dict[int, dict[int, CallRecord]]] = {}

    def add(self, record: CallRecord) -> None:
        base, n = split_attempt(record.task_id)
        if base != record.task_id:
            by_attempt = self._attempts.setdefault((record.seq, base), {})
            by_attempt.setdefault(n, {})[record.idx] = record
            return
        self._by_task.setdefault((record.seq, record.task_id), {})[record.idx] = record

    def calls_for(
        self, task: Task, writer: CallWriter, waits: Waits | None = None, ltm: Any = None
    ) -> TaskCalls:
        run = task.run
        if not self._by_task and not self._attempts:  # nothing recorded (the usual case)
            calls = TaskCalls(run.seq, task.task_id, run.key, {}, writer)
            calls.waits = waits
            calls.ltm = ltm
            return calls
        where = (run.seq, task.task_id)
        recorded = self._by_task.pop(where, None) or {}
        calls = TaskCalls(run.seq, task.task_id, run.key, recorded, writer)
        calls.waits = waits
        calls.ltm = ltm
        attempts = self._attempts.pop(where, None)
        if attempts:
            calls.attempts = attempts
            calls.replayed = True
        return calls

    def has_records(self) -> bool:
        """Whether any task is still to be handed records (after a restart, until taken)."""
        return bool(self._by_task or self._attempts)

    def clear(self) -> None:
        self._by_task.clear()
        self._attempts.clear()

    def __len__(self) -> int:
        return len(self._by_task)


def _all(futures: list[concurrent.futures.Future[None]]) -> concurrent.futures.Future[None]:
    """A future that resolves when all of `futures` have, failing with the first failure."""
    joined: concurrent.futures.Future[None] = concurrent.futures.Future()
    left = [len(futures)]
    lock = threading.Lock()

    def done(fut: concurrent.futures.Future[None]) -> None:
        exc = fut.exception()
        with lock:
            left[0] -= 1
            if joined.done():
                return
            if exc is not None:
                joined.set_exception(exc)
            elif left[0] == 0:
                joined.set_result(None)

    for fut in futures:
        fut.add_done_callback(done)
    return joined


def broken(task: Task, exc: BaseException) -> InternalError:
    """What a binding that raised something other than a RatchetError is taken as."""
    return InternalError(f"task {task.task_id} could not be run: {exc!r}")


def run_task(binding: Binding, task: Task, calls: TaskCalls) -> Outcome:
    """Run a sync (or inline) task; its outcome, never an exception."""
    try:
        return binding.run_sync(task, calls)
    except RatchetError as exc:
        return exc
    except BaseException as exc:  # noqa: BLE001 - a broken binding is fatal, not a user error
        return broken(task, exc)


async def run_task_async(binding: Binding, task: Task, calls: TaskCalls) -> Outcome:
    """Run an async task; its outcome. Cancellation (engine shutdown) still propagates."""
    try:
        return await binding.run_async(task, calls)
    except asyncio.CancelledError:
        raise
    except RatchetError as exc:
        return exc
    except BaseException as exc:  # noqa: BLE001 - a broken binding is fatal, not a user error
        return broken(task, exc)


def _in_agent_file(fn: str) -> str | None:
    """The qualified name of a function defined in an agent file (its module, as
    `load_agent` names it, is `ratchet_user_<file name>`), or None."""
    if not fn.startswith(AGENT_FILE_MODULE_PREFIX):
        return None
    _module, dot, qual = fn.partition(".")
    return qual if dot else None


def take_all(q: queue.SimpleQueue[_T]) -> list[_T]:
    """What a blocking `get` returns and everything queued behind it: one group for a writer
    thread to commit at once."""
    items = [q.get()]
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


class FusedRunners(dict[str, Callable[[Task], TaskResult] | None]):
    """The fused path's runner of each action, or None (dispatch it), asked of the binding
    on an action's first lookup (`inline_runner`: an inline action without a retry policy).

    An engine runs a task through it when the task has no durable-call records to be handed,
    and commits its result at once; `make_calls(task)` makes the task's call journal, only
    when the action makes a call. A runner counts the execution on the dispatcher and turns a
    fault of the binding itself into an engine fault, as `Dispatcher.dispatch` does.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        waits: Waits | None,
        make_calls: Callable[[Task], TaskCalls],
    ) -> None:
        super().__init__()
        self._dispatcher = dispatcher
        self._waits = waits
        self._make_calls = make_calls

    def __missing__(self, action: str) -> Callable[[Task], TaskResult] | None:
        dispatcher = self._dispatcher
        make = getattr(dispatcher.binding, "inline_runner", None)
        inner = make(action, self._waits, self._make_calls) if make is not None else None
        runner: Callable[[Task], TaskResult] | None = None
        if inner is not None:
            run: Callable[[Task], TaskResult] = inner

            def runner(task: Task) -> TaskResult:
                dispatcher.executed += 1
                try:
                    return run(task)
                except RatchetError:
                    raise
                except BaseException as exc:  # noqa: BLE001 - a broken binding is fatal
                    raise broken(task, exc) from exc

        self[action] = runner
        return runner


class Dispatcher:
    """Runs each dispatched task by its action's mode and reports outcomes to the engine.

    `spawn` schedules a coroutine on the engine's event loop (from the engine's own thread).
    `on_async_done(task, outcome)` is called on that loop; `on_sync_done(batch)` on a worker
    thread with the outcomes it finished (the engine hands them to its own thread). Workers
    take up to `sync_batch` queued tasks at once: 1 keeps a blocking action from holding up
    any task but its own.
    """

    def __init__(
        self,
        binding: Binding,
        *,
        spawn: Callable[[Coroutine[Any, Any, None]], object],
        on_async_done: Callable[[Task, Outcome], None],
        on_sync_done: Callable[[list[tuple[Task, Outcome]]], None],
        sync_workers: int,
        sync_batch: int = 1,
        thread_name: str = "ratchet-sync",
    ) -> None:
        self.binding = binding
        self._spawn = spawn
        self._on_async_done = on_async_done
        self._on_sync_done = on_sync_done
        self._nworkers = sync_workers
        self._batch = sync_batch
        self._thread_name = thread_name
        self._q: queue.SimpleQueue[tuple[Task, TaskCalls] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self.executed = 0
        self._modes: dict[str, str] = {}  # action -> mode, as the binding says
        self._run_sync = binding.run_sync

    def start(self) -> None:
        for i in range(self._nworkers):
            t = threading.Thread(target=self._work, name=f"{self._thread_name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Drop queued tasks and ask the workers to exit once the task each is in returns.

        Never waits for them: a dropped or unfinished task's run is in the last checkpoint as
        in flight, and replays after the next start.
        """
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._q.put(None)
        self._threads.clear()

    def dispatch(self, task: Task, calls: TaskCalls) -> Outcome | None:
        """Run or schedule `task`; an inline task's outcome is returned at once, else None."""
        self.executed += 1
        mode = self._modes.get(task.action)
        if mode is None:
            mode = self._modes[task.action] = self.binding.action_mode(task.action)
        if mode == INLINE:  # what run_task does, without its call (most tasks are inline)
            try:
                return self._run_sync(task, calls)
            except RatchetError as exc:
                return exc
            except BaseException as exc:  # noqa: BLE001 - a broken binding is fatal
                return broken(task, exc)
        if mode == ASYNC:
            self._spawn(self._run_async(task, calls))
        else:
            self._q.put((task, calls))
        return None

    async def _run_async(self, task: Task, calls: TaskCalls) -> None:
        self._on_async_done(task, await run_task_async(self.binding, task, calls))

    def _work(self) -> None:
        q = self._q
        b = self.binding
        while True:
            item = q.get()
            if item is None:
                return
            batch = [item]
            extra = min(self._batch - 1, q.qsize() // max(self._nworkers, 1))
            for _ in range(extra):
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    q.put(None)
                    break
                batch.append(nxt)
            self._on_sync_done([(task, run_task(b, task, calls)) for task, calls in batch])
