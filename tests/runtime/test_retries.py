"""Retry policies on the fake clock: attempts at exact virtual times, from the memory the task
was dispatched with, with durable backoff across a restore; on actions and durable calls; the
signals a failed attempt took go back for the next (and a give-back that fails loses none)."""

from __future__ import annotations

from typing import Any

import pytest

from ratchet import Agent, InputEvent, InvalidArgumentError, OutputEvent, Retry, action
from ratchet._errors import CheckpointError
from ratchet.store import codec
from ratchet.store._faulty import FaultyStore
from ratchet.store._memory import MemoryStore
from ratchet.testing import FakeClock
from support.fakeclock import START, Drive

ATTEMPTS: list[tuple[str, float, Any]] = []


class Flaky(Agent):
    def __init__(self, clock: FakeClock, fail: int) -> None:
        self.clock = clock
        self.fail = fail

    @action(
        InputEvent, retry=Retry(max_attempts=4, initial_delay=10, backoff=2, on=(RuntimeError,))
    )
    async def work(self, event: InputEvent, ctx: Any) -> None:
        m = ctx.short_term_memory
        ATTEMPTS.append(("work", self.clock.now() - START, m.get("scratch")))
        m.set("scratch", "written by a failed attempt")
        receipt = await ctx.durable_execute_async(pay, len(ATTEMPTS))
        if len([a for a in ATTEMPTS if a[0] == "work"]) <= self.fail:
            raise RuntimeError("flaky")
        if event.input.get("bad"):
            raise ValueError("not retried")
        ctx.send_event(OutputEvent(output={"at": self.clock.now() - START, "paid": receipt}))


PAID: list[int] = []


async def pay(n: int) -> int:
    PAID.append(n)
    return n


def test_an_action_is_retried_with_backoff_from_the_memory_it_was_dispatched_with() -> None:
    ATTEMPTS.clear()
    PAID.clear()
    clock = FakeClock(START)
    d = Drive(Flaky(clock, fail=2), [{"key": "a"}], MemoryStore(clock))
    d.run()
    # Attempts at 0, 10, 30 (10 * 2); each saw the dispatch-time memory, not the failed write.
    assert [(t, seen) for _w, t, seen in ATTEMPTS] == [(0.0, None), (10.0, None), (30.0, None)]
    assert d.outputs() == [{"at": 30.0, "paid": 3}]
    assert PAID == [1, 2, 3], "each attempt makes its durable calls again"


def test_a_retry_policy_gives_up_and_lets_other_errors_through() -> None:
    ATTEMPTS.clear()
    clock = FakeClock(START)
    d = Drive(Flaky(clock, fail=9), [{"key": "a"}], MemoryStore(clock))
    d.run()
    (record,) = d.got
    assert record["error"]["message"] == "flaky (after 4 attempts)"
    assert [t for _w, t, _s in ATTEMPTS] == [0.0, 10.0, 30.0, 70.0]
    ATTEMPTS.clear()
    d = Drive(Flaky(clock, fail=0), [{"key": "b", "bad": True}], MemoryStore(clock))
    d.run()
    assert d.got[0]["error"]["message"] == "not retried" and len(ATTEMPTS) == 1


def test_the_backoff_is_durable_across_a_restore() -> None:
    ATTEMPTS.clear()
    PAID.clear()
    clock = FakeClock(START)
    store = MemoryStore(clock)
    first = Drive(Flaky(clock, fail=2), [{"key": "a"}], store)
    first.run(stop_at=START + 5, follow=True)  # stopped during the first backoff (until 10)
    assert [t for _w, t, _s in ATTEMPTS] == [0.0]
    again = Drive(Flaky(clock, fail=2), [{"key": "a"}], store.reopen())
    again.run()
    # The second attempt came at the recorded 10 (not 10 s after the restart), the third at 30.
    assert [t for _w, t, _s in ATTEMPTS] == [0.0, 10.0, 30.0]
    assert again.outputs() == [{"at": 30.0, "paid": 3}]


CALLS: list[float] = []


