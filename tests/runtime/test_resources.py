"""Pause, don't burn, on the fake clock: a resource that fails transiently past its retries
opens a circuit; calls wait (parked) instead of failing, new inputs wait, one call probes at
growing intervals, and when it is back everything goes on: no error output."""

from __future__ import annotations

from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, Resource, Retry, action
from ratchet.store._memory import MemoryStore
from ratchet.testing import FakeClock
from support.fakeclock import START, Drive

CALLS: list[tuple[float, int]] = []
DOWN_UNTIL = START + 9


class Caller(Agent):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    @action(InputEvent)
    async def call(self, event: InputEvent, ctx: Any) -> None:
        n = event.input["n"]

        def service(n: int) -> int:
            CALLS.append((self.clock.now() - START, n))
            if self.clock.now() < DOWN_UNTIL:
                raise TimeoutError("service unavailable")
            if n == 99:
                raise ValueError("a request the service refuses")
            return n * 10

        got = await ctx.durable_execute_async(
            service,
            n,
            retry=Retry(max_attempts=2, initial_delay=0.5),
            resource=Resource("svc", probe_delay=2, max_probe_delay=60),
        )
        ctx.send_event(OutputEvent(output={"n": got, "at": self.clock.now() - START}))


def test_an_outage_pauses_the_stream_and_loses_nothing() -> None:
    CALLS.clear()
    clock = FakeClock(START)
    rows = [{"key": f"k{i}", "n": i} for i in range(6)]
    d = Drive(Caller(clock), rows, MemoryStore(clock))
    result = d.run(max_concurrent_runs=2, max_buffered_inputs=2)
    assert [g.get("error") for g in d.got] == [None] * 6
    assert sorted(o["n"] for o in d.outputs()) == [0, 10, 20, 30, 40, 50]
    # Two calls started (the buffer holds two inputs), each retried once (at 0.5); then the
    # circuit opened: probes at 2.5, 6.5 (one call each), and at 14.5 the service answered.
    probes = [(t, n) for t, n in CALLS if t > 0.5]
    assert [t for t, _ in probes[:3]] == [2.5, 6.5, 14.5], CALLS
    # Nothing else was admitted while it was down: the other inputs ran after 14.5.
    assert all(o["at"] >= 14.5 for o in d.outputs())
    assert result.runs_failed == 0


def test_an_error_retrying_cannot_fix_still_fails_at_once() -> None:
    CALLS.clear()
    clock = FakeClock(START + 10)  # the service is up
    d = Drive(Caller(clock), [{"key": "a", "n": 99}], MemoryStore(clock))
    d.run()
    (record,) = d.got
    assert record["error"]["type"] == "builtins.ValueError" and len(CALLS) == 1


def test_a_pause_survives_a_restore_and_probes_at_its_recorded_time() -> None:
    CALLS.clear()
    clock = FakeClock(START)
    store = MemoryStore(clock)
    first = Drive(Caller(clock), [{"key": "a", "n": 1}], store)
    first.run(stop_at=START + 3, follow=True)  # paused: next probe at 6.5
    assert store.report["paused"][0]["resource"] == "svc"
    again = Drive(Caller(clock), [{"key": "a", "n": 1}], store.reopen())
    again.run()
    assert again.outputs() and again.got[0].get("error") is None
    times = [t for t, _ in CALLS]
    assert times[:3] == [0.0, 0.5, 2.5] and times[3] == 6.5, times
