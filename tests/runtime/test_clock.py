"""Time as an input: the fake clock moves only when told, and the engine reads no other clock —
checkpoint timestamps, the checkpoint interval and restore times are exact virtual times."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

import ratchet
from ratchet import Agent, ConfigError, InputEvent, OutputEvent, action
from ratchet.agents._context import AgentBinding, install_task_factory
from ratchet.runtime._engine import Engine, EngineConfig
from ratchet.runtime._io import CallbackSink, IterableSource
from ratchet.store._memory import MemoryStore
from ratchet.store._sqlite import SqliteStore
from ratchet.testing import FakeClock


def test_sleepers_wake_in_deadline_order_at_exact_virtual_times() -> None:
    clock = FakeClock(start=1000.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.monotonic()))

    async def main() -> None:
        tasks = [asyncio.create_task(sleeper(n, s)) for n, s in (("b", 5), ("a", 2), ("c", 5))]
        await asyncio.sleep(0)  # each task runs up to its sleep
        assert clock.sleepers == 3
        assert clock.next_deadline() == 2
        clock.advance(1.5)
        await asyncio.sleep(0)
        assert woke == []
        clock.advance(0.5)
        await asyncio.wait_for(tasks[1], 1)
        assert woke == [("a", 2.0)]
        clock.jump_to(10)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert woke == [("a", 2.0), ("b", 10.0), ("c", 10.0)]
    assert clock.now() == 1010.0


def test_a_blocking_sleep_waits_for_the_clock_and_time_never_goes_back() -> None:
    clock = FakeClock()
    done = threading.Event()
    t = threading.Thread(target=lambda: (clock.sleep_sync(3), done.set()))
    t.start()
    while clock.sleepers == 0:
        threading.Event().wait(0.001)
    assert not done.is_set()
    clock.advance(3)
    t.join(5)
    assert done.is_set()
    with pytest.raises(ConfigError, match=r"advance\(-1\): time only moves forward"):
        clock.advance(-1)
    auto = FakeClock(start=0, autojump=True)
    auto.sleep_sync(7)
    assert auto.now() == 7


class Gated(Agent):
    """Holds its first input's run open until the test releases it."""

    gate = threading.Event()

    @action(InputEvent)
    def handle(self, event: InputEvent, ctx: Any) -> None:
        if event.input.get("wait"):
            self.gate.wait(10)
        ctx.short_term_memory.set("n", ctx.short_term_memory.get("n", 0) + 1)
        ctx.send_event(OutputEvent(output=event.input["v"]))


def test_the_checkpoint_interval_and_timestamps_follow_the_engine_clock() -> None:
    clock = FakeClock(start=5000.0)
    store = MemoryStore(clock=clock)
    got: list[dict[str, Any]] = []
    Gated.gate.clear()
    engine = Engine(
        AgentBinding(Gated()),
        store,
        IterableSource([{"key": "k", "v": 1, "wait": True}]),
        CallbackSink(got.append),
        EngineConfig(checkpoint_interval=60.0),
        clock=clock,
    )

    async def settle() -> None:
        """Let the loop and the writer thread run a while (for asserting nothing happened)."""
        for _ in range(100):
            await asyncio.sleep(0.001)

    async def until(done: Any) -> None:
        for _ in range(30000):
            if done():
                return
            await asyncio.sleep(0.001)
        raise AssertionError("the engine did not get there")

    async def main() -> None:
        install_task_factory(asyncio.get_running_loop())
        job = asyncio.create_task(engine.run())
        # Wait for idleness, not for time: the checkpoint loop is asleep on the clock.
        await until(lambda: clock.sleepers == 1)
        await settle()
        assert store.counts["completed"] == 0  # a minute of real time would have checkpointed
        clock.advance(59.0)
        await settle()
        assert store.counts["completed"] == 0
        clock.advance(1.0)
        await until(lambda: store.counts["completed"] == 1 and clock.sleepers == 1)
        assert store.stats()["latest_completed"]["trigger_timestamp"] == 5060.0
        clock.advance(60.0)
        await until(lambda: store.counts["completed"] == 2 and clock.sleepers == 1)
        await settle()
        assert store.counts["completed"] == 2
        Gated.gate.set()
        await asyncio.wait_for(job, 10)

    asyncio.run(main())
    # The final checkpoint at the end of input, at the same virtual instant.
    assert store.stats()["latest_completed"]["trigger_timestamp"] == 5120.0
    assert [r["output"] for r in got] == [1]


