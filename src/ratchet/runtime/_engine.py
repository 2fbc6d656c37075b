"""The embedded engine: one process, asyncio, SQLite checkpoints. It performs; the machine decides.

Threads: the event loop (machine, dispatch, checkpoint capture), a pool of sync-action
workers, and one writer thread that owns the SQLite connection (checkpoints, durable-call
records, sink writes after a checkpoint completes).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ratchet._errors import BadInputError, CheckpointError, InternalError, RatchetError
from ratchet.runtime._io import Sink, Source
from ratchet.runtime._machine import (
    Delta,
    JournalEntry,
    Machine,
    Output,
    RestoredRun,
    Task,
    TaskResult,
)
from ratchet.runtime._memops import from_wire, to_wire
from ratchet.store import codec
from ratchet.store._sqlite import CallRecord, CheckpointRows, SqliteStore

log = logging.getLogger("ratchet.engine")


@dataclass
class EngineConfig:
    """Knobs of the embedded engine. Times are in seconds."""

    checkpoint_interval: float = 0.2
    max_concurrent_runs: int = 64
    max_buffered_inputs: int = 1000
    tolerable_checkpoint_failures: int = 3
    sync_workers: int = 16
    # Tasks a sync worker takes at once. 1 keeps a blocking action from holding up any task
    # but its own; more trades that isolation for less hand-off under heavy load.
    sync_batch: int = 1
    synchronous: str = "NORMAL"
    on_bad_input: str = "stop"  # or "skip"
    follow_poll: float = 0.05

    def validate(self) -> None:
        if self.checkpoint_interval < 0:
            raise ValueError("checkpoint_interval must be >= 0")
        if (
            min(
                self.max_concurrent_runs,
                self.max_buffered_inputs,
                self.sync_workers,
                self.sync_batch,
            )
            < 1
        ):
            raise ValueError(
                "max_concurrent_runs, max_buffered_inputs and sync_workers must be >= 1"
            )
        if self.on_bad_input not in ("stop", "skip"):
            raise ValueError(f"on_bad_input must be 'stop' or 'skip', not {self.on_bad_input!r}")

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Binding(Protocol):
    """What the engine needs from an agent (implemented in `ratchet.agents`)."""

    name: str
    fingerprint: str
    action_names: list[str]

    def listeners(self, event: Any) -> list[str]: ...
    def is_output(self, event: Any) -> bool: ...
    def action_mode(self, action: str) -> str: ...
    def run_sync(self, task: Task, calls: TaskCalls) -> TaskResult: ...
    async def run_async(self, task: Task, calls: TaskCalls) -> TaskResult: ...
    def event_to_wire(self, event: Any) -> Any: ...
    def event_from_wire(self, wire: Any) -> Any: ...
    def event_from_input(self, value: Any) -> Any: ...
    def output_record(self, output: Output) -> dict[str, Any]: ...


class TaskCalls:
    """The durable-call journal of one task: recorded results by position, and write-through."""

    __slots__ = ("seq", "task_id", "key", "_recorded", "_writer", "_next")

    def __init__(
        self, seq: int, task_id: str, key: Any, recorded: dict[int, CallRecord], writer: _Writer
    ) -> None:
        self.seq = seq
        self.task_id = task_id
        self.key = key
        self._recorded = recorded
        self._writer = writer
        self._next = 0

    def next_index(self) -> int:
        idx = self._next
        self._next += 1
        return idx

    def recorded(self, idx: int) -> CallRecord | None:
        return self._recorded.get(idx)

    def write(
        self, idx: int, fn: str, digest: str, status: str, payload: bytes | None
    ) -> concurrent.futures.Future[None]:
        """Persist a record now (not at the next checkpoint); the future resolves once durable."""
        return self._writer.put_call(
            CallRecord(self.seq, self.task_id, idx, fn, digest, status, payload)
        )


class _Writer(threading.Thread):
    """The single thread that writes SQLite; durable-call records are group-committed."""

    def __init__(self, store: SqliteStore) -> None:
        super().__init__(name="ratchet-writer", daemon=True)
        self.store = store
        self._q: queue.SimpleQueue[tuple[str, Any, concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue()
        )

    def put_call(self, record: CallRecord) -> concurrent.futures.Future[None]:
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._q.put(("call", record, fut))
        return fut

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._q.put(("job", fn, fut))
        return fut

    def stop(self) -> None:
        self._q.put(("stop", None, concurrent.futures.Future()))

    def run(self) -> None:
        while True:
            items = [self._q.get()]
            while True:
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            calls = [(rec, fut) for kind, rec, fut in items if kind == "call"]
            if calls:
                try:
                    self.store.put_calls([rec for rec, _ in calls])
                except BaseException as exc:  # noqa: BLE001 - reported to every waiter
                    for _, fut in calls:
                        _resolve(fut, error=exc)
                else:
                    for _, fut in calls:
                        _resolve(fut)
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
    restored_from: dict[str, Any] | None = None
    bad_inputs: list[str] = field(default_factory=list)
    stopped_by: str = "end of input"
    checkpoints: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class Engine:
    """Drive one agent over one source into one sink, checkpointing to one SQLite store."""

    def __init__(
        self,
        binding: Binding,
        store: SqliteStore,
        source: Source,
        sink: Sink,
        config: EngineConfig | None = None,
        on_progress: Callable[[Engine], None] | None = None,
    ) -> None:
        self.binding = binding
        self.store = store
        self.source = source
        self.sink = sink
        self.config = config or EngineConfig()
        self.config.validate()
        self.on_progress = on_progress
        self.machine = Machine(
            binding.listeners, binding.is_output, self.config.max_concurrent_runs
        )
        self.stats = CheckpointStats()
        self.result = EngineResult()
        self._next_seq = 0
        self._writer = _Writer(store)
        self._sink_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="ratchet-sink"
        )
        self._carry: Delta | None = None
        self._unreleased: dict[str, Output] = {}
        self._released: list[str] = []
        self._calls: dict[tuple[int, str], dict[int, CallRecord]] = {}
        self._failures_in_row = 0
        self._stop = False
        self._stop_reason = ""
        self._fatal: BaseException | None = None
        self._bad: BadInputError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._work: collections.deque[tuple[Task, TaskResult]] = collections.deque()
        self._work_lock = threading.Lock()
        self._work_scheduled = False
        self._sync_q: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._async_tasks: set[asyncio.Task[Any]] = set()
        self._checkpoint_lock: asyncio.Lock | None = None

    # -- restore ----------------------------------------------------------------------------

    def _restore(self) -> None:
        loaded = self.store.load()
        decode = codec.decode
        b = self.binding
        memories = {decode(k): (from_wire(decode(mem)), nd) for k, nd, mem in loaded.keys}
        queued = [(seq, decode(k), b.event_from_wire(decode(ev))) for seq, k, ev in loaded.inputs]
        inputs = {seq: (key, ev) for seq, key, ev in queued}
        runs = []
        for seq, _k, base, journal in loaded.runs:
            key, event = inputs[seq]
            entries = [
                JournalEntry(
                    tid, di, tuple(so), tuple(se), tuple(b.event_from_wire(e) for e in evs)
                )
                for tid, di, so, se, evs in decode(journal)
            ]
            runs.append(RestoredRun(key, seq, event, base, entries))
        for rec in loaded.calls:
            self._calls.setdefault((rec.seq, rec.task_id), {})[rec.idx] = rec
        self.machine.restore(memories, runs, queued)
        for out_id, _seq, blob in loaded.outbox:
            record = decode(blob)
            self._unreleased[out_id] = record  # already a sink record
        src = loaded.source
        self._next_seq = int(src.get("next_seq", 0))
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

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> EngineResult:
        """Run until the source is exhausted and idle (or forever with follow), or a stop."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._checkpoint_lock = asyncio.Lock()
        self._writer.start()
        try:
            await asyncio.wrap_future(self._writer.submit(self._restore))
            for i in range(self.config.sync_workers):
                t = threading.Thread(target=self._worker, name=f"ratchet-sync-{i}", daemon=True)
                t.start()
                self._workers.append(t)
            if self._unreleased:
                await self._release([])
            self._report()
            self._pump()
            self._cp_stop = asyncio.Event()
            checkpointer = asyncio.create_task(self._checkpoint_loop())
            try:
                await self._source_loop()
                while not self._stop and not self.machine.idle():
                    await self._wait_wake()
            finally:
                # Never cancel a checkpoint half-way: let the loop finish the one it is in.
                self._cp_stop.set()
                await checkpointer
            if self._fatal is not None:
                raise self._fatal
            attempt = 0
            while await self.checkpoint() is None:  # raises once failures exceed the tolerance
                attempt += 1
                await asyncio.sleep(min(0.05 * attempt, 1.0))
            await self._forget_released()
            if self._bad is not None:
                raise self._bad
        finally:
            self._shutdown()
        self.result.tasks_executed = self.machine.tasks_executed
        self.result.tasks_replayed = self.machine.tasks_replayed
        self.result.stopped_by = self._stop_reason or "end of input"
        self.result.checkpoints = self.stats.as_dict()
        self.result.metrics = self.metrics_totals()
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
        try:
            await asyncio.wait_for(self._wake.wait(), limit)
        except TimeoutError:
            pass
        self._wake.clear()

    async def _source_loop(self) -> None:
        cfg = self.config
        m = self.machine
        admitted = 0
        while not self._stop:
            if m.buffered_inputs >= cfg.max_buffered_inputs:
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
                if cfg.on_bad_input == "skip":
                    log.warning("skipping bad input: %s", rec.error)
                    self.result.bad_inputs.append(rec.error)
                    continue
                self._bad_input(rec)
                return
            seq = self._next_seq
            self._next_seq += 1
            m.admit(rec.key, seq, self.binding.event_from_input(rec.value))
            self.result.inputs += 1
            self._pump()
            admitted += 1
            if admitted % 64 == 0:
                await asyncio.sleep(0)

    def _bad_input(self, rec: Any) -> None:
        # Rewind so the bad line is read again after it is fixed; nothing before it is lost.
        self.source.unread()
        self.result.bad_inputs.append(rec.error)
        self._bad = BadInputError(
            f"{rec.error}; stopped before admitting it (inputs before it are processed and "
            f"checkpointed; fix the line and run again, or pass --on-bad-input skip)"
        )

    # -- dispatch ---------------------------------------------------------------------------

    def _pump(self) -> None:
        """Perform what the machine asked for until it asks for nothing more right now."""
        m = self.machine
        b = self.binding
        while True:
            dispatched, _outputs, completed = m.take_effects()
            if completed:
                self.result.runs_completed += len(completed)
                self._poke()
            if not dispatched:
                return
            for task in dispatched:
                mode = b.action_mode(task.action)
                calls = self._task_calls(task)
                if mode == "inline":
                    m.finish(task, b.run_sync(task, calls))
                elif mode == "async":
                    t = asyncio.ensure_future(self._run_async(task, calls))
                    self._async_tasks.add(t)
                    t.add_done_callback(self._async_tasks.discard)
                else:
                    self._sync_q.put((task, calls))  # type: ignore[arg-type]

    def _task_calls(self, task: Task) -> TaskCalls:
        recorded = self._calls.pop((task.run.seq, task.task_id), None) or {}
        return TaskCalls(task.run.seq, task.task_id, task.run.key, recorded, self._writer)

    async def _run_async(self, task: Task, calls: TaskCalls) -> None:
        try:
            result = await self.binding.run_async(task, calls)
        except asyncio.CancelledError:
            raise
        except RatchetError as exc:
            self._fail(exc)
            return
        except BaseException as exc:  # noqa: BLE001 - a broken binding is fatal, not a user error
            self._fail(InternalError(f"task {task.task_id} could not be run: {exc!r}"))
            return
        self._finish(task, result)

    def _finish(self, task: Task, result: TaskResult) -> None:
        try:
            self.machine.finish(task, result)
            self._pump()
        except RatchetError as exc:
            self._fail(exc)

    def _worker(self) -> None:
        q = self._sync_q
        b = self.binding
        nworkers = self.config.sync_workers
        cap = self.config.sync_batch
        while True:
            item = q.get()
            if item is None:
                return
            batch = [item]
            extra = min(cap - 1, q.qsize() // nworkers)
            for _ in range(extra):
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    q.put(None)
                    break
                batch.append(nxt)
            done = []
            for task, calls in batch:  # type: ignore[misc]
                try:
                    done.append((task, b.run_sync(task, calls)))
                except BaseException as exc:  # noqa: BLE001 - fatal for the job, reported on the loop
                    if not isinstance(exc, RatchetError):
                        exc = InternalError(f"task {task.task_id} could not be run: {exc!r}")
                    loop = self._loop
                    if loop is not None:
                        loop.call_soon_threadsafe(self._fail, exc)
            self._work.extend(done)
            with self._work_lock:
                if self._work_scheduled:
                    continue
                self._work_scheduled = True
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._take_work)
                except RuntimeError:
                    return

    def _take_work(self) -> None:
        with self._work_lock:
            self._work_scheduled = False
        m = self.machine
        work = self._work
        try:
            while work:
                task, result = work.popleft()
                m.finish(task, result)
            self._pump()
        except RatchetError as exc:
            self._fail(exc)

    # -- checkpoints ------------------------------------------------------------------------

    async def _checkpoint_loop(self) -> None:
        interval = self.config.checkpoint_interval
        stop = self._cp_stop
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), interval if interval > 0 else 0.0005)
                return
            except TimeoutError:
                pass
            if self._fatal is not None:
                return
            try:
                await self.checkpoint()
            except CheckpointError as exc:
                self._fail(exc)
                return

    async def checkpoint(self) -> dict[str, Any] | None:
        """Capture synchronously, write in the writer thread, then release outputs to the sink."""
        assert self._checkpoint_lock is not None
        async with self._checkpoint_lock:
            delta = self.machine.capture()
            if self._carry is not None:
                self._carry.absorb(delta)
                delta, self._carry = self._carry, None
            position = {"next_seq": self._next_seq, "position": self.source.position()}
            released, self._released = self._released, []
            triggered = time.time()
            self.stats.in_progress = 1
            fut = self._writer.submit(lambda: self._write(delta, position, released, triggered))
            try:
                info = await asyncio.wrap_future(fut)
            except Exception as exc:  # noqa: BLE001 - any write failure is a failed checkpoint
                self.stats.in_progress = 0
                self._carry = delta
                self._released = released + self._released
                self.stats.failed += 1
                self.stats.latest_failed = {
                    "trigger_timestamp": triggered,
                    "failure_timestamp": time.time(),
                    "failure_message": f"{type(exc).__name__}: {exc}",
                }
                self._failures_in_row += 1
                log.warning("checkpoint failed (%d in a row): %s", self._failures_in_row, exc)
                self._report()
                await asyncio.wrap_future(self._writer.submit(self.store.count_failed_checkpoint))
                if self._failures_in_row > self.config.tolerable_checkpoint_failures:
                    raise CheckpointError(
                        f"{self._failures_in_row} checkpoint(s) failed in a row "
                        f"(tolerable: {self.config.tolerable_checkpoint_failures}); last error: "
                        f"{type(exc).__name__}: {exc}. The last completed checkpoint "
                        f"({(self.stats.latest_completed or {}).get('id')}) is intact; "
                        f"restart to resume from it"
                    ) from exc
                return None
            self.stats.in_progress = 0
            self._failures_in_row = 0
            self.stats.completed += 1
            self.stats.latest_completed = info
            outs = list(delta.outputs.values())
            await self._release(outs)
            self._report()
            return info

    def _write(
        self, delta: Delta, position: dict[str, Any], released: list[str], triggered: float
    ) -> dict[str, Any]:
        enc = codec.encode
        b = self.binding
        rows = CheckpointRows(source=position, released=released)
        for key, (memory, next_dispatch) in delta.keys.items():
            rows.keys.append((enc(key), str(key), next_dispatch, enc(to_wire(memory))))
        for seq, (key, event) in delta.new_inputs.items():
            rows.new_inputs.append((seq, enc(key), enc(b.event_to_wire(event))))
        rows.done_inputs = list(delta.done_inputs)
        rows.completed = list(delta.completed)
        for seq, run in delta.runs.items():
            journal = [
                (
                    e.task_id,
                    e.dispatch_index,
                    list(e.stm_ops),
                    list(e.sensory_ops),
                    [b.event_to_wire(ev) for ev in e.events],
                )
                for e in run.journal
            ]
            rows.runs.append((seq, enc(run.key), run.base_dispatch, enc(journal)))
        for out in delta.outputs.values():
            rows.outbox.append((out.id, out.seq, enc(b.output_record(out))))
        return self.store.write_checkpoint(rows, triggered)

    async def _release(self, outputs: list[Output]) -> None:
        """Hand outputs of a completed checkpoint to the sink, in order; retried if the sink fails."""
        b = self.binding
        for out in outputs:
            self._unreleased[out.id] = b.output_record(out)  # type: ignore[assignment]
        if not self._unreleased:
            return
        records = list(self._unreleased.values())
        try:
            # The sink has its own thread, so its fsync never delays a durable-call record.
            await asyncio.wrap_future(self._sink_thread.submit(self.sink.write, records))  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - kept in the outbox, retried next checkpoint
            log.warning("sink write failed, will retry after the next checkpoint: %s", exc)
            return
        self._released.extend(self._unreleased)
        self.result.outputs += len(self._unreleased)
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
        for t in list(self._async_tasks):
            t.cancel()
        for _ in self._workers:
            self._sync_q.put(None)
        self._writer.stop()
        self._writer.join(timeout=30)
        self._sink_thread.shutdown(wait=True)
        self.source.close()
        self.sink.close()
        self._loop = None

    def status(self) -> dict[str, Any]:
        m = self.machine
        return {
            "inputs": self.result.inputs,
            "runs_completed": self.result.runs_completed,
            "in_flight_runs": m.active_runs,
            "buffered_inputs": m.buffered_inputs,
            "checkpoints": self.stats.as_dict(),
            "source": self.source.position(),
            "metrics": self.metrics_totals(),
        }

    def metrics_totals(self) -> dict[str, float]:
        metrics = getattr(self.binding, "metrics", None)
        return metrics.totals() if metrics is not None else {}
