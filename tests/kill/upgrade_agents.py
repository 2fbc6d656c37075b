"""Versions of one agent, run by `ratchet run` subprocesses in tests/kill/test_upgrade.py.

Side effects go to files named by environment variables (outside the state), so a test can
count what really ran: UPGRADE_LOG (one JSON line per action run or call made),
UPGRADE_MIGRATIONS (one line per migration run), UPGRADE_STUCK (while this file exists, the
`slow` action of a key listed in it parks after its durable call returned), UPGRADE_FAIL
(while this file exists, the model `Asks` calls answers 503).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from ratchet import Agent, Event, InputEvent, OutputEvent, Retry, action, migration


class Mid(Event):
    n: int


def log(**fields: Any) -> None:
    path = os.environ.get("UPGRADE_LOG")
    if path:
        fields["phase"] = os.environ.get("UPGRADE_PHASE")
        with open(path, "a") as fh:
            fh.write(json.dumps(fields) + "\n")


def stuck(key: str) -> bool:
    path = os.environ.get("UPGRADE_STUCK")
    return bool(path) and Path(path).exists() and key in Path(path).read_text().split()


async def pay(key: str, n: int, currency: str = "USD") -> dict[str, Any]:
    log(what="pay", key=key, n=n, currency=currency)
    await asyncio.sleep(0.01)
    return {"paid": n, "currency": currency}


class V1(Agent):
    """ingest counts inputs per key in `count` and emits Mid; slow pays and outputs; audit notes."""

    @action(InputEvent)
    async def ingest(self, event: InputEvent, ctx: Any) -> None:
        m = ctx.short_term_memory
        m.set("count", m.get("count", 0) + 1)
        ctx.send_event(Mid(n=event.input["n"]))

    @action(Mid)
    async def slow(self, event: Mid, ctx: Any) -> None:
        receipt = await ctx.durable_execute_async(pay, str(ctx.key), event.n)
        if stuck(str(ctx.key)):
            await asyncio.sleep(3600)  # parked with its call returned, until the kill
        log(what="slow", version=1, key=str(ctx.key), n=event.n)
        ctx.send_event(OutputEvent(output={"n": event.n, "paid": receipt, "by": 1}))

    @action(Mid)
    async def audit(self, event: Mid, ctx: Any) -> None:
        log(what="audit", key=str(ctx.key), n=event.n)
        ctx.short_term_memory.set("audited", event.n)


def count_of(ctx: Any) -> str:
    """Where the input count lives in the memory this task sees."""
    return "count" if ctx.memory_version == 1 else "stats.total"


class V2(Agent):
    """Version 2: `count` moved to `stats.total` (a migration), `audit` removed, `tag` added
    before `slow`, and `slow`'s body changed (it labels its output)."""

    memory_version = 2

    @migration(1)
    def nest_the_count(self, memory: Any) -> None:
        with open(os.environ["UPGRADE_MIGRATIONS"], "a") as fh:
            fh.write(json.dumps({"count": memory.get("count")}) + "\n")
        stats = memory.new_object("stats")
        stats.set("total", memory.get("count", 0))
        memory.delete("count")
        memory.delete("audited")

    @action(InputEvent)
    async def ingest(self, event: InputEvent, ctx: Any) -> None:
        m = ctx.short_term_memory
        path = count_of(ctx)
        m.set(path, m.get(path, 0) + 1)
        ctx.send_event(Mid(n=event.input["n"]))

    @action(Mid)
    async def tag(self, event: Mid, ctx: Any) -> None:
        log(what="tag", key=str(ctx.key), n=event.n)

    @action(Mid)
    async def slow(self, event: Mid, ctx: Any) -> None:
        receipt = await ctx.durable_execute_async(pay, str(ctx.key), event.n)
        log(what="slow", version=2, key=str(ctx.key), n=event.n)
        ctx.send_event(OutputEvent(output={"n": event.n, "paid": receipt, "by": 2}))


class V2Euro(V1):
    """A body change a recorded call cannot replay: `slow` now pays in EUR (other arguments)."""

    @action(Mid)
    async def slow(self, event: Mid, ctx: Any) -> None:
        receipt = await ctx.durable_execute_async(pay, str(ctx.key), event.n, "EUR")
        log(what="slow", version=2, key=str(ctx.key), n=event.n)
        ctx.send_event(OutputEvent(output={"n": event.n, "paid": receipt, "by": 2}))


