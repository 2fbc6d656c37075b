"""Durable waits on the fake clock: sleeps, delayed events and signals fire at exact virtual
times, in order, across a restore; a waiting run holds no run slot; a bounded job leaves runs
that wait for signals parked. (The SIGKILL versions: tests/kill/test_waits_kill.py.)"""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ratchet import (
    Agent,
    Event,
    InputEvent,
    InvalidArgumentError,
    OutputEvent,
    SignalTimeout,
    action,
)
from ratchet.store._memory import MemoryStore
from ratchet.testing import FakeClock
from support.fakeclock import START, Drive


class Sleeper(Agent):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    @action(InputEvent)
    async def nap(self, event: InputEvent, ctx: Any) -> None:
        await ctx.sleep(event.input["s"])
        ctx.send_event(OutputEvent(output={"i": event.input["i"], "at": self.clock.now() - START}))


def test_sleeps_end_at_exact_virtual_times_in_deadline_order_and_hold_no_slot() -> None:
    store = MemoryStore(FakeClock(START))
    rows = [{"key": f"k{i}", "i": i, "s": s} for i, s in enumerate([30, 10, 20, 10])]
    d = Drive(Sleeper(store.clock), rows, store)  # type: ignore[arg-type]
    result = d.run(max_concurrent_runs=1)
    # One run slot, four sleeping runs at once: the sleepers did not hold it.
    assert sorted((o["at"], o["i"]) for o in d.outputs()) == [(10, 1), (10, 3), (20, 2), (30, 0)]
    assert [o["i"] for o in d.outputs()][:2] in ([1, 3], [3, 1])
    assert result.runs_completed == 4


def test_a_sleep_resumes_after_a_restore_with_the_time_it_had_left() -> None:
    clock = FakeClock(START)
    store = MemoryStore(clock)
    rows = [{"key": "a", "i": 0, "s": 100.0}, {"key": "b", "i": 1, "s": timedelta_s(40)}]
    first = Drive(Sleeper(clock), rows, store)
    first.run(stop_at=START + 25, follow=True)  # a clean stop after 25 s: both still asleep
    assert first.outputs() == []
    clock.advance(50)  # the job was down for 50 s: b's sleep fell due meanwhile
    restart = clock.now() - START
    again = Drive(Sleeper(clock), rows, store.reopen())
    again.run()
    # b ends at once on restart, a at its recorded deadline (100), not 100 s after the restart.
    assert restart >= 75 and again.outputs() == [{"i": 1, "at": restart}, {"i": 0, "at": 100.0}]


def timedelta_s(seconds: float) -> Any:
    return datetime.timedelta(seconds=seconds)


class Ping(Event):
    n: int


