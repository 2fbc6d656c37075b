"""The PyFlink functions: line parsing and the keyed agent operator around `AgentCore`."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from pyflink.common import Row, Types
from pyflink.datastream import KeyedProcessFunction, OutputTag, ProcessFunction, RuntimeContext
from pyflink.datastream.functions import TimeDomain
from pyflink.datastream.state import MapState, MapStateDescriptor, ValueStateDescriptor

from ratchet._clock import Clock
from ratchet._errors import BadInputError, ConfigError
from ratchet.agents._context import AgentBinding
from ratchet.flink._watchdog import start_parent_watchdog
from ratchet.runtime._flink_core import AgentCore, CoreConfig, Step, flink_key, native_key
from ratchet.runtime._flink_keygroups import WAKE_PREFIX, key_group, key_group_range, wake_key
from ratchet.runtime._flink_savepoint import PROCESS_STATES, THREAD_STATES
from ratchet.runtime._io import _parse
from ratchet.runtime._journal import encode_memory
from ratchet.runtime._metrics import Metrics

log = logging.getLogger("ratchet.flink")


# Event-time timers at this timestamp fire only at the end of a bounded input (the source's
# final watermark); the operator then waits until the key's runs are done.
END_OF_INPUT = (1 << 63) - 2

# The wake registries' heartbeat period (see `AgentFunction._sweep`).
HEARTBEAT_MS = 1000

# Thread mode: how often the task copies ratchet's metrics into Flink's counters (see
# `_Published`); a callback that finds the copy not yet due sets a timer this far ahead.
PUBLISH_MS = 200

MEMORY_TAG = OutputTag("ratchet-memory", Types.STRING())
"""Side output of `apply_agent(..., emit_memory=True)`: one JSON line per key at end of input,
`{"key": ..., "memory": "<base64 of the codec-encoded memory>", "inputs": N}` (N: how many
inputs the key had admitted; decode with `ratchet.flink.decode_memory_line`, or read a whole
folder with `ratchet.flink.latest_memories`)."""

PROGRESS_TAG = OutputTag("ratchet-progress", Types.STRING())
"""Side output of `apply_agent(..., emit_progress=True)`: one JSON line per finished run,
`{"key": ..., "seq": ...}`. Written through an exactly-once sink, its committed lines say how
many inputs are done for good: `ratchet flink run` stops a job whose every input is done."""

_BYTES = Types.PRIMITIVE_ARRAY(Types.BYTE())


BAD_INPUT_TAG = OutputTag("ratchet-bad-input", Types.STRING())
"""Side output of `ParseLines` with `on_bad_input="dead-letter"`: one JSON line per bad input
line, `{"error": ..., "line": <its text>}` (`ratchet flink run` writes it to OUTPUT/_bad-input)."""

BAD_INPUT_MARK = "ratchet bad input:"


def agent_core(
    agent: Any,
    core_config: CoreConfig,
    agent_config: dict[str, Any] | None = None,
    journal: Any = None,
) -> tuple[AgentBinding, AgentCore]:
    """A worker's binding and core for `agent`, not started: building it checks the agent as the worker
    does (actions, memory_version, retry=), so `ratchet flink run` calls it before it submits
    (a refused agent fails every restart of the job, and the reason gets lost on the way)."""
    binding = AgentBinding(agent, agent_config)
    return binding, AgentCore(binding, core_config, journal=journal)


class ParseLines(ProcessFunction):
    """JSON Lines to `(flink key, line)` with the embedded engine's parser and messages.

    A bad line (not JSON, not an object, no key field, a key that is neither a string nor an
    integer) follows `on_bad_input` as on the embedded engine: "stop" fails the job with a
    `BadInputError` (`ratchet flink run` refuses a bounded input with a bad line before it
    submits anything, exit 3; this catches lines that arrive later), "skip" logs and drops it,
    "dead-letter" keeps it in the `BAD_INPUT_TAG` side output."""

    def __init__(
        self, key_field: str, on_bad_input: str = "stop", source: str | None = None
    ) -> None:
        if on_bad_input not in ("stop", "skip", "dead-letter"):
            raise ConfigError(
                f"on_bad_input must be 'stop', 'skip' or 'dead-letter', not {on_bad_input!r}"
            )
        self.key_field = key_field
        self.on_bad_input = on_bad_input
        self.source = source  # the file or folder read: a message names it

    def open(self, runtime_context: RuntimeContext) -> None:
        start_parent_watchdog()

    def process_element(self, value: str, ctx: ProcessFunction.Context) -> Any:
        key, line, error = parse_line(value, self._where(value), self.key_field)
        if error is None:
            if line is not None:
                yield key, line
            return
        if self.on_bad_input == "dead-letter":
            log.warning("bad input kept as a dead letter: %s", error)
            yield BAD_INPUT_TAG, json.dumps({"error": error, "line": value[:65536]})
        elif self.on_bad_input == "skip":
            log.warning("skipping bad input: %s", error)
        else:
            raise BadInputError(
                f"{BAD_INPUT_MARK} {error}; the job stops (--on-bad-input stop): fix the line "
                f"and restore from the last checkpoint, or pass --on-bad-input skip or "
                f"dead-letter"
            )

    def _where(self, value: str) -> str:
        # Flink's text line format gives the line alone, not its file or number: the message
        # names the --input and shows the line's start, for a search to find it.
        shown = value.strip()
        shown = shown[:60] + "..." if len(shown) > 60 else shown
        source = getattr(self, "source", None)  # None: pickled by an older version
        return f"a line of {source} ({shown!r})" if source else f"input line {shown!r}"


def parse_line(
    text: str | bytes, where: str, key_field: str, line: int | None = None
) -> tuple[str, str | None, str | None]:
    """One input line as `(flink key, line, None)`, `("", None, None)` for a blank line, or
    `("", None, error)`: the embedded engine's parse (`runtime/_io.py`) and messages. `where`
    is the file and `line` its line number; a line read by the job has no number (None).
    Bytes are parsed as they are (bytes that are not UTF-8: invalid JSON, as embedded)."""
    raw = text if isinstance(text, bytes) else text.encode()
    rec = _parse(raw, 0 if line is None else line, where, key_field)
    if rec is None:
        return "", None, None
    if rec.error is not None:
        if line is None:  # `_parse` says "<where>:<line>: ..."; without a number, "<where>: ..."
            return "", None, where + rec.error[len(where) + 2 :]
        return "", None, rec.error
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")  # parsed as JSON: UTF-8 (or -16/-32)
    try:
        return flink_key(rec.key), text.strip(), None
    except ConfigError as exc:
        at = where if line is None else f"{where}:{line}"
        return "", None, f"{at}: {exc}"


class _State:
    """`KeyStore` over the function's keyed state in process mode (the current key is set by
    Flink): byte-array values, the layout savepoints of earlier versions hold."""

    def __init__(self, rc: RuntimeContext) -> None:
        self.key = rc.get_state(ValueStateDescriptor(PROCESS_STATES[0], _BYTES))
        self.inputs_st = rc.get_map_state(
            MapStateDescriptor(PROCESS_STATES[1], Types.LONG(), _BYTES)
        )
        self.run = rc.get_state(ValueStateDescriptor(PROCESS_STATES[2], _BYTES))
        self.calls_st = rc.get_map_state(
            MapStateDescriptor(PROCESS_STATES[3], Types.STRING(), _BYTES)
        )

    def get_key(self) -> bytes | None:
        v = self.key.value()
        return None if v is None else bytes(v)

    def put_key(self, value: bytes) -> None:
        self.key.update(value)

    def inputs(self) -> list[tuple[int, bytes]]:
        return [(int(k), bytes(v)) for k, v in self.inputs_st.items()]

    def put_input(self, seq: int, value: bytes) -> None:
        self.inputs_st.put(seq, value)

    def remove_input(self, seq: int) -> None:
        self.inputs_st.remove(seq)

    def get_run(self) -> bytes | None:
        v = self.run.value()
        return None if v is None else bytes(v)

    def put_run(self, value: bytes) -> None:
        self.run.update(value)

    def clear_run(self) -> None:
        self.run.clear()

    def calls(self) -> list[bytes]:
        return [bytes(v) for v in self.calls_st.values()]

    def put_call(self, name: str, value: bytes) -> None:
        self.calls_st.put(name, value)

    def clear_calls(self) -> None:
        self.calls_st.clear()


class _TextState:
    """`KeyStore` over STRING keyed state, for thread mode: each value is the latin-1 text of
    its bytes (one character per byte, so the round trip is exact).

    PyFlink 2.3's thread mode (Pemja) converts a byte-array state value element by element,
    to a tuple of ints, and fails on an empty one; a STRING crosses as a Java String. Other
    names than process mode's: a job restores in the mode it ran in (docs/flink.md)."""

    def __init__(self, rc: RuntimeContext) -> None:
        s = Types.STRING()
        self.key = rc.get_state(ValueStateDescriptor(THREAD_STATES[0], s))
        self.inputs_st = rc.get_map_state(MapStateDescriptor(THREAD_STATES[1], Types.LONG(), s))
        self.run = rc.get_state(ValueStateDescriptor(THREAD_STATES[2], s))
        self.calls_st = rc.get_map_state(MapStateDescriptor(THREAD_STATES[3], s, s))

    def get_key(self) -> bytes | None:
        v = self.key.value()
        return None if v is None else v.encode("latin-1")

    def put_key(self, value: bytes) -> None:
        self.key.update(value.decode("latin-1"))

    def inputs(self) -> list[tuple[int, bytes]]:
        return [(int(k), v.encode("latin-1")) for k, v in self.inputs_st.items()]

    def put_input(self, seq: int, value: bytes) -> None:
        self.inputs_st.put(seq, value.decode("latin-1"))

    def remove_input(self, seq: int) -> None:
        self.inputs_st.remove(seq)

    def get_run(self) -> bytes | None:
        v = self.run.value()
        return None if v is None else v.encode("latin-1")

    def put_run(self, value: bytes) -> None:
        self.run.update(value.decode("latin-1"))

    def clear_run(self) -> None:
        self.run.clear()

    def calls(self) -> list[bytes]:
        return [v.encode("latin-1") for v in self.calls_st.values()]

    def put_call(self, name: str, value: bytes) -> None:
        self.calls_st.put(name, value.decode("latin-1"))

    def clear_calls(self) -> None:
        self.calls_st.clear()


