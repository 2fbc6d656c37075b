"""The Flink engine's core without PyFlink: parity with the embedded engine, and recovery from a
keyed-state snapshot (a Flink checkpoint) with no journaled task or returned call repeated."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratchet import Agent, Event, InputEvent, InternalError, OutputEvent, StateError, action
from ratchet.runtime._flink_core import MemoryKeyedState
from support.chat_agents import Asker
from support.engines import FlinkSim, per_key, run_embedded, run_flink_core, store_memory


class Split(Event):
    event_name = "coretest.Split"
    value: int


class Joined(Event):
    event_name = "coretest.Joined"
    value: int
    by: str


def price(value: int) -> int:
    return value * 3 + 1


class Scenario(Agent):
    """Every dispatch mode: a thread root, an async and a thread child of one event (the async
    one slower, so FIFO commit holds the other back), an inline leaf, bytes in memory."""

    @action(InputEvent)
    def root(self, event: InputEvent, ctx: Any) -> None:
        mem = ctx.short_term_memory
        v = event.input["v"]
        mem.set("count", mem.get("count", 0) + 1)
        mem.set("order", [*mem.get("order", []), v])
        mem.set("blob", bytes([v % 256, 0, 0xFF]))
        ctx.send_event(Split(value=v))

    @action(Split)
    async def slow(self, event: Split, ctx: Any) -> None:
        await asyncio.sleep(0.002)
        ctx.short_term_memory.set("last", "slow")
        ctx.sensory_memory.set("slow", event.value)
        ctx.send_event(Joined(value=event.value, by="slow"))

    @action(Split)
    def fast(self, event: Split, ctx: Any) -> None:
        p = ctx.durable_execute(price, event.value)
        ctx.short_term_memory.set("last", "fast")
        ctx.short_term_memory.set("prices", ctx.short_term_memory.get("prices", 0) + p)
        ctx.send_event(Joined(value=p, by="fast"))

    @action(Joined, inline=True)
    def emit(self, event: Joined, ctx: Any) -> None:
        ctx.send_event(
            OutputEvent(
                output={
                    "by": event.by,
                    "value": event.value,
                    "sensory": ctx.sensory_memory.get("slow"),
                }
            )
        )


@settings(max_examples=15, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 300)), min_size=1, max_size=12
    )
)
def test_the_flink_core_and_the_embedded_engine_agree(inputs: list[tuple[str, int]]) -> None:
    rows = [{"key": k, "v": v} for k, v in inputs]
    want_out, store, _ = run_embedded(Scenario(), rows)
    got_out, got_mem = run_flink_core(Scenario(), rows)
    assert per_key(got_out) == per_key(want_out)
    assert got_mem == store_memory(store)
    assert all(isinstance(m["blob"], bytes) for m in got_mem.values())


class Gate:
    """A test-controlled barrier a tool call blocks on, and a count of real calls per name."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def count(self, name: str) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1


GATE = Gate()


def quote(v: int) -> int:
    GATE.count("quote")
    return v * 10


def blocked_tool(v: int) -> int:
    GATE.count("blocked_tool")
    GATE.open.wait(30)
    return v + 1000


class Blocking(Agent):
    @action(InputEvent)
    async def handle(self, event: InputEvent, ctx: Any) -> None:
        v = event.input["v"]
        q = await ctx.durable_execute_async(quote, v)
        ctx.short_term_memory.set("quotes", [*ctx.short_term_memory.get("quotes", []), q])
        extra = await asyncio.to_thread(ctx.durable_execute, blocked_tool, v)
        ctx.send_event(OutputEvent(output={"v": v, "quote": q, "tool": extra}))


def test_restore_from_a_keyed_state_snapshot_repeats_no_returned_call() -> None:
    GATE.open.clear()
    GATE.calls.clear()
    sim = FlinkSim(Blocking())
    sim.element("k", {"key": "k", "v": 1})
    # Wait (on the core's own condition, not by sleeping) until `quote` returned and its record
    # reached the core, then let a timer callback write it into keyed state.
    deadline = 200
    while GATE.calls.get("blocked_tool", 0) == 0 and deadline:
        with sim.core._cond:
            sim.core._cond.wait(0.05)
        deadline -= 1
    assert GATE.calls == {"quote": 1, "blocked_tool": 1}
    sim.poll()
    checkpoint = sim.state.snapshot()  # what a completed Flink checkpoint holds now
    assert sim.outputs == []
    sim.close()  # the TaskManager is lost; its blocked call is abandoned

    GATE.open.set()
    restored = FlinkSim(Blocking(), MemoryKeyedState())
    restored.state = checkpoint
    restored.end()
    restored.close()
    assert restored.outputs and [o["output"] for o in restored.outputs] == [
        {"v": 1, "quote": 10, "tool": 1001}
    ]
    # quote returned before the snapshot: answered from the journal, not called again; the
    # blocked call had not returned, so it ran again (once).
    assert GATE.calls == {"quote": 1, "blocked_tool": 2}
    assert restored.memory() == {"k": {"quotes": [10]}}


