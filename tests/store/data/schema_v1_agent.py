"""The agent that wrote `schema_v1/ratchet.db`, and that resumes it in `test_migrations.py`.

Two steps per input: `tally` (a threaded sync action) counts into the key's memory, `quote`
(async) makes one durable call and emits the output. With `SCHEMA_V1_HOLD=<marker path>` in
the environment, `quote` of an input marked `"hold": true` touches the marker after its
durable call returned and then waits to be killed: that is how the state got its in-flight
run. Without it, the same input completes (what the resume test relies on).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from ratchet import Agent, Event, InputEvent, OutputEvent, action

# Every real call behind a durable call, in this process (the resume test reads it).
PRICED: list[int] = []


class Tallied(Event):
    event_name = "schemav1.Tallied"
    value: int
    hold: bool = False


def price(value: int) -> int:
    PRICED.append(value)
    return value * 10 + 1


class SchemaV1Agent(Agent):
    @action(InputEvent)
    def tally(self, event: InputEvent, ctx: Any) -> None:
        mem = ctx.short_term_memory
        mem.set("count", mem.get("count", 0) + 1)
        mem.set("total", mem.get("total", 0) + event.input["value"])
        ctx.send_event(Tallied(value=event.input["value"], hold=event.input.get("hold", False)))

    @action(Tallied)
    async def quote(self, event: Tallied, ctx: Any) -> None:
        p = await ctx.durable_execute_async(price, event.value)
        marker = os.environ.get("SCHEMA_V1_HOLD")
        if event.hold and marker:
            await asyncio.to_thread(Path(marker).touch)
            await asyncio.sleep(3600)  # killed here
        ctx.short_term_memory.set("last_price", p)
        ctx.send_event(OutputEvent(output={"value": event.value, "price": p}))
