"""Agents for tests/kill/test_waits_kill.py, run by real `ratchet run` processes. Side effects
go to the file named by WAITS_LOG (outside the state), one JSON line each, with wall time."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from ratchet import Agent, Event, InputEvent, OutputEvent, Retry, action


def log(**fields: Any) -> None:
    fields["t"] = time.time()  # the test's own witness of wall time
    fields["pid"] = os.getpid()
    with open(os.environ["WAITS_LOG"], "a") as fh:
        fh.write(json.dumps(fields) + "\n")


class Napper(Agent):
    """Sleeps durably for the input's `s` seconds, then outputs."""

    @action(InputEvent)
    async def nap(self, event: InputEvent, ctx: Any) -> None:
        log(what="begin", key=str(ctx.key))
        await ctx.sleep(event.input["s"])
        log(what="woke", key=str(ctx.key))
        ctx.send_event(OutputEvent(output={"key": str(ctx.key), "woke": time.time()}))


class Reminder(Event):
    n: int


class Reminds(Agent):
    """Sends itself a delayed event (the input's `s` seconds), which outputs."""

    @action(InputEvent)
    async def ask(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(Reminder(n=1), delay=event.input["s"])

    @action(Reminder)
    async def remind(self, event: Reminder, ctx: Any) -> None:
        log(what="reminded", key=str(ctx.key))
        ctx.send_event(OutputEvent(output={"reminded": event.n}))


class Lingers(Agent):
    """Outputs its input, after `sleep` seconds of plain (not durable) waiting if it has one."""

    @action(InputEvent)
    async def go(self, event: InputEvent, ctx: Any) -> None:
        await asyncio.sleep(event.input.get("sleep", 0))
        ctx.send_event(OutputEvent(output={"key": str(ctx.key)}))


class Requested(Event):
    amount: int


def charge(key: str, amount: int) -> dict[str, Any]:
    log(what="charge", key=key, amount=amount)
    return {"charged": amount}


class Refunds(Agent):
    """Asks for approval (an output), waits for the signal `approve`, then charges once."""

    @action(InputEvent)
    async def ask(self, event: InputEvent, ctx: Any) -> None:
        amount = int(event.input["amount"])
        ctx.send_event(OutputEvent(output={"approval_requested": amount}))
        ctx.send_event(Requested(amount=amount))

    @action(Requested)
    async def decide(self, event: Requested, ctx: Any) -> None:
        decision = await ctx.wait_for_signal("approve")
        if not decision.get("ok"):
            ctx.send_event(OutputEvent(output={"refused": event.amount}))
            return
        receipt = await ctx.durable_execute_async(charge, str(ctx.key), event.amount)
        ctx.send_event(OutputEvent(output={"refunded": receipt}))


class Remember(Agent):
    """`set` keeps a value for `ttl` seconds; `read` outputs what the run sees."""

    @action(InputEvent)
    async def step(self, event: InputEvent, ctx: Any) -> None:
        if event.input["op"] == "set":
            ctx.short_term_memory.set("v", "secret", ttl=event.input["ttl"])
        else:
            ctx.send_event(
                OutputEvent(output={"n": event.input["n"], "v": ctx.short_term_memory.get("v")})
            )


class TwoSignals(Agent):
    """Waits for the signal `go` twice, then outputs both values in the order it got them (a
    signal delivered twice, lost, or out of order shows in the output). An input with
    "fail" ends its run in an error (a dead letter); so does WAITS_BROKEN=1 in the job's
    environment, once the run has taken its first `go` (a bug, fixed by running without),
    and "break": V in the input when that first value is V (for that input's run only)."""

    @action(InputEvent)
    async def wait_twice(self, event: InputEvent, ctx: Any) -> None:
        if event.input.get("fail"):
            raise ValueError(f"input of {ctx.key} asked to fail")
        first = await ctx.wait_for_signal("go")
        if os.environ.get("WAITS_BROKEN") == "1" or event.input.get("break", ...) == first:
            log(what="broken", key=str(ctx.key), first=first)
            raise ValueError(f"{ctx.key} broke after taking {first!r}")
        second = await ctx.wait_for_signal("go")
        ctx.send_event(OutputEvent(output={"key": str(ctx.key), "got": [first, second]}))


def first_time(mark: Path) -> bool:
    """Whether `mark` did not exist yet (it does now)."""
    try:
        mark.touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


class RetriedWait(Agent):
    """Waits for the signal `go`, then fails its first attempt (a transient failure: the
    attempt that finds no file `<WAITS_LOG>.failed` makes it and raises) and is tried again
    after WAITS_RETRY_DELAY seconds (default 0.05): that attempt waits for `go` again and
    outputs the value. One `go` sent must be enough: the failed attempt gives it back."""

    @action(
        InputEvent,
        retry=Retry(max_attempts=2, initial_delay=float(os.environ.get("WAITS_RETRY_DELAY", 0.05))),
    )
    async def wait_then_fail_once(self, event: InputEvent, ctx: Any) -> None:
        value = await ctx.wait_for_signal("go")
        log(what="got", key=str(ctx.key), value=value)
        if first_time(Path(os.environ["WAITS_LOG"] + ".failed")):
            raise ConnectionError(f"{ctx.key}: a transient failure after taking {value!r}")
        ctx.send_event(OutputEvent(output={"key": str(ctx.key), "got": value}))