class V2EuroPatched(V1):
    """The same change behind `ctx.patched`: recorded runs keep paying in USD."""

    @action(Mid)
    async def slow(self, event: Mid, ctx: Any) -> None:
        if ctx.patched("pay-in-euro"):
            receipt = await ctx.durable_execute_async(pay, str(ctx.key), event.n, "EUR")
        else:
            receipt = await ctx.durable_execute_async(pay, str(ctx.key), event.n)
        log(what="slow", version=2, key=str(ctx.key), n=event.n)
        ctx.send_event(OutputEvent(output={"n": event.n, "paid": receipt, "by": 2}))


class V2EuroParks(V1):
    """V2Euro that parks after its new (EUR) call, while UPGRADE_STUCK lists the key: a kill
    there leaves a refused-to-be attempt's records in the state."""

    @action(Mid)
    async def slow(self, event: Mid, ctx: Any) -> None:
        receipt = await ctx.durable_execute_async(pay, str(ctx.key), event.n, "EUR")
        if stuck(str(ctx.key)):
            await asyncio.sleep(3600)
        ctx.send_event(OutputEvent(output={"n": event.n, "paid": receipt, "by": 2}))


class V2NoSlow(Agent):
    """`slow` removed while a task of it had made its call: refused at start."""

    @action(InputEvent)
    async def ingest(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("count", ctx.short_term_memory.get("count", 0) + 1)
        ctx.send_event(OutputEvent(output={"n": event.input["n"], "by": 2}))

    @action(Mid)
    async def audit(self, event: Mid, ctx: Any) -> None:
        ctx.short_term_memory.set("audited", event.n)


# The shape of `Later` in this process: UPGRADE_LATER="m" adds a required field, "m=0" the
# same field with a default (what a run holding a stored Later needs), "typeerror" a
# validator that raises TypeError for the stored one.
if os.environ.get("UPGRADE_LATER") == "m":

    class Later(Event):
        n: int
        m: int

elif os.environ.get("UPGRADE_LATER") == "typeerror":
    from pydantic import field_validator

    class Later(Event):  # type: ignore[no-redef]
        n: int

        @field_validator("n")
        @classmethod
        def _no_seven(cls, v: int) -> int:
            if v == 7:  # pydantic passes a TypeError on, not as a ValidationError
                raise TypeError("n may not be 7 any more")
            return v

elif os.environ.get("UPGRADE_LATER") == "m=0":

    class Later(Event):  # type: ignore[no-redef]
        n: int
        m: int = 0

else:

    class Later(Event):  # type: ignore[no-redef]
        n: int


class Delays(Agent):
    """Pays, then sends itself Later after the input's `delay` seconds; Later outputs."""

    @action(InputEvent)
    async def ingest(self, event: InputEvent, ctx: Any) -> None:
        await ctx.durable_execute_async(pay, str(ctx.key), event.input["n"])
        ctx.send_event(Later(n=event.input["n"]), delay=float(event.input["delay"]))

    @action(Later)
    async def later(self, event: Later, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output={"n": event.n, "m": getattr(event, "m", None)}))


