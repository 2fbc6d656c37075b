"""Agents whose actions mutate events: each listener must still see the event as it was sent,
live and after a crash. `watch` blocks while $VALUES_GATE names a file that does not exist."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ratchet import Agent, Event, InputEvent, OutputEvent, action


class Basket(Event):
    event_name = "values.Basket"
    items: list[int]
    meta: Any = None


class Mutating(Agent):
    @action(InputEvent, inline=True)
    def start(self, event: InputEvent, ctx: Any) -> None:
        v = event.input["v"]
        event.input["v"] += 1000  # must not reach the sibling below, the journal or a replay
        basket = Basket(items=[v], meta={"tags": ["a"]})
        ctx.send_event(basket)
        basket.items.append(-1)  # after sending: must not change what was sent
        basket.meta["tags"].append("late")

    @action(InputEvent)
    def sibling(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("sibling_saw", event.input["v"])

    @action(Basket, inline=True)
    def grab(self, event: Basket, ctx: Any) -> None:
        event.items.append(99)  # a listener mutating its own copy
        event.meta["tags"].append("grabbed")
        ctx.short_term_memory.set("grab_saw", list(event.items))

    @action(Basket)
    def watch(self, event: Basket, ctx: Any) -> None:
        gate = os.environ.get("VALUES_GATE")
        if gate:
            Path(gate + ".waiting").write_text("1")
            while not Path(gate).exists():
                time.sleep(0.02)
        ctx.send_event(OutputEvent(output={"items": event.items, "meta": event.meta}))
