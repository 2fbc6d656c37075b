"""Retry policies on the fake clock: attempts at exact virtual times, from the memory the task
was dispatched with, with durable backoff across a restore; on actions and durable calls."""

from __future__ import annotations

from typing import Any

import pytest

from ratchet import Agent, InputEvent, InvalidArgumentError, OutputEvent, Retry, action
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