def test_restore_and_state_creation_times_come_from_the_clock(tmp_path: Path) -> None:
    clock = FakeClock(start=7000.0)
    Gated.gate.set()
    rows = [{"key": "k", "v": 1}]
    ratchet.run(Gated(), inputs=rows, output=tmp_path / "o.jsonl", state_dir=tmp_path, clock=clock)
    clock.advance(42.5)
    ratchet.run(Gated(), inputs=rows, output=tmp_path / "o.jsonl", state_dir=tmp_path, clock=clock)
    store = SqliteStore.open_readonly(tmp_path)
    try:
        assert store.meta("created_at") == 7000.0
        assert store.stats()["latest_restored"]["restored_at"] == 7042.5
    finally:
        store.close()


def test_an_idle_follow_job_takes_no_empty_checkpoints(tmp_path: Path) -> None:
    """Nothing new and no run in flight: the last checkpoint is still exact, none is written."""
    from ratchet.runtime._io import JsonlSource

    clock = FakeClock(start=0.0)
    store = MemoryStore(clock=clock)
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"key": "k", "v": 1}\n')
    got: list[dict[str, Any]] = []
    Gated.gate.set()
    engine = Engine(
        AgentBinding(Gated()),
        store,
        JsonlSource(inputs, follow=True),
        CallbackSink(got.append),
        EngineConfig(checkpoint_interval=1.0, follow_poll=0.5),
        clock=clock,
    )

    async def until(done: Any) -> None:
        for _ in range(30000):
            if done():
                return
            await asyncio.sleep(0.001)
        raise AssertionError("the engine did not get there")

    async def tick(n: int) -> None:
        for _ in range(n):
            await until(lambda: clock.sleepers == 2)  # the checkpoint loop and the source poll
            clock.advance(0.5)

    async def main() -> None:
        install_task_factory(asyncio.get_running_loop())
        job = asyncio.create_task(engine.run())

        async def tick_until(done: Any) -> None:
            """Move time on, half an interval at a time, until the engine got there."""
            for _ in range(400):
                if done():
                    return
                await tick(1)
            raise AssertionError("the engine did not get there")

        # The input's run, its checkpoint, its release, and the outbox row's removal.
        await tick_until(lambda: len(got) == 1 and not store.outbox and not engine._released)
        await tick(4)
        settled = store.counts["completed"]
        await tick(40)  # twenty idle checkpoint intervals
        assert store.counts["completed"] == settled
        with inputs.open("a") as fh:
            fh.write('{"key": "k", "v": 2}\n')
        await tick_until(lambda: len(got) == 2)
        assert store.counts["completed"] > settled  # new work is checkpointed again
        engine.request_stop("test")
        await asyncio.wait_for(job, 10)

    asyncio.run(main())
    assert [r["output"] for r in got] == [1, 2]


def test_a_new_states_job_id_comes_from_the_injected_random(tmp_path: Path) -> None:
    import json
    import random

    Gated.gate.set()
    for name in ("a", "b"):
        ratchet.run(
            Gated(),
            inputs=[{"key": "k", "v": 1}],
            output=tmp_path / f"{name}.jsonl",
            state_dir=tmp_path / name,
            rng=random.Random(42),
        )
    jobs = [json.loads((tmp_path / n / "job.json").read_text())["job"] for n in ("a", "b")]
    assert jobs[0] == jobs[1] == f"{random.Random(42).getrandbits(64):016x}"


def test_fake_clock_misuse_is_named() -> None:
    from ratchet import ConfigError

    with pytest.raises(
        ConfigError, match=r"FakeClock\(start=\): takes a number of seconds, got 'x'"
    ):
        FakeClock("x")  # type: ignore[arg-type]
    clock = FakeClock()
    with pytest.raises(ConfigError, match=r"advance\('5'\): takes a number of seconds"):
        clock.advance("5")  # type: ignore[arg-type]
    clock.advance(10)
    clock.jump_to(3)  # a time already passed does nothing (a driver may race another)
    assert clock.monotonic() == 10


def test_a_clock_that_is_not_one_is_refused_before_the_state_is_touched(tmp_path: Path) -> None:
    # clock=time (the module) failed deep in the store with an AttributeError and left the
    # state directory behind, holding a lock file.
    import time as time_module

    from ratchet import Agent, InputEvent, InvalidTypeError, action, run

    class Plain(Agent):
        @action(InputEvent, inline=True)
        def go(self, event: InputEvent, ctx: Any) -> None:
            pass

    for bad in (object(), time_module):
        with pytest.raises(InvalidTypeError, match=r"clock= must be a ratchet Clock \(now, "):
            run(Plain(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl",
                state_dir=tmp_path / "s", clock=bad)  # type: ignore[arg-type]  # fmt: skip
        assert not (tmp_path / "s").exists()