class Caller(Agent):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    @action(InputEvent)
    async def go(self, event: InputEvent, ctx: Any) -> None:
        def flaky_call(n: int) -> str:
            CALLS.append(self.clock.now() - START)
            if len(CALLS) < 3:
                raise TimeoutError("slow provider")
            return f"ok {n}"

        got = await ctx.durable_execute_async(
            flaky_call, 7, retry=Retry(max_attempts=5, initial_delay=4, backoff=3)
        )
        ctx.send_event(OutputEvent(output=got))


def test_a_durable_call_is_retried_durably_and_answered_once() -> None:
    CALLS.clear()
    clock = FakeClock(START)
    store = MemoryStore(clock)
    first = Drive(Caller(clock), [{"key": "a"}], store)
    first.run(stop_at=START + 6, follow=True)  # after the 2nd failure (at 4), waiting until 16
    assert CALLS == [0.0, 4.0]
    again = Drive(Caller(clock), [{"key": "a"}], store.reopen())
    again.run()
    assert CALLS == [0.0, 4.0, 16.0]
    assert again.outputs() == ["ok 7"]


def test_a_retry_policy_is_checked() -> None:
    for kwargs, message in (
        ({"max_attempts": 0}, "an int >= 1"),
        ({"backoff": 0.5}, "a factor >= 1"),
        ({"initial_delay": -1}, "a number >= 0"),
        ({"on": (int,)}, "exception classes"),
    ):
        with pytest.raises((InvalidArgumentError, TypeError), match=message):
            Retry(**kwargs)
    assert Retry(initial_delay=1, backoff=2, max_delay=5).delay(10) == 5


# -- the signals a failed attempt took go back for the next one ----------------------------------

GOT: list[Any] = []


class WaitsThenFails(Agent):
    """Waits for "go"; its first `fails` attempts fail after that (transiently: retried)."""

    def __init__(self, fails: int) -> None:
        self.fails = fails

    @action(InputEvent, retry=Retry(max_attempts=3, initial_delay=10, on=(RuntimeError,)))
    async def work(self, event: InputEvent, ctx: Any) -> None:
        got = await ctx.wait_for_signal("go")
        GOT.append(got)
        if self.fails > 0:
            self.fails -= 1
            raise RuntimeError(f"transient, after taking {got}")
        ctx.send_event(OutputEvent(output={"go": got}))


def pending(store: MemoryStore) -> list[tuple[int, Any]]:
    return [(i, codec.decode(row[2])) for i, row in sorted(store.signals.items())]


def test_a_failed_attempt_gives_back_its_signals_in_their_place() -> None:
    """Attempts 1 and 2 take "go" 1 and fail: each gives it back (before "go" 2, sent later,
    with its id), so attempt 3 takes it too; "go" 2 stays pending for a later wait."""
    GOT.clear()
    store = MemoryStore(FakeClock(START))
    first = store.add_signal("k", "go", 1)
    second = store.add_signal("k", "go", 2)
    d = Drive(WaitsThenFails(fails=2), [{"key": "k"}], store)
    d.run()
    assert GOT == [1, 1, 1]
    assert d.outputs() == [{"go": 1}]
    assert pending(store) == [(second, 2)] and first < second


@pytest.mark.parametrize("after", [False, True], ids=["not-applied", "applied-then-stopped"])
def test_a_give_back_that_fails_stops_the_job_and_loses_no_signal(after: bool) -> None:
    """The give-back fails (a full disk: nothing applied; or it committed and the job stops
    before recording the retry, as a kill between the two leaves it). The job stops (an
    engine fault, not the action's error); the signal is held once, by the failed attempt's
    record or back in the state, and the restarted job's attempt gets it, once."""
    GOT.clear()
    clock = FakeClock(START)
    store = MemoryStore(clock)
    sid = store.add_signal("k", "go", 1)
    faulty = FaultyStore(store, seed=3, clock=clock).fail(
        "release_attempt_signals", calls=[1], after=after
    )
    d = Drive(WaitsThenFails(fails=1), [{"key": "k"}], store)
    d.store = faulty  # type: ignore[assignment]
    with pytest.raises(CheckpointError, match="could not be given back"):
        d.run()
    assert GOT == [1] and d.outputs() == []
    retried = [r for r in store.calls.values() if r.fn == "ratchet.retry"]
    assert retried == []  # the retry was not recorded: the attempt runs again
    taken = [r for r in store.calls.values() if r.fn == "ratchet.signal" and r.status == "ok"]
    assert (len(taken), pending(store)) == ((0, [(sid, 1)]) if after else (1, [])), taken
    store = store.reopen()
    again = Drive(WaitsThenFails(fails=0 if after else 1), [{"key": "k"}], store)
    again.run()
    # Applied: the re-executed attempt 1 takes it again from the state. Not applied: attempt
    # 1's record answers its wait, it fails again, and gives it back for attempt 2.
    assert GOT == ([1, 1] if after else [1, 1, 1])
    assert again.outputs() == [{"go": 1}]
    assert pending(store) == []