class Counter(Agent):
    """For `ratchet migrate` under kills: one memory field per key."""

    @action(InputEvent)
    def count(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("count", ctx.short_term_memory.get("count", 0) + 1)


class CounterV2(Counter):
    memory_version = 2

    @migration(1)
    def rename(self, memory: Any) -> None:
        import time

        with open(os.environ["UPGRADE_MIGRATIONS"], "a") as fh:
            fh.write(json.dumps({"count": memory.get("count")}) + "\n")
        time.sleep(0.002)  # slow enough that a kill lands in the middle
        memory.set("total", memory.get("count"))
        memory.set("migrations", memory.get("migrations", 0) + 1)
        memory.delete("count")

    @action(InputEvent)
    def count(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("total", ctx.short_term_memory.get("total", 0) + 1)


class CounterV2Broken(Counter):
    memory_version = 2

    @migration(1)
    def rename(self, memory: Any) -> None:
        if memory.get("count") == 3:
            raise ValueError("cannot migrate a count of 3")
        memory.set("total", memory.get("count"))
        memory.delete("count")


class CounterV3Gap(Counter):
    """memory_version 3 with no @migration(2): `ratchet migrate` cannot proceed."""

    memory_version = 3

    @migration(1)
    def rename(self, memory: Any) -> None:
        memory.set("total", memory.get("count"))


class Approved(Event):
    v: Any = None


class Approves(Agent):
    """Waits for the signal "go", then `after` outputs its value."""

    @action(InputEvent)
    async def wait(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(Approved(v=await ctx.wait_for_signal("go")))

    @action(Approved)
    async def after(self, event: Approved, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output={"v": event.v}))


class ApprovesRenamed(Agent):
    """`after` renamed: a run pinned to Approves sends Approved to nobody."""

    @action(InputEvent)
    async def wait(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(Approved(v=await ctx.wait_for_signal("go")))

    @action(Approved)
    async def after_renamed(self, event: Approved, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output={"v": event.v}))


async def pay_then_go(event: InputEvent, ctx: Any) -> None:
    n = event.input["n"]
    receipt = await ctx.durable_execute_async(pay, str(ctx.key), n)
    go = await ctx.wait_for_signal("go")
    ctx.send_event(OutputEvent(output={"n": n, "paid": receipt, "go": go, "by": 1}))


class Gate(Agent):
    """Pays for the input, then waits for the signal "go" (runs in flight park there)."""

    @action(InputEvent)
    async def gate(self, event: InputEvent, ctx: Any) -> None:
        await pay_then_go(event, ctx)


class GateApproveFirst(Gate):
    """A body a run parked in Gate cannot replay: it waits for a new signal, "approve", then
    pays in EUR (the recorded USD payment is not made again): refused at the task's end,
    after its new wait took the signal. While UPGRADE_STUCK lists the key it parks right
    after the signal arrived (a kill there leaves the attempt's records)."""

    @action(InputEvent)
    async def gate(self, event: InputEvent, ctx: Any) -> None:
        n = event.input["n"]
        approval = await ctx.wait_for_signal("approve")
        log(what="approved", key=str(ctx.key), n=n, approval=approval)
        if stuck(str(ctx.key)):
            await asyncio.sleep(3600)
        receipt = await ctx.durable_execute_async(pay, str(ctx.key), n, "EUR")
        ctx.send_event(OutputEvent(output={"n": n, "paid": receipt, "approval": approval}))


class GatePatched(Gate):
    """GateApproveFirst behind `ctx.patched`: runs recorded by Gate keep Gate's path."""

    @action(InputEvent)
    async def gate(self, event: InputEvent, ctx: Any) -> None:
        n = event.input["n"]
        if not ctx.patched("approve-first"):
            await pay_then_go(event, ctx)
            return
        approval = await ctx.wait_for_signal("approve")
        receipt = await ctx.durable_execute_async(pay, str(ctx.key), n, "EUR")
        ctx.send_event(OutputEvent(output={"n": n, "paid": receipt, "approval": approval, "by": 2}))


def ask_model(key: str, n: int) -> str:
    """A model that answers 503 while the file UPGRADE_FAIL exists."""
    log(what="ask", key=key, n=n)
    if Path(os.environ.get("UPGRADE_FAIL") or "/nonexistent").exists():
        raise RuntimeError("503 Service Unavailable")
    return f"answer {n}"


# Attempts at 0 and 0.2 s, then a 1 s backoff (where a test kills the job).
ASK_RETRY = Retry(max_attempts=4, initial_delay=0.2, backoff=5)


class Asks(Agent):
    """`ask` calls the model with a retry policy, and outputs its answer; `count` counts."""

    @action(InputEvent)
    def count(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("count", ctx.short_term_memory.get("count", 0) + 1)

    @action(InputEvent, retry=ASK_RETRY)
    async def ask(self, event: InputEvent, ctx: Any) -> None:
        answer = await ctx.durable_execute_async(ask_model, str(ctx.key), event.input["n"])
        ctx.send_event(OutputEvent(output={"n": event.input["n"], "answer": answer}))


class AsksAudited(Asks):
    """A compatible change: an action added."""

    @action(InputEvent)
    def audit(self, event: InputEvent, ctx: Any) -> None:
        log(what="audit", key=str(ctx.key), n=event.input["n"])


class AsksMid(Asks):
    """A compatible change: `ask` also listens to Mid (its body is the same)."""

    @action(InputEvent, Mid, retry=ASK_RETRY)
    async def ask(self, event: InputEvent, ctx: Any) -> None:
        answer = await ctx.durable_execute_async(ask_model, str(ctx.key), event.input["n"])
        ctx.send_event(OutputEvent(output={"n": event.input["n"], "answer": answer}))


class AsksGone(Agent):
    """`ask` removed: a run with its calls recorded is refused at start."""

    @action(InputEvent)
    def count(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("count", ctx.short_term_memory.get("count", 0) + 1)
