"""The Flink engine's core: drives the run machine for the keys of one subtask. No PyFlink here.

It lives beside the embedded engine and shares its dispatch (`_dispatch.py`) and stored
forms (`_journal.py`); `ratchet.flink` is only the PyFlink layer around it, so this core is
tested without PyFlink against `MemoryKeyStore`. The PyFlink function (`flink/_function.py`) calls `element` and `timer` with the current key set
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
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import CheckpointError, ConfigError, InternalError, RatchetError
from ratchet.agents._context import install_task_factory
from ratchet.runtime._dispatch import (
    Binding,
    CallJournal,
    Dispatcher,
    FusedRunners,
    Outcome,
    TaskCalls,
    take_all,
)
from ratchet.runtime._io import json_line_or_error
from ratchet.runtime._journal import (
    decode_call,
    decode_event,
    decode_memory,
    decode_run,
    decoded,
    encode_call,
    encode_event,
    encode_memory,
    encode_run,
)
from ratchet.runtime._machine import Machine, Task
from ratchet.store import codec
from ratchet.store._base import CallRecord
from ratchet.store._call_journal import CallJournalStore, JournalledCall

log = logging.getLogger("ratchet.flink")

# Without `max_concurrent_runs` machine slots are not shared across keys on Flink: a key's run
# starts when its input arrives, so a callback for one key never starts another key's run.
# With it, a run that ends frees a slot for another key's run, whose first tasks wait in
# `_held` until that key's own callback (it polls while it waits; see `_persist`) dispatches
# them and writes its state.
_UNBOUNDED = 1 << 62

# Flink keys are strings; an integer key is tagged so that `1` and `"1"` stay two keys, as they
# are on the embedded engine. A string key is its own Flink key (savepoints of string-keyed jobs
# keep their layout); a string key that starts with NUL is refused (it could collide).
_INT_KEY = "\x00i:"


def flink_key(key: Any) -> str:
    """The Flink (string) key of a ratchet key (a str or an int; bool is not a key)."""
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise ConfigError(f"key {key!r} is a {type(key).__name__}; keys are strings or integers")
    if isinstance(key, int):
        return f"{_INT_KEY}{key}"
    if key.startswith("\x00"):
        raise ConfigError(
            f"key {key!r} starts with a NUL character, which the Flink engine reserves to tell "
            f"integer keys from strings; use another key"
        )
    return key


def native_key(key: str) -> Any:
    """The ratchet key of a Flink key made by `flink_key` (other strings are themselves)."""
    if key.startswith(_INT_KEY):
        return int(key[len(_INT_KEY) :])
    return key


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
    max_concurrent_runs: int | None = None  # per subtask; None: every key with input runs
    max_tasks_per_run: int = 10_000
    sync_workers: int = 16
    idle_keys_cached: int = 10_000  # idle keys kept loaded (their state is also in Flink)
    poll_min_ms: int = 2
    poll_max_ms: int = 100
    end_wait_log_s: float = 30.0
    # How long a call record may fail to reach the external call journal (retried with
    # backoff) before the job fails with a CheckpointError (docs/flink.md).
    journal_retry_s: float = 30.0


@dataclass
class Step:
    """What one callback produced: output lines and whether the key still needs callbacks."""

    outputs: list[str] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)  # seqs of the key's runs that ended
    poll_ms: int | None = None  # register a processing-time timer this far ahead
    active: bool = False  # the key has a run or queued inputs
    # The key's entry in its key group's wake registry (see `flink/_function.py`): +1 add it
    # (the key has work), -1 remove it (idle now), 0 nothing to change.
    wake: int = 0
    admitted: int | None = None  # the seq given to the input this callback admitted


@dataclass(eq=False)
class _Key:
    next_seq: int = 0
    key_dirty: bool = False
    stored_inputs: set[int] = field(default_factory=set)
    written_run: tuple[int, int] | None = None
    calls_written: bool = False
    executing: int = 0
    poll_ms: int = 0
    recorded: CallJournal = field(default_factory=CallJournal)
    # Records from the external call journal for runs not started yet, by seq.
    journalled: dict[int, list[JournalledCall]] = field(default_factory=dict)
    run_input: tuple[int, str] | None = None  # (seq, fingerprint of its input) of the last run
    # Whether the key is in its wake registry: None after a load from state (not known).
    registered: bool | None = None


class _KeyWriter:
    """The durable-call writer `TaskCalls` needs, bound to one key and run.

    A record is kept in the worker and written to the key's state at the key's next callback,
    so it is in Flink's state at the next checkpoint that follows that callback. Without an
    external call journal the future resolves at once: the record is not durable before that
    checkpoint (see docs/flink.md). With one, the future resolves once the journal committed it.
    """

    __slots__ = ("_core", "_key", "_input")

    def __init__(self, core: AgentCore, key: Any, input_fp: str | None) -> None:
        self._core = core
        self._key = key
        self._input = input_fp

    def put_call(self, record: CallRecord) -> concurrent.futures.Future[None]:
        core, key = self._core, self._key
        writer = core._journal_writer
        if writer is not None and self._input is not None:
            fut = writer.put(JournalledCall(flink_key(key), self._input, record))

            def to_state(done: concurrent.futures.Future[None]) -> None:
                # Into keyed state only once journalled: the journal is never behind it.
                if done.exception() is None:
                    core._add_call(key, record)

            fut.add_done_callback(to_state)
            return fut
        core._add_call(key, record)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return done


class _JournalWriter(threading.Thread):
    """The one thread that writes the external call journal: records are group-committed,
    each future resolved once its group is durable; completion marks ride along.

    A failed write is retried with backoff for `retry_s`, then every waiting and later record
    fails with a `CheckpointError` (an engine fault: it fails the job, it is never the action's
    error), so no result returns to an action as if it were durable when it is not.
    """

    def __init__(self, store: CallJournalStore, retry_s: float, clock: Clock) -> None:
        super().__init__(name="ratchet-call-journal", daemon=True)
        self.store = store
        self.retry_s = retry_s
        self.clock = clock
        self._q: queue.SimpleQueue[tuple[str, Any, concurrent.futures.Future[None] | None]] = (
            queue.SimpleQueue()
        )
        self._failed: CheckpointError | None = None

    def put(self, call: JournalledCall) -> concurrent.futures.Future[None]:
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._q.put(("put", call, fut))
        return fut

    def complete(self, key: str, seq: int) -> None:
        self._q.put(("done", (key, seq), None))

    def stop(self, timeout: float = 10.0) -> None:
        self._q.put(("stop", None, None))
        self.join(timeout)

    def run(self) -> None:
        while True:
            items = take_all(self._q)
            self._write(
                [(c, f) for kind, c, f in items if kind == "put" and f is not None],
                [m for kind, m, _ in items if kind == "done"],
            )
            if any(kind == "stop" for kind, _, _ in items):
                return

    def _write(
        self,
        puts: list[tuple[JournalledCall, concurrent.futures.Future[None]]],
        marks: list[tuple[str, int]],
    ) -> None:
        store = self.store
        if puts:
            calls = [c for c, _ in puts]
            error = self._failed or self._retrying("durable-call records", lambda: store.put(calls))
            if error is not None:
                self._failed = error
            for _, fut in puts:
                _settle(fut, error)
        if marks and self._failed is None:
            # Taken now, after the callback that completed the runs wrote their key's state:
            # `prune` compares it with a checkpoint's trigger time.
            at = self.clock.now()
            if self._retrying("run completions", lambda: store.complete(marks, at)):
                log.warning("call journal: %d run completion(s) not marked", len(marks))

    def _retrying(self, what: str, write: Callable[[], None]) -> CheckpointError | None:
        started = self.clock.monotonic()
        attempt = 0
        while True:
            try:
                write()
                return None
            except Exception as exc:  # noqa: BLE001 - any storage fault is retried
                attempt += 1
                if self.clock.monotonic() - started >= self.retry_s:
                    return CheckpointError(
                        f"the call journal did not take {what} for {self.retry_s:g}s "
                        f"({attempt} attempts); last error: {type(exc).__name__}: "
                        f"{str(exc).strip()[:300]}. The job fails rather than return a result "
                        f"that is not durable; Flink restarts it from its last checkpoint"
                    )
                log.warning("call journal: %s not written (attempt %d): %s", what, attempt, exc)
                self.clock.sleep_sync(min(0.05 * 2**attempt, 2.0))


def _settle(fut: concurrent.futures.Future[None], error: BaseException | None) -> None:
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(None)
    except concurrent.futures.InvalidStateError:
        pass


class AgentCore:
    """One subtask's machine, event loop and thread pool; state per key through `KeyStore`."""

    def _no_delays(self, event: Any) -> None:
        if self.binding.delayed(event) is not None:
            raise ConfigError(
                "send_event(delay=/at=) needs durable timers, which the Flink engine does not "
                "have yet (docs/flink.md); run the agent on the embedded engine"
            )

    def __init__(
        self,
        binding: Binding,
        config: CoreConfig | None = None,
        clock: Clock = SYSTEM_CLOCK,
        journal: CallJournalStore | None = None,
    ) -> None:
        if binding.memory_version != 1:
            # Keyed state holds memory without a layout version: a migration could not tell
            # migrated keys from old ones, so it is not attempted.
            raise ConfigError(
                f"{binding.name} declares memory_version {binding.memory_version}; the Flink "
                f"engine does not version keyed memory (memory migrations run on the embedded "
                f"engine: `ratchet migrate`, or lazily in `ratchet run`). Keep memory_version = "
                f"1 for an agent that runs on Flink"
            )
        retried = [
            a.name for a in getattr(getattr(binding, "spec", None), "actions", ()) if a.retry
        ]
        if retried:
            raise ConfigError(
                f"{binding.name}: action(s) {retried} have retry=, whose waits between attempts "
                f"are durable timers, which the Flink engine does not have yet (docs/flink.md); "
                f"retry inside the action, or run the agent on the embedded engine"
            )
        self.binding = binding
        self.config = config or CoreConfig()
        self.clock = clock
        # The external call journal (None: records are durable at the next checkpoint only).
        self.journal = journal
        self._journal_writer: _JournalWriter | None = None
        self._journal_keys: set[str] = set()  # keys with records in the journal, not read yet
        limit = self.config.max_concurrent_runs
        if limit is not None and limit < 1:
            raise ConfigError(f"max_concurrent_runs must be at least 1, not {limit}")
        self.machine = Machine(
            binding.listeners,
            binding.is_output,
            _UNBOUNDED if limit is None else limit,
            self.config.max_tasks_per_run,
            binding.budget_output,
            delayed=self._no_delays,
        )
        self._keys: dict[Any, _Key] = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._done: dict[Any, list[tuple[Task, Outcome]]] = {}
        self._calls: dict[Any, list[CallRecord]] = {}
        self._held: dict[Any, list[Task]] = {}  # first tasks of runs started for another key
        # Idle keys stay loaded, least recently used first: keyed state is only ever written
        # through this worker, so the loaded copy is the stored one, and a key's next input
        # needs no state reads.
        self._idle: OrderedDict[Any, None] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        # Async tasks admitted on the loop: at most `max_concurrent_tasks` run, the rest wait in
        # order; running ones are held here (the loop keeps only weak references to tasks).
        self._running: set[asyncio.Task[None]] = set()
        self._waiting: deque[Coroutine[Any, Any, None]] = deque()
        self._dispatcher = Dispatcher(
            binding,
            spawn=self._spawn,
            on_async_done=self._deliver,
            on_sync_done=self._deliver_batch,
            sync_workers=self.config.sync_workers,
            thread_name="ratchet-flink-sync",
        )
        self._fused = FusedRunners(self._dispatcher, None, self._make_calls)

    @property
    def tasks_executed(self) -> int:
        return self._dispatcher.executed

    # -- lifecycle --------------------------------------------------------------------------

    def open(self) -> None:
        loop = asyncio.new_event_loop()
        install_task_factory(loop)
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            ready.set()
            loop.run_forever()

        self._loop = loop
        self._loop_thread = threading.Thread(target=run, name="ratchet-flink-loop", daemon=True)
        self._loop_thread.start()
        ready.wait()
        if self.journal is not None:
            # Which keys have records (after a restore: the runs since the checkpoint); a key's
            # records are read when this worker first loads the key. None for a fresh job.
            self._journal_keys = self.journal.keys()
            self._journal_writer = _JournalWriter(
                self.journal, self.config.journal_retry_s, self.clock
            )
            self._journal_writer.start()
        self._dispatcher.start()

    def close(self) -> None:
        """Cancel the tasks still running (their runs are in Flink's state as in flight) and
        close the loop; a thread blocked in a user's call is left to finish on its own."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout=5)
            except (concurrent.futures.TimeoutError, RuntimeError):
                log.warning("tasks still running at close; the loop is stopped anyway")
            loop.call_soon_threadsafe(loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout=5)
                if not self._loop_thread.is_alive():
                    loop.close()
        self._dispatcher.stop()
        while self._waiting:
            self._waiting.popleft().close()  # never started: its run is in state as in flight
        self._loop = None
        if self._journal_writer is not None:
            self._journal_writer.stop()
            self._journal_writer = None

    # -- callbacks (the function calls these with the current key set) ---------------------

    def element(self, key: Any, value: Any, store: KeyStore) -> Step:
        """One input for `key`: admitted, its run started if the key is idle."""
        info = self._load(key, store)
        seq = info.next_seq
        info.next_seq += 1
        info.key_dirty = True
        self.machine.admit(key, seq, self.binding.event_from_input(value))
        step = Step(admitted=seq)
        self._pump(key, info, step)
        self._persist(key, info, store, step)
        return step

    def timer(self, key: Any, store: KeyStore, *, end: bool = False) -> Step:
        """Apply the key's finished tasks. With `end` (end of input), wait until the key is
        idle; `drain` waits for every key at once instead (the PyFlink function uses it)."""
        info = self._load(key, store)
        step = self._callback(key, info, store)
        if end and self._key_busy(key):
            waited = self.clock.monotonic()
            while self._key_busy(key):
                with self._cond:
                    if not self._done.get(key):
                        self._cond.wait(timeout=1.0)
                self._apply_done(key, info, step)
                if self.clock.monotonic() - waited > self.config.end_wait_log_s:
                    log.warning("end of input: key %r still has work running", key)
                    waited = self.clock.monotonic()
            self._persist(key, info, store, step)
        return step

    def _others(
        self, current: Any, switch: Callable[[Any], KeyStore]
    ) -> Iterator[tuple[Any, Step]]:
        """The drain's step: apply the finished tasks of every other key that has some (and
        dispatch the held first tasks of runs started for other keys), each with its own keyed
        state: `switch(key)` makes `key` current and returns its `KeyStore`. Only the
        end-of-input drain does this; in any other callback a key is worked on alone (with
        this in every callback, a key was seen lost for good after a worker kill)."""
        with self._lock:
            keys = [k for k, done in self._done.items() if done and k != current]
        keys += [k for k in self._held if k != current and k not in keys]
        for key in keys:
            info = self._keys.get(key)
            if info is None:
                continue  # evicted meanwhile: nothing of it runs
            store = switch(key)
            yield key, self._callback(key, info, store)

    def drain(self, switch: Callable[[Any], KeyStore]) -> Iterator[tuple[Any, Step]]:
        """End of a bounded input: apply every key's finished tasks as they come, until no
        key of this worker has work. All keys run concurrently meanwhile (the operator cannot
        take a checkpoint until this returns; see docs/flink.md)."""
        waited = self.clock.monotonic()
        while any(self._key_busy(k) for k in list(self.machine.keys)):
            with self._cond:
                if not any(self._done.values()) and not self._held:
                    self._cond.wait(timeout=1.0)
            yield from self._others(None, switch)
            if self.clock.monotonic() - waited > self.config.end_wait_log_s:
                busy = [k for k in self.machine.keys if self._key_busy(k)]
                log.warning("end of input: %d key(s) still have work running", len(busy))
                waited = self.clock.monotonic()

    def _callback(self, key: Any, info: _Key, store: KeyStore) -> Step:
        step = Step()
        self._pump(key, info, step)  # a run restored by `_load` dispatches its first tasks
        applied = self._apply_done(key, info, step)
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

    def loaded(self, key: Any) -> bool:
        """Whether this core has the key loaded (it had a callback since this worker began)."""
        return key in self._keys

    def admitted(self, key: Any) -> int | None:
        """How many inputs the key has admitted (None if it is not loaded)."""
        info = self._keys.get(key)
        return None if info is None else info.next_seq

    # -- loading and storing one key --------------------------------------------------------

    def _load(self, key: Any, store: KeyStore) -> _Key:
        info = self._keys.get(key)
        if info is not None:
            self._idle.pop(key, None)
            return info
        info = self._keys[key] = _Key(poll_ms=self.config.poll_min_ms)
        b = self.binding
        memory: dict[str, Any] = {}
        next_dispatch = 0
        raw = store.get_key()
        if raw is None:
            # A key never written: every callback that writes a key's run or inputs also
            # writes its key record (admitting an input marks it dirty), so there is nothing
            # else to read (each read is a round trip to the JVM in process mode).
            self.machine.load_key(key, memory, next_dispatch, None, [])
            info.registered = False  # only a key with state can be registered
            if self._journal_keys:
                self._read_journal(key, info, info.next_seq)
            return info
        data = decoded("ratchet-key", key, codec.decode, raw)
        memory = decoded("ratchet-key", key, lambda: decode_memory(data["m"]))
        next_dispatch = data["d"]
        info.next_seq = data["n"]
        run_raw = store.get_run()
        run = decoded("ratchet-run", key, decode_run, b, key, run_raw) if run_raw else None
        queued = []
        for seq, ev in store.inputs():
            queued.append(
                (seq, decoded("ratchet-inputs", f"{key} input {seq}", decode_event, b, ev))
            )
            info.stored_inputs.add(seq)
        if run is not None:
            info.written_run = (run.seq, len(run.journal))
            for blob in store.calls():
                rec = decoded("ratchet-calls", key, decode_call, blob)
                info.calls_written = True
                if rec.seq == run.seq:
                    info.recorded.add(rec)
        self.machine.load_key(key, memory, next_dispatch, run, queued)
        if self._journal_keys:
            first = run.seq if run is not None else min(s for s, _ in queued) if queued else None
            self._read_journal(key, info, info.next_seq if first is None else first)
        return info

    def _read_journal(self, key: Any, info: _Key, first: int) -> None:
        """The key's records in the external journal, kept for its runs from `first` on
        (runs before it completed in the restored state: their rows are marked completed)."""
        fkey = flink_key(key)
        if fkey not in self._journal_keys:
            return
        assert self.journal is not None and self._journal_writer is not None
        try:
            calls = self.journal.get(fkey)
        except Exception as exc:  # noqa: BLE001 - any storage fault fails the job
            raise CheckpointError(
                f"the call journal could not be read for key {key!r}: {type(exc).__name__}: "
                f"{str(exc).strip()[:300]}; the job fails and Flink restarts it"
            ) from None
        self._journal_keys.discard(fkey)
        done = -1
        for call in calls:
            seq = call.record.seq
            if seq < first:
                done = max(done, seq)
            else:
                info.journalled.setdefault(seq, []).append(call)
        if done >= 0:
            self._journal_writer.complete(fkey, done)

    def _persist(self, key: Any, info: _Key, store: KeyStore, step: Step) -> None:
        m = self.machine
        m.discard_changes()
        ks = m.keys[key]
        live = ks.run
        b = self.binding
        if info.key_dirty:
            store.put_key(
                codec.encode(
                    {"m": encode_memory(ks.memory), "d": ks.next_dispatch, "n": info.next_seq}
                )
            )
            info.key_dirty = False
        if ks.queue or info.stored_inputs:
            # Queued inputs: what the key's queue holds now, apart from its in-flight run's
            # input (the run state carries that one).
            running = live.seq if live is not None else None
            want = {seq: ev for seq, ev in ks.queue if seq != running}
            for seq in info.stored_inputs - want.keys():
                store.remove_input(seq)
            for seq in want.keys() - info.stored_inputs:
                store.put_input(seq, encode_event(b, want[seq]))
            info.stored_inputs = set(want)
        calls = None
        if self._calls:  # filled by action threads; one added after this look waits for the
            with self._lock:  # key's next callback, as one added after the pop would
                calls = self._calls.pop(key, None)
        if live is None:
            if info.written_run is not None:
                store.clear_run()
                info.written_run = None
            if info.calls_written:
                store.clear_calls()
                info.calls_written = False
            info.recorded.clear()
        else:
            sig = (live.seq, len(live.journal))
            if info.written_run != sig:
                if info.written_run is not None and info.written_run[0] != live.seq:
                    if info.calls_written:
                        store.clear_calls()
                        info.calls_written = False
                run = m.key_snapshot(key)[2]
                assert run is not None
                store.put_run(encode_run(b, run))
                info.written_run = sig
            for rec in calls or ():
                if rec.seq == live.seq:
                    store.put_call(f"{rec.task_id}#{rec.idx}", encode_call(rec))
                    info.calls_written = True
        step.active = live is not None or bool(ks.queue)
        if step.active != info.registered:
            step.wake = 1 if step.active else -1
            info.registered = step.active
        if info.executing > 0:
            step.poll_ms = info.poll_ms  # work running: call again
        elif step.active:
            # A run waiting for a slot (`max_concurrent_runs`), or started by another key's
            # callback with its first tasks held: only this key's own callback dispatches them
            # (a callback never works on another key's state, except in the end-of-input drain).
            step.poll_ms = self.config.poll_max_ms
        elif not step.active:
            idle = self._idle
            idle[key] = None
            while len(idle) > self.config.idle_keys_cached:
                old, _ = idle.popitem(last=False)
                if m.evict_key(old):
                    gone = self._keys.pop(old)
                    if gone.journalled:  # read again if the key comes back
                        self._journal_keys.add(flink_key(old))

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
        for task, outcome in done:
            info.executing -= 1
            if isinstance(outcome, RatchetError):
                raise outcome
            m.finish(task, outcome)
        self._pump(key, info, step)
        return True

    def _pump(self, key: Any, info: _Key, step: Step) -> None:
        m = self.machine
        b = self.binding
        held = self._held.pop(key, None)
        if held:
            m.dispatched[:0] = held
        dispatcher = self._dispatcher
        # The fused path (as on the embedded engine): an inline action without a retry policy,
        # in a task with no durable-call records to be handed, runs here and its result is
        # applied at once; its call journal is made only if it makes a call. Not with an
        # external call journal, whose records a run's first task takes (`_input_fp`).
        fused = self._fused if self.journal is None and not info.recorded.has_records() else None
        while True:
            dispatched, outputs, completed = m.take_effects()
            for out in outputs:
                rec = b.output_record(out)
                if isinstance(key, int):
                    # Inputs are numbered per key on Flink, so `1:0:...` would name the first
                    # output of both key 1 and key "1": integer keys' ids start with `#`.
                    rec["id"] = f"#{rec['id']}"
                step.outputs.append(json_line_or_error(rec))
            if completed:
                info.key_dirty = True
                step.completed.extend(run.seq for run in completed)
                if self._journal_writer is not None:
                    self._journal_writer.complete(flink_key(key), max(r.seq for r in completed))
            if not dispatched:
                return
            for task in dispatched:
                if task.key != key:
                    if self.config.max_concurrent_runs is None:
                        raise InternalError(
                            f"a callback for key {key!r} dispatched key {task.key!r}"
                        )
                    # A slot freed by this key's run went to another key's run: its first
                    # tasks wait for that key's own callback (it polls meanwhile).
                    self._held.setdefault(task.key, []).append(task)
                    continue
                if fused is not None:
                    runner = fused[task.action]
                    if runner is not None:
                        m.finish(task, runner(task))
                        continue
                writer = _KeyWriter(self, key, self._input_fp(info, task))
                calls = info.recorded.calls_for(task, writer)
                outcome = dispatcher.dispatch(task, calls)
                if outcome is None:
                    info.executing += 1
                elif isinstance(outcome, RatchetError):
                    raise outcome
                else:
                    m.finish(task, outcome)

    def _make_calls(self, task: Task) -> TaskCalls:
        """A fused task's call journal (no external journal), made when it makes a call."""
        return self._keys[task.key].recorded.calls_for(task, _KeyWriter(self, task.key, None))

    def _input_fp(self, info: _Key, task: Task) -> str | None:
        """The fingerprint of the task's run input (with a journal only); the first task of a
        run also takes the run's records that the external journal holds for that input."""
        if self.journal is None:
            return None
        run = task.run
        if info.run_input is None or info.run_input[0] != run.seq:
            info.run_input = (run.seq, codec.digest(self.binding.event_to_wire(run.input_event)))
        fp = info.run_input[1]
        found = info.journalled.pop(run.seq, None)
        for call in found or ():
            if call.input == fp:  # the same input at the same number on this key
                info.recorded.add(call.record)
        return fp

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._admit, coro)

    def _admit(self, coro: Coroutine[Any, Any, None]) -> None:
        # On the loop. A plain counter and queue rather than an asyncio.Semaphore, whose waiters
        # (tasks made by run_coroutine_threadsafe) were seen never to wake: runs stuck with
        # every permit free, under benchmarks/peers workload 3's pooled HTTP client.
        if len(self._running) >= self.config.max_concurrent_tasks:
            self._waiting.append(coro)
            return
        assert self._loop is not None
        t = self._loop.create_task(coro)
        self._running.add(t)
        t.add_done_callback(self._finished)

    def _finished(self, t: asyncio.Task[None]) -> None:
        self._running.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("an action task failed outside its action", exc_info=t.exception())
        if self._waiting:
            self._admit(self._waiting.popleft())

    def _deliver(self, task: Task, outcome: Outcome) -> None:
        self._deliver_batch([(task, outcome)])

    def _deliver_batch(self, batch: list[tuple[Task, Outcome]]) -> None:
        with self._cond:
            for task, outcome in batch:
                self._done.setdefault(task.key, []).append((task, outcome))
            self._cond.notify_all()

    def _add_call(self, key: Any, record: CallRecord) -> None:
        with self._lock:
            self._calls.setdefault(key, []).append(record)