class Gathers(Agent):
    """Waits for "go" twice in one branch of a gather; the other branch fails the first
    attempt after a while, so the first branch is still waiting when the attempt fails."""

    def __init__(self) -> None:
        self.attempts = 0
        self.got: list[tuple[int, Any]] = []

    @action(InputEvent, retry=Retry(max_attempts=3, initial_delay=10, on=(RuntimeError,)))
    async def act(self, event: InputEvent, ctx: Any) -> None:
        import asyncio

        self.attempts += 1
        attempt = self.attempts

        async def collect() -> list[Any]:
            values = []
            for _ in range(2):
                values.append(await ctx.wait_for_signal("go"))
                self.got.append((attempt, values[-1]))
            return values

        async def check() -> None:
            if attempt == 1:
                await ctx.sleep(1)
                raise RuntimeError("transient")

        got, _ = await asyncio.gather(collect(), check())
        ctx.send_event(OutputEvent(output=got))


def test_a_wait_left_running_by_the_failed_attempt_does_not_take_its_signal_back() -> None:
    """gather does not cancel its other branch when one fails: that branch, still waiting for
    "go", took the signal the failed attempt had just given back (recorded under the failed
    attempt, read by nothing: lost). The attempt's tasks end before the give-back now."""
    store = MemoryStore(FakeClock(START))
    store.add_signal("k", "go", 1)
    agent = Gathers()
    Drive(agent, [{"key": "k"}], store).run()
    assert agent.got == [(1, 1), (2, 1)]  # the retried attempt got it again
    store.add_signal("k", "go", 2)
    agent2 = Gathers()
    agent2.attempts = 1  # the restored run is the retried attempt (2): it does not fail
    d = Drive(agent2, [{"key": "k"}], store)
    d.run()
    assert d.outputs() == [[1, 2]]
    assert store.signals == {}


class FailsBesideAWait(Agent):
    """Input "fail": one branch of a gather begins waiting for "go" while the other fails
    the action at once (no retry). Input "wait": waits for "go" and outputs it."""

    @action(InputEvent)
    async def act(self, event: InputEvent, ctx: Any) -> None:
        import asyncio

        if event.input["do"] == "wait":
            ctx.send_event(OutputEvent(output=await ctx.wait_for_signal("go")))
            return

        async def fail() -> None:
            raise ValueError("fails at once")

        await asyncio.gather(ctx.wait_for_signal("go"), fail())


def test_a_wait_begun_beside_a_failure_does_not_take_a_signal_after_the_action_ended() -> None:
    """The failed action's other branch got past its wait's intent write after the ctx was
    sealed and took the signal with the ended ctx's journal: the record could not be made
    (a traceback in the log) and the signal, still in the store, was gone from the job's
    pending signals, so the next run of the key waited for it until a restart. A sealed ctx
    now refuses the wait before it takes anything."""
    store = MemoryStore(FakeClock(START))
    store.add_signal("k", "go", 1)
    d = Drive(FailsBesideAWait(), [{"key": "k", "do": "fail"}, {"key": "k", "do": "wait"}], store)
    d.run()
    assert d.outputs()[-1] == 1, d.outputs()
    assert store.signals == {}
