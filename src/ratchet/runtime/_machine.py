"""The run machine: the whole of ratchet's agent semantics, with no I/O and no clock.

Engines feed it inputs (`admit`) and finished tasks (`finish`), and perform what it asks
for: tasks to execute (`dispatched`), outputs for the outbox (`outputs`). It decides the
order of everything, so two engines driving it behave identically.

Vocabulary (see DESIGN.md): a *run* processes one input for its key; a *task* is one action
on one event; task ids are paths from the root event, so they are the same on replay; each
task gets a per-key *dispatch index*; finished tasks *commit* in dispatch order.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ratchet._errors import InternalError, InvalidArgumentError, NonDeterminismError
from ratchet.runtime._memops import EXPIRES, LTM_ADD, LTM_DELETE, apply_op

PENDING = 0
FINISHED = 1
COMMITTED = 2

ROOT_EVENT_ID = "r"
# A task id is the path from the root event; past this length the path's prefix is replaced
# by its digest, so ids stay bounded however deep a chain of events goes.
MAX_TASK_ID = 200
BUDGET_TASK_ID = "r!budget"
# Journal entries that are not tasks start with "!" (a task id starts with "r" or "~"):
# `!fire <event id>` records where in the run's dispatch order a delayed event was delivered
# (its dispatch index is the next index at that moment); `!start` the time the run observed
# when it started (its events hold the time), for memory that expires.
FIRE_NOTE = "!fire "
START_NOTE = "!start"


@dataclass(slots=True)
class TaskResult:
    """What a finished task did: memory ops and emitted events (a failure is an event too)."""

    stm_ops: list[tuple[Any, ...]]
    sensory_ops: list[tuple[Any, ...]]
    events: list[Any]
    # How it ran, for run traces: beyond its start and duration (attempts, calls, notes).
    trace: dict[str, Any] | None = None
    started: float | None = None  # when it started (None: not timed, e.g. replayed)
    duration: float = 0.0


# JournalEntry and Output are values, never changed once made; not `frozen=True` dataclasses
# only because those cost seven times as much to make, and one of each is made per task.
@dataclass(slots=True)
class JournalEntry:
    """A committed task, as replay needs it: enough to skip executing it again."""

    task_id: str
    dispatch_index: int
    stm_ops: tuple[tuple[Any, ...], ...]
    sensory_ops: tuple[tuple[Any, ...], ...]
    events: tuple[Any, ...]


@dataclass(slots=True, eq=False)
class Task:
    run: Run
    task_id: str
    action: str
    event: Any
    dispatch_index: int
    stm: dict[str, Any]
    sensory: dict[str, Any]
    state: int = PENDING
    result: TaskResult | None = None
    replayed: bool = False

    @property
    def key(self) -> Any:
        return self.run.key

    @property
    def seq(self) -> int:
        return self.run.seq


class Run:
    """One input's processing for its key (see the module docstring), as the machine keeps it.

    A plain slotted class rather than a dataclass: one is made per input, and the dataclass's
    default factories made it cost about ten times a `Task`."""

    __slots__ = (
        "key", "seq", "input_event", "base_dispatch", "next_dispatch", "stm", "sensory",
        "journal", "replay", "listeners", "is_output", "fifo", "executed", "skipped",
        "dropped", "retired", "memory_version", "started_at", "pending", "waiting", "parked",
        "timers", "fires", "notes", "errors", "trace",
    )  # fmt: skip

    def __init__(
        self,
        key: Any,
        seq: int,
        input_event: Any,
        base_dispatch: int,
        next_dispatch: int,
        stm: dict[str, Any],
    ) -> None:
        self.key = key
        self.seq = seq
        self.input_event = input_event
        self.base_dispatch = base_dispatch
        self.next_dispatch = next_dispatch
        self.stm = stm
        self.sensory: dict[str, Any] = {}
        self.journal: list[JournalEntry] = []
        self.replay: dict[str, JournalEntry] | None = None
        # A run that started under an earlier agent version keeps that version's dispatch
        # (None: the machine's own); see `RestoredRun.listeners`.
        self.listeners: Callable[[Any], Sequence[str]] | None = None
        self.is_output: Callable[[Any], bool] | None = None
        self.fifo: deque[Task] = deque()
        self.executed = 0
        self.skipped = 0
        self.dropped = 0  # dispatches refused once the run used up its task budget
        self.retired = 0  # dispatches to actions the agent no longer has (a pinned run's)
        self.memory_version = 1  # the layout of the memory this run reads and writes
        self.started_at: float | None = None  # the time the run observed at its start (TTLs)
        self.pending = 0  # tasks dispatched to execute and not finished
        self.waiting = 0  # of those, tasks parked in a durable wait (sleep, signal)
        # holds no run slot: everything left of it is waiting on time/signals
        self.parked = False
        # delayed events not delivered yet: event id -> (due time, event)
        self.timers: dict[str, tuple[float, Any]] = {}
        # replay: delayed events delivered at a recorded dispatch index, index -> (event id, event)
        self.fires: dict[int, tuple[str, Any]] = {}
        self.notes: dict[str, JournalEntry] = {}  # replayed annotations
        self.errors: list[Any] = []  # error outputs: the run failed
        # committed tasks, as they ran: (task id, action, dispatch index, event, replayed, result)
        self.trace: list[TraceStep] = []

    def __repr__(self) -> str:
        return f"Run(key={self.key!r}, seq={self.seq}, pending={self.pending})"


# One committed task in a run's trace, as the machine keeps it until the run completes:
# (task id, action, dispatch index, event, replayed, result); `trace_dicts` spells it out.
TraceStep = tuple[str, str, int, Any, bool, TaskResult]


@dataclass(slots=True)
class Output:
    """An emitted output event with its stable id (the same after recovery)."""

    id: str
    key: Any
    seq: int
    task_id: str
    index: int
    event: Any


@dataclass(slots=True, eq=False)
class KeyState:
    memory: dict[str, Any]
    next_dispatch: int = 0
    version: int = 1  # the memory's layout version (memory migrations bring it up)
    queue: deque[tuple[int, Any]] = field(default_factory=deque)
    run: Run | None = None


@dataclass(slots=True)
class RestoredRun:
    """An in-flight run as a checkpoint holds it."""

    key: Any
    seq: int
    input_event: Any
    base_dispatch: int
    journal: list[JournalEntry]
    # Set for a run that started under an earlier agent version: that version's dispatch,
    # and the memory layout it started on (a key with no committed memory yet gets it).
    listeners: Callable[[Any], Sequence[str]] | None = None
    is_output: Callable[[Any], bool] | None = None
    memory_version: int | None = None


@dataclass(slots=True)
class Delta:
    """What changed since the last capture: the content of one incremental checkpoint."""

    keys: dict[Any, tuple[dict[str, Any], int, int]] = field(default_factory=dict)
    new_inputs: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    done_inputs: set[int] = field(default_factory=set)
    runs: dict[int, RestoredRun] = field(default_factory=dict)
    outputs: dict[str, Output] = field(default_factory=dict)
    completed: set[int] = field(default_factory=set)  # every run completed, for cleanup
    # runs that completed with errors: seq -> (key, input event, error events, task ids)
    failed: dict[int, tuple[Any, Any, list[Any], list[str]]] = field(default_factory=dict)
    redriven: dict[int, int] = field(default_factory=dict)  # dead letter id -> its new seq
    # runs completed with tracing on: seq -> (key, failed?, started at, the tasks' trace)
    # (the tasks' trace as `pack_trace` packed it, when the engine gave the machine one)
    traces: dict[int, tuple[Any, bool, float | None, list[dict[str, Any]] | bytes]] = field(
        default_factory=dict
    )
    # long-term memory writes of runs that completed, in commit order (LTM_ADD / LTM_DELETE)
    ltm: list[tuple[Any, ...]] = field(default_factory=list)

    def absorb(self, later: Delta) -> None:
        """Fold a later delta into this one (after a failed checkpoint, both must be written)."""
        self.keys.update(later.keys)
        self.outputs.update(later.outputs)
        self.completed |= later.completed
        self.failed.update(later.failed)
        self.redriven.update(later.redriven)
        self.traces.update(later.traces)
        self.ltm.extend(later.ltm)
        for seq, item in later.new_inputs.items():
            self.new_inputs[seq] = item
        for seq in later.done_inputs:
            self.runs.pop(seq, None)
            if self.new_inputs.pop(seq, None) is None:
                self.done_inputs.add(seq)
        self.runs.update({s: r for s, r in later.runs.items() if s not in later.done_inputs})

    def is_empty(self) -> bool:
        return not (
            self.keys
            or self.new_inputs
            or self.done_inputs
            or self.runs
            or self.outputs
            or self.redriven
            or self.ltm
        )


class Machine:
    """Per-key runs in input order, FIFO commit in dispatch order, replay from journals.

    `listeners(event)` names the actions that hear an event, in definition order;
    `is_output(event)` says whether an event leaves the agent (it goes to `outputs`).
    A run may dispatch at most `max_tasks_per_run` tasks (an event loop in an agent must not
    grow state without bound); past that its further events are not delivered and, when it
    completes, `budget_output(key, seq, dropped)` gives an event reported as its output.

    Upgrades: a run restored with its own `listeners` (it started under an earlier agent
    version) dispatches by them, except to actions not in `known_actions` that its journal
    does not hold (retired actions). `memory_version` is the layout new and migrated keys
    have; a run that starts afresh on a key with an older one first has
    `migrate(key, memory, version)` bring it up (a run resuming a journal keeps its memory).
    """

    def __init__(
        self,
        listeners: Callable[[Any], Sequence[str]],
        is_output: Callable[[Any], bool],
        max_concurrent_runs: int = 64,
        max_tasks_per_run: int = 10_000,
        budget_output: Callable[[Any, int, int], Any] | None = None,
        *,
        memory_version: int = 1,
        migrate: Callable[[Any, dict[str, Any], int], dict[str, Any]] | None = None,
        known_actions: Iterable[str] | None = None,
        delayed: Callable[[Any], tuple[float, Any] | None] | None = None,
        now: Callable[[], float] | None = None,
        expire: Callable[[dict[str, Any], float], dict[str, Any] | None] | None = None,
        is_error: Callable[[Any], bool] | None = None,
    ) -> None:
        if max_concurrent_runs < 1:
            raise InvalidArgumentError(
                f"max_concurrent_runs must be at least 1, not {max_concurrent_runs!r}"
            )
        if max_tasks_per_run < 1:
            raise InvalidArgumentError(
                f"max_tasks_per_run must be at least 1, not {max_tasks_per_run!r}"
            )
        self.max_tasks_per_run = max_tasks_per_run
        self._budget_output = budget_output
        self.memory_version = memory_version
        self._migrate = migrate
        self._known = frozenset(known_actions) if known_actions is not None else None
        self._delayed = delayed
        self._now = now
        self._expire = expire
        self._is_error = is_error
        self.runs_failed = 0
        # Keep what each committed task did, for run traces (`describe_event(event)` names an
        # event for the trace); None: no traces.
        self.describe_event: Callable[[Any], str] | None = None
        # `pack_trace(started at, steps)`: a completed run's trace as stored, made when the run
        # completes rather than at the checkpoint (so its objects do not outlive the run).
        self.pack_trace: Callable[[float | None, list[TraceStep]], bytes] | None = None
        # Collect the long-term memory writes of completed runs into the delta (an agent that
        # uses long-term memory; others pay nothing for it).
        self.collect_ltm = False
        self.ltm_done: list[tuple[Any, ...]] = []  # effects: those writes, for the engine's index
        self.timers: list[tuple[Run, str, float]] = []  # effects: delayed events to schedule
        self._listeners = listeners
        self._is_output = is_output
        self.max_concurrent_runs = max_concurrent_runs
        self.keys: dict[Any, KeyState] = {}
        # `stored_key(key)`: a key's committed (memory, next dispatch, memory version) that
        # `restore` was not given (the engine restores idle keys lazily), or None for a new
        # key; asked once, when the key is first needed. None: every stored key was given.
        self.stored_key: Callable[[Any], tuple[dict[str, Any], int, int] | None] | None = None
        self._ready: deque[Any] = deque()
        self.active_runs = 0
        self.parked_runs = 0  # runs whose every task waits (they hold no slot): in flight too
        self.buffered_inputs = 0
        # Effects for the engine to take.
        self.dispatched: list[Task] = []
        self.outputs: list[Output] = []
        self.completed: list[Run] = []
        # Tracking for the next checkpoint.
        self._delta = Delta()
        self._dirty_runs: set[int] = set()
        self.tasks_executed = 0
        self.tasks_replayed = 0

    # -- inputs ---------------------------------------------------------------------------

    def admit(self, key: Any, seq: int, input_event: Any) -> None:
        """Take one input. Its run starts now if the key is idle and a run slot is free."""
        ks = self.keys.get(key)
        if ks is None:
            ks = self.key_state(key)
        self.buffered_inputs += 1
        self._delta.new_inputs[seq] = (key, input_event)
        was_empty = not ks.queue
        ks.queue.append((seq, input_event))
        if ks.run is None and was_empty:
            self._ready.append(key)
        self._fill_slots()

    def key_state(self, key: Any, version: int | None = None) -> KeyState:
        """A key's state, read from the store (`stored_key`) on first use; a key the store
        does not hold starts empty at `version` (default: the current memory version).
        Raises what `stored_key` raises, with nothing changed."""
        ks = self.keys.get(key)
        if ks is None:
            stored = self.stored_key(key) if self.stored_key is not None else None
            if stored is None:
                v = self.memory_version if version is None else version
                ks = KeyState(memory={}, version=v)
            else:
                memory, next_dispatch, v = stored
                ks = KeyState(memory=memory, next_dispatch=next_dispatch, version=v)
            self.keys[key] = ks
        return ks

    def restore(
        self,
        memories: dict[Any, tuple[Any, ...]],
        runs: Iterable[RestoredRun],
        queued: Iterable[tuple[int, Any, Any]],
    ) -> None:
        """Load a checkpoint: in-flight runs go first, in dispatch order, before queued inputs.

        `memories`: key -> (memory, next dispatch[, memory version]); without a version the
        memory is taken to be at `memory_version`.
        """
        if self.keys:
            raise InternalError("restore() on a machine that already has state")
        for key, (memory, next_dispatch, *stored) in memories.items():
            v = stored[0] if stored else self.memory_version
            self.keys[key] = KeyState(memory=memory, next_dispatch=next_dispatch, version=v)
        restored = sorted(runs, key=lambda r: (r.base_dispatch, r.seq))
        in_flight = {r.seq for r in restored}
        for r in restored:
            ks = self.key_state(r.key, r.memory_version)
            if ks.run is not None or ks.queue:
                raise InternalError(f"two in-flight runs for key {r.key!r} in one checkpoint")
            ks.queue.append((r.seq, r.input_event))
            self.buffered_inputs += 1
        for seq, key, event in sorted(queued, key=lambda q: q[0]):
            if seq in in_flight:
                continue
            ks = self.key_state(key)
            ks.queue.append((seq, event))
            self.buffered_inputs += 1
        # Start restored runs ahead of everything else, even past the concurrency cap:
        # they held slots when the checkpoint was taken.
        for r in restored:
            ks = self.keys[r.key]
            seq, event = ks.queue[0]
            if seq != r.seq:
                raise InternalError(
                    f"in-flight run {r.seq} of key {r.key!r} is not its oldest input"
                )
            self._start_run(r.key, ks, base=r.base_dispatch, journal=r.journal, pinned=r)
        waiting = sorted(
            (ks.queue[0][0], key) for key, ks in self.keys.items() if ks.run is None and ks.queue
        )
        self._ready.extend(key for _, key in waiting)
        self._fill_slots()

    # -- tasks ----------------------------------------------------------------------------

    def finish(self, task: Task, result: TaskResult) -> None:
        """A dispatched task finished; commit it and every finished task behind it in FIFO."""
        if task.state != PENDING:
            raise InternalError(f"task {task.task_id} finished twice")
        task.state = FINISHED
        task.result = result
        run = task.run
        run.pending -= 1
        fifo = run.fifo
        while fifo and fifo[0].state == FINISHED:  # what _drain does, without its call
            self._commit(fifo.popleft())
        if not fifo and not run.timers:
            self._complete(run)
        # (A run that is not parked and has a task running outside a wait stays as it is.)
        if (run.pending or run.timers) and (run.parked or run.pending == run.waiting):
            self._settle_parking(run)

    def _drain(self, run: Run) -> None:
        fifo = run.fifo
        while fifo and fifo[0].state == FINISHED:
            self._commit(fifo.popleft())
        if not fifo and not run.timers:
            self._complete(run)

    # -- durable waits ----------------------------------------------------------------------

    def wait(self, task: Task, waiting: bool) -> None:
        """A task entered (True) or left (False) a durable wait: a sleep or a signal."""
        run = task.run
        run.waiting += 1 if waiting else -1
        if self.keys.get(run.key) is not None and self.keys[run.key].run is run:
            self._settle_parking(run)

    def _settle_parking(self, run: Run) -> None:
        """Park a run whose every unfinished task waits (and that has no other work), or
        unpark it: a parked run holds no run slot, so other keys' runs start meanwhile."""
        parked = run.pending == run.waiting and (run.pending > 0 or bool(run.timers))
        if parked == run.parked:
            return
        run.parked = parked
        if parked:
            self.active_runs -= 1
            self.parked_runs += 1
            self._fill_slots()
        else:
            self.active_runs += 1  # past the cap if need be: it held the slot before
            self.parked_runs -= 1

    def fire(self, run: Run, event_id: str) -> bool:
        """Deliver a delayed event that fell due (the engine calls this at its time)."""
        ks = self.keys.get(run.key)
        if ks is None or ks.run is not run or event_id not in run.timers:
            return False
        _due, event = run.timers.pop(event_id)
        note = JournalEntry(f"{FIRE_NOTE}{event_id}", run.next_dispatch, (), (), ())
        run.journal.append(note)
        self._dirty_runs.add(run.seq)
        self._deliver(run, event_id, event, live=True)
        self._drain(run)  # completes the run if the event started nothing and nothing is left
        if ks.run is run:
            self._settle_parking(run)
        return True

    def waiting_runs(self) -> list[Run]:
        return [ks.run for ks in self.keys.values() if ks.run is not None and ks.run.parked]

    def _commit(self, task: Task) -> None:
        run = task.run
        res = task.result
        assert res is not None
        if res.stm_ops:
            stm = dict(run.stm)
            for op in res.stm_ops:
                apply_op(stm, op)
            run.stm = stm
        if res.sensory_ops:
            sensory = dict(run.sensory)
            for op in res.sensory_ops:
                apply_op(sensory, op)
            run.sensory = sensory
        task.state = COMMITTED
        events = res.events
        entry = JournalEntry(
            task.task_id,
            task.dispatch_index,
            tuple(res.stm_ops) if res.stm_ops else (),
            tuple(res.sensory_ops) if res.sensory_ops else (),
            tuple(events) if events else (),
        )
        run.journal.append(entry)
        self._dirty_runs.add(run.seq)
        if self.describe_event is not None:
            run.trace.append(
                (task.task_id, task.action, task.dispatch_index, task.event, task.replayed, res)
            )
        is_output = run.is_output or self._is_output
        delayed = self._delayed
        for index, event in enumerate(events):
            timed = delayed(event) if delayed is not None else None
            if timed is not None:
                self._schedule(run, f"{task.task_id}.{index}", *timed)
                continue
            if is_output(event):
                if self._is_error is not None and self._is_error(event):
                    run.errors.append(event)
                if not task.replayed:
                    out = Output(
                        id=f"{run.key}:{run.seq}:{task.task_id}:{index}",
                        key=run.key,
                        seq=run.seq,
                        task_id=task.task_id,
                        index=index,
                        event=event,
                    )
                    self.outputs.append(out)
                    self._delta.outputs[out.id] = out
                continue
            if run.fires:
                self._deliver(run, f"{task.task_id}.{index}", event)
            else:  # what _deliver does when no delayed event waits for an index
                self._dispatch_event(run, f"{task.task_id}.{index}", event)

    def _schedule(self, run: Run, event_id: str, due: float, event: Any) -> None:
        note = run.notes.pop(f"{FIRE_NOTE}{event_id}", None)
        if note is not None:
            # Replay: it was delivered when the run's next dispatch index was this one.
            run.journal.append(note)
            if note.dispatch_index <= run.next_dispatch:
                self._deliver(run, event_id, event)
            else:
                run.fires[note.dispatch_index] = (event_id, event)
            return
        run.timers[event_id] = (due, event)
        self.timers.append((run, event_id, due))

    def _deliver(self, run: Run, event_id: str, event: Any, live: bool = False) -> None:
        """Dispatch an event, then any delayed event the journal says came next. `live`: a
        delayed event falling due now (`fire`), not one a replay finds fired already."""
        self._deliver_one(run, event_id, event, live)
        while run.fires:
            nxt = run.fires.pop(run.next_dispatch, None)
            if nxt is None:
                break
            self._deliver_one(run, *nxt, False)

    def _deliver_one(self, run: Run, event_id: str, event: Any, live: bool) -> None:
        """A delayed output (`send_event(OutputEvent(...), delay=...)`) is an output when it
        falls due, as it would have been when sent (no action listens to outputs: it was
        dropped, the run "ok"); in a replay it went out already, with the checkpoint that
        holds its fire note."""
        is_output = run.is_output or self._is_output
        if event_id == ROOT_EVENT_ID or not is_output(event):
            self._dispatch_event(run, event_id, event)
            return
        if self._is_error is not None and self._is_error(event):
            run.errors.append(event)
        if live:
            task_id, _, index = event_id.rpartition(".")
            out = Output(
                id=f"{run.key}:{run.seq}:{task_id}:{index}",
                key=run.key,
                seq=run.seq,
                task_id=task_id,
                index=int(index),
                event=event,
            )
            self.outputs.append(out)
            self._delta.outputs[out.id] = out

    def _dispatch_event(self, run: Run, event_id: str, event: Any) -> None:
        if len(event_id) > MAX_TASK_ID:
            digest = hashlib.blake2b(event_id.encode(), digest_size=12).hexdigest()
            event_id = f"~{digest}"
        listeners = run.listeners or self._listeners
        for action_name in listeners(event):
            if run.next_dispatch - run.base_dispatch >= self.max_tasks_per_run:
                run.dropped += 1
                continue
            task_id = f"{event_id}>{action_name}"
            entry = run.replay.pop(task_id, None) if run.replay else None
            if entry is None and self._known is not None and action_name not in self._known:
                # A run of an earlier agent version reached an action this version removed.
                # Its journal is a prefix of its dispatches, so nothing journaled follows: no
                # recorded index moves by leaving the task out.
                run.retired += 1
                continue
            index = run.next_dispatch
            run.next_dispatch += 1
            task = Task(run, task_id, action_name, event, index, run.stm, run.sensory)
            run.fifo.append(task)
            if entry is not None:
                if entry.dispatch_index != index:
                    raise NonDeterminismError(
                        f"replay of key {run.key!r} input {run.seq}: task {task_id} was "
                        f"dispatched at index {entry.dispatch_index}, now at {index}; the agent's "
                        f"actions or their events changed since the checkpoint"
                    )
                task.replayed = True
                task.state = FINISHED
                task.result = TaskResult(
                    list(entry.stm_ops), list(entry.sensory_ops), list(entry.events)
                )
                run.skipped += 1
                self.tasks_replayed += 1
            else:
                run.executed += 1
                run.pending += 1
                self.tasks_executed += 1
                self.dispatched.append(task)

    # -- runs -----------------------------------------------------------------------------

    def _fill_slots(self) -> None:
        ready = self._ready
        while ready and self.active_runs < self.max_concurrent_runs:
            key = ready.popleft()
            ks = self.keys[key]
            if ks.run is None and ks.queue:
                self._start_run(key, ks, base=ks.next_dispatch, journal=None)

    def _start_run(
        self,
        key: Any,
        ks: KeyState,
        base: int,
        journal: list[JournalEntry] | None,
        pinned: RestoredRun | None = None,
    ) -> None:
        if not journal and ks.version < self.memory_version and self._migrate is not None:
            # Before anything of the run exists: a migration that raises leaves no trace.
            ks.memory = self._migrate(key, ks.memory, ks.version)
            ks.version = self.memory_version
            self._delta.keys[key] = (ks.memory, ks.next_dispatch, ks.version)
        seq, event = ks.queue[0]
        memory = ks.memory
        run = Run(key, seq, event, base, base, memory)
        started = None
        if journal:
            notes = {e.task_id: e for e in journal if e.task_id[:1] == "!"}
            started = notes.pop(START_NOTE, None)
            run.notes = notes
        if (
            self._expire is not None
            and self._now is not None
            and (started is not None or memory.get(EXPIRES))
        ):
            # Memory that expired before the run started is gone for it. The time is recorded
            # (when anything could expire) so a replay drops exactly what the run did not see.
            now = started.events[0] if started is not None else self._now()
            view = self._expire(memory, now)
            if view is not None:
                run.stm = view
                run.started_at = now
                run.journal.append(JournalEntry(START_NOTE, -1, (), (), (now,)))
        run.memory_version = ks.version
        if pinned is not None:
            run.listeners, run.is_output = pinned.listeners, pinned.is_output
        if journal:
            tasks = [e for e in journal if e.task_id[:1] != "!"]
            run.replay = {e.task_id: e for e in tasks} if tasks else None
        ks.run = run
        self.active_runs += 1
        self._dirty_runs.add(seq)
        self._deliver(run, ROOT_EVENT_ID, event)
        if run.replay is not None or not run.fifo:
            self._drain(run)
        if run.notes:
            leftover = sorted(run.notes)
            raise NonDeterminismError(
                f"replay of key {key!r} input {seq}: the journal records {leftover}, which the "
                f"replayed run did not reach; the agent's actions changed since the checkpoint"
            )
        if ks.run is run and (run.pending or run.timers):
            self._settle_parking(run)

    def _complete(self, run: Run) -> None:
        if run.parked:  # a run completes from a fire or a finish: it holds its slot again
            run.parked = False
            self.active_runs += 1
            self.parked_runs -= 1
        if run.replay:
            missing = sorted(run.replay)
            raise NonDeterminismError(
                f"replay of key {run.key!r} input {run.seq} finished without reaching journaled "
                f"task(s) {missing}; the agent's actions changed since the checkpoint"
            )
        ks = self.keys[run.key]
        if ks.run is not run:
            raise InternalError(f"run {run.seq} of key {run.key!r} completed twice")
        if run.dropped and self._budget_output is not None:
            event = self._budget_output(run.key, run.seq, run.dropped)
            out = Output(
                id=f"{run.key}:{run.seq}:{BUDGET_TASK_ID}:0",
                key=run.key,
                seq=run.seq,
                task_id=BUDGET_TASK_ID,
                index=0,
                event=event,
            )
            self.outputs.append(out)
            self._delta.outputs[out.id] = out
        ks.queue.popleft()
        ks.run = None
        ks.memory = run.stm
        ks.next_dispatch = run.next_dispatch
        self.active_runs -= 1
        self.buffered_inputs -= 1
        self.completed.append(run)
        d = self._delta
        describe = self.describe_event
        if describe is not None:
            pack = self.pack_trace
            steps: list[dict[str, Any]] | bytes
            if pack is None:
                steps = trace_dicts(run.trace, describe)
            else:
                steps = pack(run.started_at, run.trace)
            run.trace = []
            d.traces[run.seq] = (run.key, bool(run.errors), run.started_at, steps)
        if run.errors:
            self.runs_failed += 1
            trace = [e.task_id for e in run.journal if e.task_id[:1] != "!"]
            d.failed[run.seq] = (run.key, run.input_event, list(run.errors), trace)
        d.keys[run.key] = (ks.memory, ks.next_dispatch, ks.version)
        for entry in run.journal if self.collect_ltm else ():
            for op in entry.stm_ops:
                if op[0] == LTM_ADD or op[0] == LTM_DELETE:
                    d.ltm.append(op)
                    self.ltm_done.append(op)
        self._dirty_runs.discard(run.seq)
        d.completed.add(run.seq)
        if d.new_inputs.pop(run.seq, None) is None:
            d.done_inputs.add(run.seq)
        if ks.queue:
            self._ready.append(run.key)
        self._fill_slots()

    # -- checkpoints ----------------------------------------------------------------------

    def capture(self) -> Delta:
        """The synchronous part of a checkpoint: a consistent delta, no waiting on any task."""
        d = self._delta
        self._delta = Delta()
        dirty, self._dirty_runs = self._dirty_runs, set()
        if dirty:
            for ks in self.keys.values():
                run = ks.run
                if run is not None and run.seq in dirty:
                    d.runs[run.seq] = RestoredRun(
                        run.key,
                        run.seq,
                        run.input_event,
                        run.base_dispatch,
                        list(run.journal),
                        run.listeners,
                        run.is_output,
                    )
        return d

    def redrive(self, dead_letter: int, key: Any, seq: int, input_event: Any) -> None:
        """Admit a dead letter's input again; the checkpoint that holds it marks it redriven."""
        self._delta.redriven[dead_letter] = seq
        self.admit(key, seq, input_event)

    def take_timers(self) -> list[tuple[Run, str, float]]:
        """Delayed events to deliver at their due time (`fire`), scheduled since last asked."""
        timers, self.timers = self.timers, []
        return timers

    def take_effects(self) -> tuple[list[Task], list[Output], list[Run]]:
        dispatched, outputs, completed = self.dispatched, self.outputs, self.completed
        if dispatched:
            self.dispatched = []
        if outputs:
            self.outputs = []
        if completed:
            self.completed = []
        return dispatched, outputs, completed

    def idle(self) -> bool:
        return self.active_runs == 0 and self.buffered_inputs == 0

    def in_flight(self) -> list[Run]:
        return [ks.run for ks in self.keys.values() if ks.run is not None]

    # -- per-key state (engines that keep state per key, like Flink's keyed state) ---------

    def load_key(
        self,
        key: Any,
        memory: dict[str, Any],
        next_dispatch: int,
        run: RestoredRun | None,
        queued: Iterable[tuple[int, Any]],
    ) -> None:
        """Load one key's stored state into a machine that may hold other keys.

        Like `restore` for one key: its in-flight run (if any) starts first and replays its
        journal; its queued inputs follow in seq order. The key must not be loaded already.
        """
        if key in self.keys:
            raise InternalError(f"load_key({key!r}): the key is already loaded")
        ks = self.keys[key] = KeyState(
            memory=memory, next_dispatch=next_dispatch, version=self.memory_version
        )
        items = sorted(queued, key=lambda q: q[0])
        if run is not None:
            if run.key != key:
                raise InternalError(f"load_key({key!r}): its run belongs to key {run.key!r}")
            ks.queue.append((run.seq, run.input_event))
            self.buffered_inputs += 1
        for seq, event in items:
            if run is not None and seq <= run.seq:
                if seq == run.seq:
                    continue
                raise InternalError(
                    f"load_key({key!r}): queued input {seq} is older than its in-flight run "
                    f"{run.seq}"
                )
            ks.queue.append((seq, event))
            self.buffered_inputs += 1
        if run is not None:
            # A restored run held a slot when its state was saved: it starts past the cap.
            self._start_run(key, ks, base=run.base_dispatch, journal=run.journal, pinned=run)
        elif ks.queue:
            self._ready.append(key)
            self._fill_slots()

    def key_snapshot(self, key: Any) -> tuple[dict[str, Any], int, RestoredRun | None]:
        """One key's committed memory, dispatch counter and in-flight run (with its journal)."""
        ks = self.keys[key]
        run = ks.run
        restored = None
        if run is not None:
            restored = RestoredRun(
                run.key, run.seq, run.input_event, run.base_dispatch, list(run.journal)
            )
        return ks.memory, ks.next_dispatch, restored

    def evict_key(self, key: Any) -> bool:
        """Drop an idle key (no run, nothing queued) whose state the engine has stored."""
        ks = self.keys.get(key)
        if ks is None or ks.run is not None or ks.queue:
            return False
        del self.keys[key]
        return True

    def discard_changes(self) -> None:
        """Forget the change tracking kept for `capture` (for engines that never call it)."""
        self._delta = Delta()
        self._dirty_runs.clear()


def trace_dicts(steps: list[TraceStep], describe: Callable[[Any], str]) -> list[dict[str, Any]]:
    """A run's trace steps as the dicts a stored trace holds (`ratchet trace`, OpenTelemetry):
    what each task did, and how it ran (its start and duration when it was timed)."""
    out = []
    for task_id, action, index, event, replayed, res in steps:
        step: dict[str, Any] = {
            "task": task_id,
            "action": action,
            "index": index,
            "on": describe(event),
            "replayed": replayed,
            "memory": memory_trace(res.stm_ops),
            "events": [describe(e) for e in res.events],
        }
        if res.started is not None:
            step["started"] = res.started
            step["duration"] = res.duration
        if res.trace:
            step.update(res.trace)
        out.append(step)
    return out


def memory_trace(ops: list[tuple[Any, ...]]) -> list[list[Any]]:
    """A task's memory ops as its trace step shows them (values cut short)."""
    return [[op[0], op[1], *([_short(op[2])] if len(op) > 2 else [])] for op in ops]


def _short(value: Any, limit: int = 200) -> Any:
    """A memory value as a trace shows it: plain and small values as they are, others cut."""
    if value is None or type(value) in (bool, int, float):
        return value
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
