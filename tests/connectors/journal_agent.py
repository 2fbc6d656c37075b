"""An agent for the PostgreSQL call journal's test: a call that returns, then one that parks."""

from __future__ import annotations

import threading
from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, action

COUNTS: dict[str, int] = {}
GATE = threading.Event()
ENTERED = threading.Event()


def reset() -> None:
    COUNTS.clear()
    GATE.clear()
    ENTERED.clear()


def quote(v: int) -> int:
    COUNTS["quote"] = COUNTS.get("quote", 0) + 1
    return v * 10


def parked(v: int) -> int:
    COUNTS["parked"] = COUNTS.get("parked", 0) + 1
    ENTERED.set()
    GATE.wait(30)
    return v + 1000


class Parks(Agent):
    @action(InputEvent)
    async def handle(self, event: InputEvent, ctx: Any) -> None:
        v = event.input["v"]
        q = await ctx.durable_execute_async(quote, v)
        t = await ctx.durable_execute_async(parked, v)
        ctx.send_event(OutputEvent(output={"quote": q, "parked": t}))
