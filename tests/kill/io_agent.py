"""The agent the connector kill tests run in a real `ratchet run` subprocess."""

from __future__ import annotations

import time
from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, action


class Relay(Agent):
    """Passes each input on; an input with `"bad": true` gets an output JSON cannot hold (a
    dict with a tuple key: the codec stores it, the JSONL sink cannot write it)."""

    @action(InputEvent)
    def relay(self, event: InputEvent, ctx: Any) -> None:
        value = event.input
        time.sleep(float(value.get("sleep", 0)))
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        if value.get("bad"):
            ctx.send_event(OutputEvent(output={"i": value["i"], "pairs": {(value["i"], n): 1}}))
        else:
            ctx.send_event(OutputEvent(output={"i": value["i"], "n": n}))