def test_a_key_the_callback_does_not_own_is_an_internal_error() -> None:
    sim = FlinkSim(Scenario())
    try:
        sim.element("a", {"key": "a", "v": 1})
        # Key b's input admitted behind key a's callback: the core must refuse to run it there
        # (it would write b's state into a's keyed state).
        sim.core.machine.admit("b", 0, sim.core.binding.event_from_input({"key": "b", "v": 2}))
        with pytest.raises(InternalError, match="a callback for key 'a' dispatched key 'b'"):
            sim.core.timer("a", sim.state.view("a"), end=True)
    finally:
        sim.close()


class Unwritable(Agent):
    @action(InputEvent, inline=True)
    def go(self, event: InputEvent, ctx: Any) -> None:
        v = event.input["v"]
        ctx.send_event(OutputEvent(output={(v, v): "a tuple key"} if v == 2 else {"v": v}))


def test_an_output_json_cannot_hold_is_an_error_record_on_the_flink_core_too() -> None:
    out, _ = run_flink_core(Unwritable(), [{"key": "k", "v": v} for v in (1, 2, 3)])
    assert [o["output"] for o in out] == [{"v": 1}, None, {"v": 3}]
    assert "has a key (2, 2) of type tuple" in out[1]["error"]["message"]
    assert out[1]["error"]["type"] == "ratchet._errors.CodecError"


def test_damaged_keyed_state_is_a_state_error_naming_the_state_and_key() -> None:
    state = MemoryKeyedState()
    state.view("k").put_key(b"\xc1")
    sim = FlinkSim(Scenario(), state)
    try:
        with pytest.raises(StateError, match=r"the state's ratchet-key row for 'k' cannot be read"):
            sim.element("k", {"key": "k", "v": 1})
    finally:
        sim.close()


def test_a_chat_agent_runs_on_the_flink_core_as_embedded() -> None:
    """Durable calls with `resource=` are plain durable calls on an engine with no durable
    waits (the Flink core): made and recorded, a failure the action's error, no pause."""
    rows = [{"key": f"k{i % 2}", "i": i} for i in range(4)]
    flink_out, _ = run_flink_core(Asker(), rows)
    embedded_out, _, _ = run_embedded(Asker(), rows)
    assert per_key(flink_out) == per_key(embedded_out)
    assert [o.get("output") for o in flink_out] == ["ok"] * 4  # no error records


# -- keys keep their type; max_concurrent_runs; all keys drain at once ---------------------------


def test_integer_and_string_keys_are_distinct_flink_keys() -> None:
    from ratchet import ConfigError
    from ratchet.runtime._flink_core import flink_key, native_key

    assert flink_key(1) != flink_key("1")
    for key in (1, -7, 0, "1", "k", "", "x:1"):
        assert native_key(flink_key(key)) == key
        assert type(native_key(flink_key(key))) is type(key)
    assert flink_key("user-1") == "user-1"  # string keys keep their Flink key (savepoints)
    with pytest.raises(ConfigError, match="starts with a NUL character"):
        flink_key("\x00i:1")
    with pytest.raises(ConfigError, match="keys are strings or integers"):
        flink_key(True)


class _Count(Agent):
    @action(InputEvent, inline=True)
    def count(self, event: InputEvent, ctx: Any) -> None:
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(OutputEvent(output=n))


def test_the_integer_key_1_and_the_string_key_1_stay_two_keys_on_the_flink_core() -> None:
    rows = [{"key": 1}, {"key": "1"}, {"key": 1}, {"key": "1"}, {"key": 1}]
    out, mem = run_flink_core(_Count(), rows)
    assert per_key(out) == {1: [1, 2, 3], "1": [1, 2]}
    assert mem == {1: {"n": 3}, "1": {"n": 2}}
    # Output ids stay unique although inputs are numbered per key on Flink.
    assert len({o["id"] for o in out}) == len(out) == 5
    assert sorted(o["id"] for o in out if o["key"] == 1) == [
        "#1:0:r>count:0",
        "#1:1:r>count:0",
        "#1:2:r>count:0",
    ]


