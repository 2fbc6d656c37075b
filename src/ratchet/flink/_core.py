"""The Flink operator's core: drives the run machine for the keys of one subtask. No PyFlink here.

The PyFlink function (`_function.py`) calls `element` and `timer` with the current key set
and a `KeyStore` view of that key's keyed state; everything this module writes goes through
it as codec-encoded bytes. Actions run on an asyncio loop thread (async actions) and a thread
pool (sync actions) inside the Python worker, so a slow model or tool call never blocks the
operator; their completions are applied at the key's next callback (a processing-time timer
the function registers while the key has work executing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ratchet._errors import InternalError, RatchetError
from ratchet.agents._context import install_task_factory
from ratchet.runtime._engine import Binding, TaskCalls
from ratchet.runtime._io import to_json_line
from ratchet.runtime._machine import JournalEntry, Machine, RestoredRun, Task, TaskResult
from ratchet.runtime._memops import from_wire, to_wire
from ratchet.store import codec
from ratchet.store._sqlite import CallRecord

log = logging.getLogger("ratchet.flink")

# Machine slots are not shared across keys on Flink: a key's run starts when its input
# arrives, so a callback for one key never starts another key's run (whose state it could
# not write). Concurrency of actual work is bounded by `max_concurrent_tasks`.
_UNBOUNDED = 1 << 62


class KeyStore(Protocol):
    """The keyed state of the current key, as bytes (the PyFlink function implements it)."""

    def get_key(self) -> bytes | None: ...
    def put_key(self, value: bytes) -> None: ...
    def inputs(self) -> list[tuple[int, bytes]]: ...
    def put_input(self, seq: int, value: bytes) -> None: ...
    def remove_input(self, seq: int) -> None: ...
    def get_run(self) -> bytes | None: ...
    def put_run(self, value: bytes) -> None: ...
    def clear_run(self) -> None: ...
    def calls(self) -> list[bytes]: ...
    def put_call(self, name: str, value: bytes) -> None: ...
    def clear_calls(self) -> None: ...


@dataclass
class CoreConfig:
    """Knobs of the operator core (times in milliseconds)."""

    max_concurrent_tasks: int = 64
    sync_workers: int = 16
    poll_min_ms: int = 2
    poll_max_ms: int = 100
    end_wait_log_s: float = 30.0


@dataclass
class Step:
    """What one callback produced: output lines and whether the key still needs callbacks."""

    outputs: list[str] = field(default_factory=list)
    poll_ms: int | None = None  # register a processing-time timer this far ahead
    active: bool = False  # the key has a run or queued inputs


@dataclass(eq=False)
class _Key:
    next_seq: int = 0
    key_dirty: bool = False
    stored_inputs: set[int] = field(default_factory=set)
    written_run: tuple[int, int] | None = None
    calls_written: bool = False
    executing: int = 0
    poll_ms: int = 0
    recorded: dict[tuple[int, str], dict[int, CallRecord]] = field(default_factory=dict)


class _KeyWriter:
    """The durable-call writer `TaskCalls` needs, bound to one key.

    A record is kept in the worker and written to the key's state at the key's next callback,
    so it is in Flink's state at the next checkpoint that follows that callback. The future
    resolves at once: the record is not durable before that (see docs/flink.md).
    """

    __slots__ = ("_core", "_key")

    def __init__(self, core: AgentCore, key: Any) -> None:
        self._core = core
        self._key = key

    def put_call(self, record: CallRecord) -> concurrent.futures.Future[None]:
        self._core._add_call(self._key, record)
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        fut.set_result(None)
        return fut


def encode_run(binding: Binding, run: RestoredRun) -> bytes:
    journal = [
        (
            e.task_id,
            e.dispatch_index,
            list(e.stm_ops),
            list(e.sensory_ops),
            [binding.event_to_wire(ev) for ev in e.events],
        )
        for e in run.journal
    ]
    return codec.encode(
        (run.seq, run.base_dispatch, binding.event_to_wire(run.input_event), journal)
    )


def decode_run(binding: Binding, key: Any, raw: bytes) -> RestoredRun:
    seq, base, event, journal = codec.decode(raw)
    entries = [
        JournalEntry(tid, di, tuple(so), tuple(se), tuple(binding.event_from_wire(e) for e in evs))
        for tid, di, so, se, evs in journal
    ]
    return RestoredRun(key, seq, binding.event_from_wire(event), base, entries)


def encode_memory(memory: dict[str, Any]) -> bytes:
    """A key's committed memory as stored bytes (also the memory side output's payload)."""
    return codec.encode(to_wire(memory))


def decode_memory(raw: bytes) -> dict[str, Any]:
    return from_wire(codec.decode(raw))


class AgentCore:
    """One subtask's machine, event loop and thread pool; state per key through `KeyStore`."""

    def __init__(self, binding: Binding, config: CoreConfig | None = None) -> None:
        self.binding = binding
        self.config = config or CoreConfig()
        self.machine = Machine(binding.listeners, binding.is_output, _UNBOUNDED)
        self._keys: dict[Any, _Key] = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._done: dict[Any, list[tuple[Task, TaskResult | BaseException]]] = {}
        self._calls: dict[Any, list[CallRecord]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._sem: asyncio.Semaphore | None = None
        self.tasks_executed = 0

    # -- lifecycle --------------------------------------------------------------------------

    def open(self) -> None:
        loop = asyncio.new_event_loop()
        install_task_factory(loop)
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            self._sem = asyncio.Semaphore(self.config.max_concurrent_tasks)
            ready.set()
            loop.run_forever()

        self._loop = loop
        self._loop_thread = threading.Thread(target=run, name="ratchet-flink-loop", daemon=True)
        self._loop_thread.start()
        ready.wait()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.config.sync_workers, thread_name_prefix="ratchet-flink-sync"
        )

    def close(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._loop = None

    # -- callbacks (the function calls these with the current key set) ---------------------

    def element(self, key: Any, value: Any, store: KeyStore) -> Step:
        """One input for `key`: admitted, its run started if the key is idle."""
        info = self._load(key, store)
        seq = info.next_seq
        info.next_seq += 1
        info.key_dirty = True
        self.machine.admit(key, seq, self.binding.event_from_input(value))
        step = Step()
        self._pump(key, info, step)
        self._persist(key, info, store, step)
        return step

    def timer(self, key: Any, store: KeyStore, *, end: bool = False) -> Step:
        """Apply the key's finished tasks; with `end` (end of input) wait until the key is idle."""
        info = self._load(key, store)
        step = Step()
        self._pump(key, info, step)  # a run restored by `_load` dispatches its first tasks
        applied = self._apply_done(key, info, step)
        if end:
            waited = time.monotonic()
            while self._key_busy(key):
                with self._cond:
                    if not self._done.get(key):
                        self._cond.wait(timeout=1.0)
                self._apply_done(key, info, step)
                if time.monotonic() - waited > self.config.end_wait_log_s:
                    log.warning("end of input: key %r still has work running", key)
                    waited = time.monotonic()
        cfg = self.config
        if applied:
            info.poll_ms = cfg.poll_min_ms
        else:
            info.poll_ms = min(max(info.poll_ms * 2, cfg.poll_min_ms), cfg.poll_max_ms)
        self._persist(key, info, store, step)
        return step

    def memory(self, key: Any, store: KeyStore) -> dict[str, Any] | None:
        """The key's committed memory (None for a key with no stored state)."""
        ks = self.machine.keys.get(key)
        if ks is not None:
            return ks.memory
        raw = store.get_key()
        return None if raw is None else decode_memory(codec.decode(raw)["m"])

    # -- loading and storing one key --------------------------------------------------------

    def _load(self, key: Any, store: KeyStore) -> _Key:
        info = self._keys.get(key)
        if info is not None:
            return info
        info = self._keys[key] = _Key(poll_ms=self.config.poll_min_ms)
        b = self.binding
        memory: dict[str, Any] = {}
        next_dispatch = 0
        raw = store.get_key()
        if raw is not None:
            data = codec.decode(raw)
            memory = decode_memory(data["m"])
            next_dispatch = data["d"]
            info.next_seq = data["n"]
        run_raw = store.get_run()
        run = decode_run(b, key, run_raw) if run_raw is not None else None
        queued = []
        for seq, ev in store.inputs():
            queued.append((seq, b.event_from_wire(codec.decode(ev))))
            info.stored_inputs.add(seq)
        if run is not None:
            info.written_run = (run.seq, len(run.journal))
            for blob in store.calls():
                rec = CallRecord(*codec.decode(blob))
                info.calls_written = True
                if rec.seq == run.seq:
                    info.recorded.setdefault((rec.seq, rec.task_id), {})[rec.idx] = rec
        self.machine.load_key(key, memory, next_dispatch, run, queued)
        return info

    def _persist(self, key: Any, info: _Key, store: KeyStore, step: Step) -> None:
        m = self.machine
        m.discard_changes()
        memory, next_dispatch, run = m.key_snapshot(key)
        ks = m.keys[key]
        enc = codec.encode
        b = self.binding
        if info.key_dirty:
            store.put_key(enc({"m": encode_memory(memory), "d": next_dispatch, "n": info.next_seq}))
            info.key_dirty = False
        # Queued inputs: what the key's queue holds now, apart from its in-flight run's input
        # (the run state carries that one).
        running = run.seq if run is not None else None
        want = {seq: ev for seq, ev in ks.queue if seq != running}
        for seq in info.stored_inputs - want.keys():
            store.remove_input(seq)
        for seq in want.keys() - info.stored_inputs:
            store.put_input(seq, enc(b.event_to_wire(want[seq])))
        info.stored_inputs = set(want)
        with self._lock:
            calls = self._calls.pop(key, None)
        if run is None:
            if info.written_run is not None:
                store.clear_run()
                info.written_run = None
            if info.calls_written:
                store.clear_calls()
                info.calls_written = False
            info.recorded.clear()
        else:
            sig = (run.seq, len(run.journal))
            if info.written_run != sig:
                if info.written_run is not None and info.written_run[0] != run.seq:
                    if info.calls_written:
                        store.clear_calls()
                        info.calls_written = False
                store.put_run(encode_run(b, run))
                info.written_run = sig
            for rec in calls or ():
                if rec.seq == run.seq:
                    store.put_call(
                        f"{rec.task_id}#{rec.idx}",
                        enc(
                            (
                                rec.seq,
                                rec.task_id,
                                rec.idx,
                                rec.fn,
                                rec.digest,
                                rec.status,
                                rec.payload,
                            )
                        ),
                    )
                    info.calls_written = True
        step.active = run is not None or bool(ks.queue)
        if info.executing > 0:
            step.poll_ms = info.poll_ms
        elif not step.active:
            m.evict_key(key)
            del self._keys[key]

    # -- execution --------------------------------------------------------------------------

    def _key_busy(self, key: Any) -> bool:
        ks = self.machine.keys.get(key)
        return ks is not None and (ks.run is not None or bool(ks.queue))

    def _apply_done(self, key: Any, info: _Key, step: Step) -> bool:
        with self._lock:
            done = self._done.pop(key, None)
        if not done:
            return False
        m = self.machine
        for task, result in done:
            info.executing -= 1
            if isinstance(result, BaseException):
                raise result
            m.finish(task, result)
        self._pump(key, info, step)
        return True

    def _pump(self, key: Any, info: _Key, step: Step) -> None:
        m = self.machine
        b = self.binding
        while True:
            dispatched, outputs, completed = m.take_effects()
            for out in outputs:
                step.outputs.append(to_json_line(b.output_record(out)))
            if completed:
                info.key_dirty = True
            if not dispatched:
                return
            for task in dispatched:
                if task.key != key:
                    raise InternalError(f"a callback for key {key!r} dispatched key {task.key!r}")
                calls = TaskCalls(
                    task.run.seq,
                    task.task_id,
                    key,
                    info.recorded.pop((task.run.seq, task.task_id), None) or {},
                    _KeyWriter(self, key),  # type: ignore[arg-type]
                )
                self.tasks_executed += 1
                mode = b.action_mode(task.action)
                if mode == "inline":
                    m.finish(task, b.run_sync(task, calls))
                    continue
                info.executing += 1
                if mode == "async":
                    assert self._loop is not None
                    asyncio.run_coroutine_threadsafe(self._run_async(task, calls), self._loop)
                else:
                    assert self._pool is not None
                    self._pool.submit(self._run_sync, task, calls)

    async def _run_async(self, task: Task, calls: TaskCalls) -> None:
        assert self._sem is not None
        try:
            async with self._sem:
                result: TaskResult | BaseException = await self.binding.run_async(task, calls)
        except RatchetError as exc:
            result = exc
        except BaseException as exc:  # noqa: BLE001 - a broken binding fails the Flink task
            result = InternalError(f"task {task.task_id} could not be run: {exc!r}")
        self._deliver(task, result)

    def _run_sync(self, task: Task, calls: TaskCalls) -> None:
        try:
            result: TaskResult | BaseException = self.binding.run_sync(task, calls)
        except RatchetError as exc:
            result = exc
        except BaseException as exc:  # noqa: BLE001 - a broken binding fails the Flink task
            result = InternalError(f"task {task.task_id} could not be run: {exc!r}")
        self._deliver(task, result)

    def _deliver(self, task: Task, result: TaskResult | BaseException) -> None:
        with self._cond:
            self._done.setdefault(task.key, []).append((task, result))
            self._cond.notify_all()

    def _add_call(self, key: Any, record: CallRecord) -> None:
        with self._lock:
            self._calls.setdefault(key, []).append(record)