async def _cancel_all() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=2)


@dataclass
class _KeyedSlot:
    key: bytes | None = None
    inputs: dict[int, bytes] = field(default_factory=dict)
    run: bytes | None = None
    calls: dict[str, bytes] = field(default_factory=dict)


class MemoryKeyedState:
    """Keyed state in memory, shaped like the PyFlink function's: the Flink core's test store.

    `view(key)` is the `KeyStore` Flink would hand the core with `key` current; `snapshot()`
    is what a completed Flink checkpoint holds, and a new core given that snapshot is what a
    restore after a TaskManager loss looks like.
    """

    def __init__(self) -> None:
        self._slots: dict[Any, _KeyedSlot] = {}

    def view(self, key: Any) -> KeyStore:
        return _KeyView(self._slots.setdefault(key, _KeyedSlot()))

    def keys(self) -> list[Any]:
        return [k for k, slot in self._slots.items() if slot != _KeyedSlot()]

    def snapshot(self) -> MemoryKeyedState:
        other = MemoryKeyedState()
        for key, slot in self._slots.items():
            other._slots[key] = _KeyedSlot(slot.key, dict(slot.inputs), slot.run, dict(slot.calls))
        return other


class _KeyView:
    __slots__ = ("_slot",)

    def __init__(self, slot: _KeyedSlot) -> None:
        self._slot = slot

    def get_key(self) -> bytes | None:
        return self._slot.key

    def put_key(self, value: bytes) -> None:
        self._slot.key = value

    def inputs(self) -> list[tuple[int, bytes]]:
        return list(self._slot.inputs.items())

    def put_input(self, seq: int, value: bytes) -> None:
        self._slot.inputs[seq] = value

    def remove_input(self, seq: int) -> None:
        self._slot.inputs.pop(seq, None)

    def get_run(self) -> bytes | None:
        return self._slot.run

    def put_run(self, value: bytes) -> None:
        self._slot.run = value

    def clear_run(self) -> None:
        self._slot.run = None

    def calls(self) -> list[bytes]:
        return list(self._slot.calls.values())

    def put_call(self, name: str, value: bytes) -> None:
        self._slot.calls[name] = value

    def clear_calls(self) -> None:
        self._slot.calls.clear()