class Reminder(Agent):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    @action(InputEvent)
    async def start(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("started", True)
        ctx.send_event(Ping(n=2), delay=20)
        ctx.send_event(Ping(n=1), delay=datetime.timedelta(seconds=10))
        due = datetime.datetime.fromtimestamp(START + 30, datetime.UTC)
        ctx.send_event(Ping(n=3), at=due)

    @action(Ping)
    async def ping(self, event: Ping, ctx: Any) -> None:
        seen = ctx.short_term_memory.get("seen", [])
        ctx.short_term_memory.set("seen", [*seen, event.n])
        ctx.send_event(OutputEvent(output={"n": event.n, "at": self.clock.now() - START}))


def test_delayed_events_arrive_at_their_time_in_order_and_after_a_restore() -> None:
    clock = FakeClock(START)
    store = MemoryStore(clock)
    rows = [{"key": "a"}]
    first = Drive(Reminder(clock), rows, store)
    first.run(stop_at=START + 15, follow=True)
    assert first.outputs() == [{"n": 1, "at": 10.0}]
    again = Drive(Reminder(clock), rows, store.reopen())
    again.run()
    assert again.outputs() == [{"n": 2, "at": 20.0}, {"n": 3, "at": 30.0}]
    assert again.store.load().runs == []  # the run completed


def test_a_delay_is_checked() -> None:
    class Bad(Agent):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            for kwargs in ({"delay": -1}, {"at": datetime.datetime(2030, 1, 1)}):
                try:
                    ctx.send_event(Ping(n=0), **kwargs)
                except InvalidArgumentError as exc:
                    ctx.send_event(OutputEvent(output=str(exc)))

    store = MemoryStore(FakeClock(START))
    d = Drive(Bad(), [{"key": "a"}], store)
    d.run()
    assert "seconds >= 0" in d.outputs()[0] and "aware datetime" in d.outputs()[1]


class Approver(Agent):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    @action(InputEvent)
    async def ask(self, event: InputEvent, ctx: Any) -> None:
        try:
            first = await ctx.wait_for_signal("ok", timeout=event.input.get("timeout"))
            second = await ctx.wait_for_signal("ok", timeout=event.input.get("timeout"))
        except SignalTimeout as exc:
            ctx.send_event(
                OutputEvent(output={"timeout": str(exc), "at": self.clock.now() - START})
            )
            return
        ctx.send_event(OutputEvent(output={"got": [first, second], "at": self.clock.now() - START}))


def test_signals_are_delivered_once_in_order_sent_early_ones_kept() -> None:
    clock = FakeClock(START)
    store = MemoryStore(clock)
    store.add_signal("a", "ok", {"n": 1})  # sent before anybody waits: kept
    rows = [{"key": "a"}, {"key": "b"}]
    d = Drive(Approver(clock), rows, store)
    result = d.run()
    # A bounded job stops when every run left waits for a signal: a got one of two, b none.
    assert result.stopped_by == "2 run(s) waiting for signals"
    assert d.outputs() == []
    store.add_signal("a", "ok", {"n": 2})
    store.add_signal("a", "ok", {"n": 3})
    store.add_signal("b", "ok", "x")
    store.add_signal("b", "ok", "y")
    again = Drive(Approver(clock), rows, store.reopen())
    again.run()
    # "at" is left out: the fake clock moves on whenever the engine idles (a loaded machine
    # makes it idle more often), and no wait here has a timeout to check against.
    assert sorted((o["got"] for o in again.outputs()), key=str) == sorted(
        [[{"n": 1}, {"n": 2}], ["x", "y"]], key=str
    )
    # The third signal of a waits for a later run of a; nothing was delivered twice.
    assert [(k, n) for _i, (k, n, _v, _t, _kt) in sorted(again.store.signals.items())] == [
        ("a", "ok")
    ]


def test_a_signal_wait_times_out_at_its_recorded_deadline_across_a_restart() -> None:
    clock = FakeClock(START)
    store = MemoryStore(clock)
    rows = [{"key": "a", "timeout": 60}]
    first = Drive(Approver(clock), rows, store)
    first.run(stop_at=START + 20, follow=True)
    clock.advance(10)  # down for 10 s
    again = Drive(Approver(clock), rows, store.reopen())
    again.run(stop_at=START + 90, follow=True)  # a running job: the wait times out on time
    (out,) = again.outputs()
    assert out["at"] == 60.0 and "no signal 'ok' for key 'a'" in out["timeout"]
    # A bounded job does not wait for timeouts: it leaves the run parked; the next start
    # after the deadline times it out at once.
    store = MemoryStore(clock)
    first = Drive(Approver(clock), rows, store)
    assert first.run().stopped_by == "1 run(s) waiting for signals"
    clock.advance(120)
    restart = clock.now() - START
    again = Drive(Approver(clock), rows, store.reopen())
    again.run()
    assert [o["at"] for o in again.outputs()] == [restart]


def test_a_signal_sent_after_the_deadline_while_no_job_ran_does_not_beat_the_timeout() -> None:
    """The wait's deadline passed while the job was down and a signal came after it: the
    wait times out at the restart, as the docs say (the late signal was delivered instead),
    and the signal is kept for a later wait."""
    clock = FakeClock(START)
    store = MemoryStore(clock)
    rows = [{"key": "a", "timeout": 60}]
    first = Drive(Approver(clock), rows, store)
    assert first.run().stopped_by == "1 run(s) waiting for signals"
    clock.advance(120)  # the deadline (60 s) passes while no job runs ...
    store.add_signal("a", "ok", "late")  # ... and then the signal comes
    again = Drive(Approver(clock), rows, store.reopen())
    again.run()
    (out,) = again.outputs()
    assert "no signal 'ok' for key 'a'" in out["timeout"]
    assert [(k, n) for _i, (k, n, _v, _t, _kt) in sorted(again.store.signals.items())] == [
        ("a", "ok")
    ]


def test_a_signal_sent_while_the_job_runs_wakes_the_run() -> None:
    clock = FakeClock(START)
    store = MemoryStore(clock)
    d = Drive(Approver(clock), [{"key": "a"}], store)

    async def sender() -> None:
        pass

    store.add_signal("a", "ok", 1)
    # The second value arrives 5 s into the run, through the store, as another process would.
    original = store.signals_after

    def later(signal_id: int) -> list[tuple[int, str, str, bytes, float, str | None]]:
        if clock.now() >= START + 5 and store.next_signal_id == 2:
            store.add_signal("a", "ok", 2)
        return original(signal_id)

    store.signals_after = later  # type: ignore[method-assign]
    d.run(stop_at=START + 60, follow=True)
    (out,) = d.outputs()
    assert out["got"] == [1, 2] and 5.0 <= out["at"] <= 5.5  # picked up at the next poll


def test_waits_need_an_async_action_and_a_valid_argument() -> None:
    class Wrong(Agent):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            try:
                await ctx.sleep(-1)
            except InvalidArgumentError as exc:
                ctx.send_event(OutputEvent(output=str(exc)))

    store = MemoryStore(FakeClock(START))
    d = Drive(Wrong(), [{"key": "a"}], store)
    d.run()
    assert d.outputs() == ["ctx.sleep takes seconds >= 0 (an int, a float or a timedelta), got -1"]


@pytest.mark.parametrize("n_keys", [3])
def test_a_key_s_later_inputs_wait_behind_its_waiting_run(n_keys: int) -> None:
    clock = FakeClock(START)
    store = MemoryStore(clock)
    rows = [
        {"key": "a", "i": 0, "s": 50},
        {"key": "a", "i": 1, "s": 0},
        {"key": "b", "i": 2, "s": 0},
    ]
    d = Drive(Sleeper(clock), rows, store)
    d.run()
    assert [(o["i"], o["at"]) for o in d.outputs()] == [(2, 0.0), (0, 50.0), (1, 50.0)]


class Mid(Event):
    seen: Any = None


class Ttl(Agent):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    @action(InputEvent)
    async def step(self, event: InputEvent, ctx: Any) -> None:
        op = event.input["op"]
        if op == "set":
            ctx.short_term_memory.set("v", "secret", ttl=event.input["ttl"])
        elif op == "nap":
            await ctx.sleep(event.input["s"])
        else:
            ctx.send_event(Mid(seen=ctx.short_term_memory.get("v")))

    @action(Mid)
    async def later(self, event: Mid, ctx: Any) -> None:
        await ctx.sleep(30)
        seen = ctx.short_term_memory.get("v")
        ctx.send_event(
            OutputEvent(output={"a": event.seen, "b": seen, "at": self.clock.now() - START})
        )


def test_memory_expires_for_runs_that_start_after_its_ttl_and_replay_sees_what_the_run_saw() -> (
    None
):
    clock = FakeClock(START)
    store = MemoryStore(clock)
    rows = [
        {"key": "k", "op": "set", "ttl": 10},
        {"key": "k", "op": "nap", "s": 5},
        {"key": "k", "op": "read"},  # starts at 5: sees the value; its second task reads at 35
        {"key": "k", "op": "read"},  # starts at 35+: the value expired at 10
    ]
    first = Drive(Ttl(clock), rows, store)
    first.run(stop_at=START + 20, follow=True)  # stopped while the first read's task sleeps
    assert first.outputs() == []
    clock.advance(20)
    again = Drive(Ttl(clock), rows, store.reopen())
    again.run()
    assert [(o["a"], o["b"]) for o in again.outputs()] == [("secret", "secret"), (None, None)]
    # The expired value is gone from the key's committed memory too.
    (memory,) = [m for _k, (_t, _nd, m, _v) in again.store.keys.items()]
    assert b"secret" not in memory


def test_a_ttl_is_checked() -> None:
    class Bad(Agent):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            for ttl in (0, -1, "1"):
                try:
                    ctx.short_term_memory.set("v", 1, ttl=ttl)
                except InvalidArgumentError as exc:
                    ctx.send_event(OutputEvent(output=str(exc).split(" (")[0]))

    store = MemoryStore(FakeClock(START))
    d = Drive(Bad(), [{"key": "a"}], store)
    d.run()
    assert d.outputs() == ["set('v', ttl=) takes seconds > 0"] * 3


def test_a_parked_wait_with_a_timeout_is_not_blamed_on_the_action(tmp_path: Path) -> None:
    """Ratchet's own timer for the timeout was counted as a task the action left running:
    every stop with such a wait warned 'returned with 1 asyncio task(s) it did not await'."""
    (tmp_path / "agent.py").write_text(
        "from ratchet import Agent, InputEvent, action\n"
        "class W(Agent):\n"
        "    @action(InputEvent)\n"
        "    async def go(self, event, ctx):\n"
        "        await ctx.wait_for_signal('go', timeout=30)\n"
    )
    (tmp_path / "in.jsonl").write_text('{"key": "a"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "run", f"{tmp_path / 'agent.py'}:W",
         "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
         "--state", str(tmp_path / "st")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "1 run(s) waiting for signals" in proc.stderr, proc.stderr
    assert "did not await" not in proc.stderr, proc.stderr
