"""The agent the golden journals were recorded with, and a changed version that no longer fits.

`decide`'s second durable call blocks while $GOLDEN_GATE names a file that does not exist and
the input is the one named by $GOLDEN_BLOCK_V: that is how `make_golden.py` holds a run in
flight (its first tasks journaled, one call returned, one in flight) at a checkpoint.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ratchet import Agent, Event, InputEvent, OutputEvent, action


class Step(Event):
    event_name = "golden.Step"
    n: int


class Checked(Event):
    event_name = "golden.Checked"
    n: int
    square: int


def lookup(v: int) -> dict[str, int]:
    return {"v": v, "square": v * v}


def screen(v: int) -> str:
    # $GOLDEN_SCREEN changes the answer: a replay that still shows the recorded one did not call.
    return os.environ.get("GOLDEN_SCREEN") or ("low" if v < 5 else "high")


def approve(v: int) -> bool:
    gate = os.environ.get("GOLDEN_GATE")
    if gate and str(v) == os.environ.get("GOLDEN_BLOCK_V"):
        Path(gate + ".waiting").write_text("1")
        while not Path(gate).exists():
            time.sleep(0.02)
    return v % 2 == 0


class GoldenAgent(Agent):
    @action(InputEvent)
    def start(self, event: InputEvent, ctx: Any) -> None:
        v = event.input["v"]
        mem = ctx.short_term_memory
        mem.set("count", mem.get("count", 0) + 1)
        mem.set("history", [*mem.get("history", []), v])
        mem.set("blob", mem.get("blob", b"") + bytes([v % 256]))
        ctx.send_event(Step(n=v))

    @action(Step)
    async def enrich(self, event: Step, ctx: Any) -> None:
        found = await ctx.durable_execute_async(lookup, event.n)
        ctx.sensory_memory.set("square", found["square"])
        ctx.send_event(Checked(n=event.n, square=found["square"]))

    @action(Checked)
    def decide(self, event: Checked, ctx: Any) -> None:
        band = ctx.durable_execute(screen, event.n)
        ok = ctx.durable_execute(approve, event.n)
        mem = ctx.short_term_memory
        mem.set("approved", mem.get("approved", 0) + (1 if ok else 0))
        ctx.send_event(
            OutputEvent(
                output={
                    "v": event.n,
                    "band": band,
                    "ok": ok,
                    "square": ctx.sensory_memory.get("square"),
                    "count": mem.get("count"),
                }
            )
        )


def screen_v2(v: int) -> str:
    return "medium"


class ChangedCallAgent(GoldenAgent):
    """`decide` now makes a different first durable call: a journal it cannot replay."""

    @action(Checked)
    def decide(self, event: Checked, ctx: Any) -> None:
        ctx.durable_execute(screen_v2, event.n)
        ctx.send_event(OutputEvent(output={"v": event.n}))


class NoEnrichAgent(Agent):
    """`enrich` was removed: the journaled task `enrich` of the run in flight is never reached."""

    @action(InputEvent)
    def start(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(Step(n=event.input["v"]))