class _Slow(Agent):
    """Each run holds its key for a while; counts the runs in flight at once."""

    lock = threading.Lock()
    running = 0
    peak = 0
    together = 0  # with N, a run waits (up to 10 s) until N runs are in flight at once
    all_in: asyncio.Event | None = None

    @action(InputEvent)
    async def go(self, event: InputEvent, ctx: Any) -> None:
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.peak = max(cls.peak, cls.running)
        if cls.together:
            if cls.all_in is None:
                cls.all_in = asyncio.Event()  # on the core's loop, where every action runs
            if cls.running >= cls.together:
                cls.all_in.set()
            try:
                await asyncio.wait_for(cls.all_in.wait(), 10)
            except TimeoutError:
                pass  # not all keys ran at once: the assertion on `peak` says so
        await asyncio.sleep(0.01)
        with cls.lock:
            cls.running -= 1
        ctx.short_term_memory.set(
            "seen", [*ctx.short_term_memory.get("seen", []), event.input["v"]]
        )
        ctx.send_event(OutputEvent(output=event.input["v"]))


class _Operator:
    """Drives the core as the PyFlink function does: each key is worked on only in its own
    callbacks (an element, or its timer when its step asked for one); the end of input drains
    all keys, each with its own state current."""

    def __init__(self, agent: Agent, **config: Any) -> None:
        from ratchet.agents._context import AgentBinding
        from ratchet.runtime._flink_core import AgentCore, CoreConfig

        self.state = MemoryKeyedState()
        self.core = AgentCore(
            AgentBinding(agent), CoreConfig(poll_min_ms=1, poll_max_ms=4, **config)
        )
        self.core.open()
        self.outputs: list[dict[str, Any]] = []
        self.timers: set[Any] = set()
        self.current: Any = None

    def _switch(self, key: Any) -> Any:
        self.current = key
        return self.state.view(key)

    def _take(self, key: Any, step: Any) -> None:
        import json

        self.outputs += [json.loads(line) for line in step.outputs]
        if step.poll_ms is not None:
            self.timers.add(key)

    def element(self, key: Any, value: Any) -> None:
        self.current = key
        self._take(key, self.core.element(key, value, self.state.view(key)))

    def fire(self) -> None:
        timers, self.timers = self.timers, set()
        for key in timers:
            self.current = key
            self._take(key, self.core.timer(key, self.state.view(key)))

    def end(self) -> None:
        for key, step in self.core.drain(self._switch):
            assert self.current == key  # the key's state is current while it is applied
            self._take(key, step)

    def memory(self) -> dict[Any, Any]:
        return {k: self.core.memory(k, self.state.view(k)) for k in self.state.keys()}


def test_max_concurrent_runs_bounds_runs_in_flight_per_subtask_and_loses_nothing() -> None:
    _Slow.peak, _Slow.together = 0, 0
    op = _Operator(_Slow(), max_concurrent_runs=2)
    try:
        rows = [{"key": f"k{i % 6}", "v": i} for i in range(30)]
        for row in rows:
            op.element(row["key"], row)
            assert sum(1 for ks in op.core.machine.keys.values() if ks.run) <= 2
            op.fire()
        op.end()
        assert sum(1 for ks in op.core.machine.keys.values() if ks.run) == 0
    finally:
        op.core.close()
    assert _Slow.peak <= 2
    got = per_key(op.outputs)
    assert got == {f"k{j}": [i for i in range(30) if i % 6 == j] for j in range(6)}
    assert op.memory() == {f"k{j}": {"seen": got[f"k{j}"]} for j in range(6)}


def test_with_max_concurrent_runs_waiting_keys_poll_and_finish_without_an_end_of_input() -> None:
    """A followed input never ends: a key whose run waits for a slot (or whose run another
    key's callback started) must get its own timer, or it would wait for good."""
    import time

    _Slow.peak, _Slow.together = 0, 0
    op = _Operator(_Slow(), max_concurrent_runs=2)
    try:
        rows = [{"key": f"k{i % 6}", "v": i} for i in range(30)]
        for row in rows:
            op.element(row["key"], row)
        deadline = time.monotonic() + 30
        while len(op.outputs) < len(rows) and time.monotonic() < deadline:
            assert op.timers, "keys with work left and no timer: they would never run again"
            time.sleep(0.005)
            op.fire()
            assert sum(1 for ks in op.core.machine.keys.values() if ks.run) <= 2
    finally:
        op.core.close()
    assert _Slow.peak <= 2
    got = per_key(op.outputs)
    assert got == {f"k{j}": [i for i in range(30) if i % 6 == j] for j in range(6)}
    assert op.memory() == {f"k{j}": {"seen": got[f"k{j}"]} for j in range(6)}


def test_at_the_end_of_input_all_keys_drain_at_once_not_one_after_another() -> None:
    _Slow.peak, _Slow.together, _Slow.all_in = 0, 8, None
    op = _Operator(_Slow())
    try:
        rows = [{"key": f"k{i % 8}", "v": i} for i in range(40)]
        for row in rows:  # no timer fires: every key has runs queued at the end of input
            op.element(row["key"], row)
        op.end()
    finally:
        op.core.close()
        _Slow.together = 0
    # The drain ran the eight keys' runs side by side (one key at a time, the first run
    # would have waited 10 s for the others and the peak would be lower).
    assert _Slow.peak == 8
    assert per_key(op.outputs) == {f"k{j}": [i for i in range(40) if i % 8 == j] for j in range(8)}