def thread_mode(rc: RuntimeContext) -> bool:
    """Whether this function runs embedded in the JVM (PyFlink's thread mode, Pemja)."""
    return ".embedded." in type(rc).__module__


def _thread_mode_task_info(rc: RuntimeContext) -> tuple[int, int, int]:
    """(max parallelism, parallelism, subtask index) in thread mode. PyFlink 2.3's thread-mode
    `RuntimeContext` calls Java methods Flink 2 removed (`getMaxNumberOfParallelSubtasks`:
    an AttributeError), so ask the Java context's `TaskInfo`."""
    info = rc._runtime_context.getTaskInfo()
    return (
        int(info.getMaxNumberOfParallelSubtasks()),
        int(info.getNumberOfParallelSubtasks()),
        int(info.getIndexOfThisSubtask()),
    )


def _whole_total(counters: Metrics, name: str) -> int:
    return round(counters.total(name))


class _Published:
    """Thread mode's metrics: Flink metrics held in the JVM that the task's own thread brings
    up to the values of ratchet's (at most every `PUBLISH_MS`, and when the function closes).

    Not gauges over Python callables, as in process mode: in thread mode Flink reads a gauge
    on its metrics thread by entering the embedded interpreter with the task thread's Python
    thread state (Pemja). A read that waited for the GIL while the task closed its interpreter
    woke on a freed thread state, and the TaskManager's JVM crashed (SIGSEGV in `take_gil`) when
    a job was cancelled while its metrics were being read.

    A value that only grows is a Flink counter (`inc` by the difference). A level (runs in
    flight, queued inputs) is a gauge whose value lives in the JVM: thread mode's
    `metric_group.distribution(name)` is one (flink-python's `MetricDistribution`, a
    `Gauge<Long>` whose `update` sets the value), read by Flink without entering Python."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._metrics: list[list[Any]] = []  # [Flink metric, read, value it shows, level]
        self.next_at = 0.0  # clock.monotonic() when the next copy is due
        self.timer_set = False  # a timer will call back by then

    def add(self, group: Any, name: str, read: Callable[[], float], level: bool = False) -> None:
        if level:  # its value starts at 0, as a counter's does
            self._metrics.append([group.distribution(name), read, 0, True])
        else:
            self._metrics.append([group.counter(name), read, 0, False])

    def changed(self) -> bool:
        return any(round(m[1]()) != m[2] for m in self._metrics)

    def publish(self) -> None:
        for m in self._metrics:
            value = round(m[1]())
            if value != m[2]:
                if m[3]:
                    m[0].update(value)
                else:
                    m[0].inc(value - m[2])
                m[2] = value
        self.next_at = self.clock.monotonic() + PUBLISH_MS / 1000
        self.timer_set = False

    def publish_if_due(self) -> bool:
        """Copy the values if `PUBLISH_MS` passed since the last copy; whether it did."""
        if self.clock.monotonic() < self.next_at:
            return False
        self.publish()
        return True


class AgentFunction(KeyedProcessFunction):
    """Runs a ratchet agent per key: the same run machine as the embedded engine.

    `agent` is a `module:Class` / `file.py:Class` spec or an Agent instance (shipped to the
    Python workers with the job). `json_pairs`: elements are `(key, json_line)` from
    `ParseLines`; otherwise each element is the input value itself.
    """

    def __init__(
        self,
        agent: Any,
        core_config: CoreConfig,
        agent_config: dict[str, Any] | None = None,
        json_pairs: bool = False,
        emit_memory: bool = False,
        emit_progress: bool = False,
        journal: tuple[str, str] | None = None,
        emit_admissions: bool = False,
    ) -> None:
        self.agent = agent
        self.journal = journal  # (PostgreSQL URI, namespace) of the external call journal
        self.core_config = core_config
        self.agent_config = agent_config
        self.json_pairs = json_pairs
        self.emit_memory = emit_memory
        self.emit_progress = emit_progress
        self.emit_admissions = emit_admissions
        self.core: AgentCore | None = None
        self._published: _Published | None = None
        self._metrics_key: str | None = None

    def open(self, runtime_context: RuntimeContext) -> None:
        from ratchet.agents._run import load_agent

        start_parent_watchdog()
        agent = load_agent(self.agent) if isinstance(self.agent, str) else self.agent
        journal = None
        if self.journal is not None:
            from ratchet.connectors._pg_journal import PostgresCallJournal

            journal = PostgresCallJournal(*self.journal)
        binding, self.core = agent_core(agent, self.core_config, self.agent_config, journal)
        self._counters = binding.metrics  # `ctx.metrics`, exported by `_export_counters`
        self.core.open()
        self._thread = thread_mode(runtime_context)
        self.state: _State | _TextState = (
            _TextState(runtime_context) if self._thread else _State(runtime_context)
        )
        # PyFlink's keyed state backend of this worker: a callback may apply another key's
        # finished tasks by making that key current (its state and timers), then back.
        self._backend = getattr(runtime_context, "_keyed_state_backend", None)
        self._set_key = self._key_setter()
        self._metrics(runtime_context)
        # Thread mode's metrics timer is set on a reserved key of this subtask's first key
        # group, so it calls no agent key back (on a key with work, each extra callback would
        # start another chain of poll timers).
        if self._thread and self._set_key is not None:
            try:
                max_par, parallelism, index = _thread_mode_task_info(runtime_context)
            except Exception:  # noqa: BLE001 - the metrics timer then calls the current key
                log.warning("no task info in thread mode; metrics timers use agent keys")
            else:
                first = key_group_range(max_par, parallelism, index)[0]
                self._metrics_key = wake_key(first, max_par)
        # The wake registries (process mode only; see `_sweep`): this subtask's key groups.
        self._wake: MapState | None = None
        self._swept = False
        self._groups: range = range(0)
        self._max_par = 0
        if not self._thread and self._set_key is not None:
            self._max_par = runtime_context.get_max_number_of_parallel_subtasks()
            self._groups = key_group_range(
                self._max_par,
                runtime_context.get_number_of_parallel_subtasks(),
                runtime_context.get_index_of_this_subtask(),
            )
            self._wake = runtime_context.get_map_state(
                MapStateDescriptor(PROCESS_STATES[4], Types.STRING(), Types.BOOLEAN())
            )

    def _metrics(self, rc: RuntimeContext) -> None:
        core = self.core
        assert core is not None
        group = rc.get_metrics_group().add_group("ratchet")
        self._group = group
        # Every metric is kept as a Python value, so an input costs no call into the JVM for
        # it (a thread-mode counter's `inc` is one, ~1.8 us): process mode shows each as a
        # gauge, thread mode copies them into Flink counters and JVM-held gauges from time to
        # time (`_Published`).
        # `inputs` and `outputs` only grow, and start at 0 in a restarted task, as counters do.
        self._published = _Published(core.clock) if self._thread else None
        self._n_inputs = 0
        self._n_outputs = 0
        self._metric(group, "inputs", lambda: self._n_inputs)
        self._metric(group, "outputs", lambda: self._n_outputs)
        self._metric(group, "runs_in_flight", lambda: core.machine.active_runs, level=True)
        self._metric(group, "queued_inputs", lambda: core.machine.buffered_inputs, level=True)
        self._metric(group, "tasks_executed", lambda: core.tasks_executed)
        self._metric(group, "tasks_replayed", lambda: core.machine.tasks_replayed)
        self._exported: set[str] = set()
        self._export_counters()

    def _metric(
        self, group: Any, name: str, read: Callable[[], float], level: bool = False
    ) -> None:
        if self._published is not None:
            self._published.add(group, name, read, level)
        else:
            group.gauge(name, read)

    def _after_callback(self, ctx: Any) -> None:
        """After each callback: new `ctx.metrics` names, and in thread mode the copy of the
        metrics when it is due; when it is not, a timer makes sure one comes (a stream that
        goes quiet still shows its last inputs)."""
        self._export_counters()
        pub = self._published
        if pub is None or pub.publish_if_due():
            return
        if not pub.timer_set and pub.changed():
            ts = ctx.timer_service()
            at = ts.current_processing_time() + PUBLISH_MS
            if self._metrics_key is not None and self._set_key is not None:
                current = ctx.get_current_key()
                self._set_key(self._metrics_key)
                ts.register_processing_time_timer(at)
                self._set_key(current)
            else:
                ts.register_processing_time_timer(at)
            pub.timer_set = True

    def _export_counters(self) -> None:
        """Each `ctx.metrics` counter (`durable_calls.made`, `durable_calls.replayed`, an
        action's own) as the metric `ratchet.counter.<name>.total`, registered the first time
        its name has a value; called after every callback (Flink's Prometheus reporter:
        `..._ratchet_counter_total` with the label `counter="<name>"`)."""
        counters = self._counters
        if counters.count() == len(self._exported):
            return  # no new name: one compare per callback
        for name in counters.totals():
            if name not in self._exported:
                self._exported.add(name)
                # Whole numbers: process mode's Beam gauge is an int64, thread mode's copy a
                # Flink counter (a Long).
                self._metric(
                    self._group.add_group("counter", name),
                    "total",
                    functools.partial(_whole_total, counters, name),
                )

    def close(self) -> None:
        if self._published is not None:
            try:
                self._published.publish()  # the final values (the task's thread: safe)
            except Exception:  # noqa: BLE001 - metrics must not keep the core from closing
                log.warning("could not update the metrics at close", exc_info=True)
        if self.core is not None:
            self.core.close()
            if self.core.journal is not None:
                self.core.journal.close()

    def process_element(self, value: Any, ctx: KeyedProcessFunction.Context) -> Any:
        assert self.core is not None
        fkey = ctx.get_current_key()
        if not self._swept:
            yield from self._sweep(ctx, fkey)
        key = native_key(fkey)
        if self.json_pairs:
            value = json.loads(value[1])
        step = self.core.element(key, value, self.state)
        self._n_inputs += 1
        if self.emit_admissions:
            yield PROGRESS_TAG, json.dumps({"key": key, "seq": step.admitted, "in": 1})
        self._timers(ctx, key, step, register_end=self.emit_memory)
        self._update_wake(fkey, step)
        yield from self._emit(key, step)
        self._after_callback(ctx)  # last: the callback's outputs are counted

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> Any:
        assert self.core is not None
        fkey = ctx.get_current_key()
        if not self._swept:
            yield from self._sweep(ctx, fkey)
        if fkey.startswith(WAKE_PREFIX):
            if self._groups and fkey == wake_key(self._groups[0], self._max_par):
                self._heartbeat(ctx)
            self._after_callback(ctx)  # thread mode's metrics timer is on such a key too
            return  # a wake registry's own timer (a rescaled job's old one is let go)
        key = native_key(fkey)
        end = ctx.time_domain() == TimeDomain.EVENT_TIME and timestamp >= END_OF_INPUT
        if end and self._set_key is not None:
            # End of a bounded input: every key of this worker drains at once (not one key
            # per end timer), then this key's own state is current again.
            step = self.core.timer(key, self.state)
            yield from self._emit(key, step)
            for other, st in self.core.drain(self._switch):
                self._timers(ctx, other, st, register_end=False)
                self._update_wake(flink_key(other), st)
                yield from self._emit(other, st)
                if self._published is not None:  # a drain can be long: the metrics follow
                    self._published.publish_if_due()
            self._switch(key)
            step = self.core.timer(key, self.state, end=True)
        else:
            step = self.core.timer(key, self.state, end=end)
        if not end:
            self._timers(ctx, key, step, register_end=False)
        self._update_wake(fkey, step)
        yield from self._emit(key, step)
        if end and self.emit_memory:
            import base64

            memory = self.core.memory(key, self.state)
            if memory is not None:
                rec = {"key": key, "memory": base64.b64encode(encode_memory(memory)).decode()}
                admitted = self.core.admitted(key)
                if admitted is not None:  # which of a key's records is the latest
                    rec["inputs"] = admitted
                yield MEMORY_TAG, json.dumps(rec)
        self._after_callback(ctx)  # last: the outputs counted, a counter an async task added

    # -- the wake registries (process mode) -----------------------------------------------
    #
    # In process mode PyFlink registers the timers a bundle of callbacks asks for through the
    # task's mailbox, after that bundle; a checkpoint barrier finishes the open bundle and
    # snapshots at once, so the checkpoint holds the bundle's state writes but not its timer
    # registrations (flink-python 2.3: `prepareSnapshotPreBarrier` finishes the bundle, and
    # only a watermark drains the registrations still queued). A key whose work started in
    # that bundle is restored with work and no timer: nothing would ever call it again. So
    # each key with work is also listed, in the same callback, in its key group's registry
    # (keyed state under a reserved key of that group, so it is in the same checkpoint), and
    # a new worker's first callback reads the registries of its key groups and calls every
    # listed key it has not seen (`_sweep`), which registers its timers anew. A per-subtask
    # heartbeat timer, renewed a second ahead of the one in flight, makes sure a callback
    # comes after a restore even if no input does. Thread mode registers timers at once.

    def _update_wake(self, fkey: str, step: Step) -> None:
        if self._wake is None or not step.wake or self._set_key is None:
            return
        self._set_key(wake_key(key_group(fkey, self._max_par), self._max_par))
        if step.wake > 0:
            self._wake.put(fkey, True)
        else:
            self._wake.remove(fkey)
        self._set_key(fkey)

    def _sweep(self, ctx: Any, current: str) -> Any:
        """Once per worker, at its first callback: call every key the registries of this
        subtask's key groups list and this worker has not loaded (after a restore: keys that
        may have work and no timer); their timers are registered as at any callback."""
        self._swept = True
        if self._wake is None or self._set_key is None:
            return
        assert self.core is not None
        for group in self._groups:
            wkey = wake_key(group, self._max_par)
            self._set_key(wkey)
            for fkey in list(self._wake.keys()):
                key = native_key(fkey)
                if self.core.loaded(key):
                    continue
                self._set_key(fkey)
                step = self.core.timer(key, self.state)
                self._timers(ctx, key, step, register_end=self.emit_memory)
                self._update_wake(fkey, step)
                yield from self._emit(key, step)
        self._set_key(wake_key(self._groups[0], self._max_par))
        self._heartbeat(ctx)
        self._set_key(current)

    def _heartbeat(self, ctx: Any) -> None:
        """This subtask's heartbeat (its first group's wake key current): two timers, one and
        two seconds ahead, so a checkpoint always holds one registered a callback earlier."""
        ts = ctx.timer_service()
        second = ts.current_processing_time() // 1000 * 1000
        ts.register_processing_time_timer(second + HEARTBEAT_MS)
        ts.register_processing_time_timer(second + 2 * HEARTBEAT_MS)

    def _emit(self, key: Any, step: Step) -> Any:
        if step.outputs:
            self._n_outputs += len(step.outputs)
            yield from step.outputs
        if self.emit_progress:
            for seq in step.completed:
                yield PROGRESS_TAG, json.dumps({"key": key, "seq": seq})

    def _key_setter(self) -> Any:
        """How this worker makes a Flink key current: process mode's Python backend takes a
        Row; thread mode's (Pemja) wraps the JVM's backend, whose keys are `Row(key)` too
        (PyFlink's `KeyByKeySelector`), set there directly."""
        backend = self._backend
        if backend is None:
            return None
        if not self._thread:
            return lambda fkey: backend.set_current_key(Row(fkey))
        from pemja import findClass  # type: ignore[import-not-found]

        jrow = findClass("org.apache.flink.types.Row")
        jbackend = backend._keyed_state_backend

        def set_key(fkey: str) -> None:
            row = jrow(1)
            row.setField(0, fkey)
            jbackend.setCurrentKey(row)

        return set_key

    def _switch(self, key: Any) -> _State | _TextState:
        assert self._set_key is not None
        self._set_key(flink_key(key))
        return self.state

    def _timers(self, ctx: Any, key: Any, step: Step, register_end: bool) -> None:
        ts = ctx.timer_service()
        if step.poll_ms is not None:
            now = ts.current_processing_time()
            ts.register_processing_time_timer(now + step.poll_ms)
        if step.active or register_end:
            ts.register_event_time_timer(END_OF_INPUT)