class _Hop(Agent):
    """Many short awaits per run (a model call over a pooled connection, say)."""

    @action(InputEvent)
    async def go(self, event: InputEvent, ctx: Any) -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        await ctx.durable_execute_async(_echo, event.input["v"])
        ctx.send_event(OutputEvent(output=event.input["v"]))


async def _echo(v: int) -> int:
    await asyncio.sleep(0.001)
    return v


def test_more_async_tasks_than_max_concurrent_tasks_all_run_to_the_end() -> None:
    """Tasks beyond `max_concurrent_tasks` wait their turn, in order, and all run. (The limit
    was an asyncio semaphore, whose waiters were seen never to wake under benchmarks/peers
    workload 3, a pooled HTTP client: runs stuck with every permit free. This test covers the
    queue that replaced it; it did not reproduce that hang.)"""
    op = _Operator(_Hop(), max_concurrent_tasks=4)
    try:
        rows = [{"key": f"k{i % 50}", "v": i} for i in range(200)]
        for row in rows:
            op.element(row["key"], row)
        op.end()
    finally:
        op.core.close()
    assert sorted(o["output"] for o in op.outputs) == list(range(200))


class _Tally(Agent):
    """One durable async call per input and a running count in memory."""

    @action(InputEvent)
    async def handle(self, event: InputEvent, ctx: Any) -> None:
        got = await ctx.durable_execute_async(_echo, event.input["v"])
        mem = ctx.short_term_memory
        mem.set("seen", [*mem.get("seen", []), got])
        ctx.send_event(OutputEvent(output={"v": got, "n": len(mem.get("seen"))}))


class _WakeOperator(_Operator):
    """`_Operator` that also keeps the wake registry as the PyFlink function does (by each
    step's `wake`), and whose timers a restore can lose."""

    def __init__(self, agent: Agent, state: MemoryKeyedState | None = None) -> None:
        super().__init__(agent)
        if state is not None:
            self.state = state
        self.registry: set[Any] = set()

    def _take(self, key: Any, step: Any) -> None:
        super()._take(key, step)
        if step.wake > 0:
            self.registry.add(key)
        elif step.wake < 0:
            self.registry.discard(key)

    def sweep(self, registry: set[Any]) -> None:
        """A new worker's first callback: every listed key, once (`_sweep` in PyFlink)."""
        self.registry = set(registry)
        for key in sorted(registry):
            self.current = key
            self._take(key, self.core.timer(key, self.state.view(key)))


def _with_work(state: MemoryKeyedState) -> set[Any]:
    return {k for k, slot in state._slots.items() if slot.run is not None or slot.inputs}


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=14),
    st.integers(0, 13),
)
def test_a_restore_that_lost_every_timer_finishes_every_key_from_the_wake_registry(
    keys: list[str], cut: int
) -> None:
    """PyFlink can checkpoint a bundle's state writes without the timers the bundle registered
    (flink/_function.py, the wake registries). Worst case: a restore with no timer at all.
    Every keyed-state snapshot must list each key with work in the registry, and calling the
    listed keys once after the restore must finish every input, each output exactly once."""
    import time

    rows = [{"key": k, "v": i} for i, k in enumerate(keys)]
    cut = min(cut, len(rows) - 1)
    first = _WakeOperator(_Tally())
    try:
        for i, row in enumerate(rows):
            first.element(row["key"], row)
            first.fire()
            assert _with_work(first.state) <= first.registry  # at every possible checkpoint
            if i == cut:
                checkpoint = first.state.snapshot()
                registry = set(first.registry)
                committed = list(first.outputs)
    finally:
        first.core.close()
    restored = _WakeOperator(_Tally(), checkpoint)
    try:
        restored.sweep(registry)  # no timer survived; no input for these keys comes again
        for row in rows[cut + 1 :]:
            restored.element(row["key"], row)
        deadline = time.monotonic() + 30
        while _with_work(restored.state) and time.monotonic() < deadline:
            time.sleep(0.002)
            restored.fire()
        assert not _with_work(restored.state), "a key with work was never called again"
        assert restored.registry == set(), "idle keys stay listed"
    finally:
        restored.core.close()
    outputs = committed + restored.outputs
    for key in set(keys):
        mine = [o["output"] for o in outputs if o["key"] == key]
        assert [o["v"] for o in mine] == [r["v"] for r in rows if r["key"] == key]
        assert [o["n"] for o in mine] == list(range(1, len(mine) + 1))
