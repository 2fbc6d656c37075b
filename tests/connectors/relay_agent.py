"""The agent the connector suites run in a real `ratchet run`: one action, one memory write,
one output per input (the benchmark's workload too)."""

from __future__ import annotations

import os
import time
from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, action


class Relay(Agent):
    """Counts the inputs of each key and passes each one on with its count: after any number
    of crashes a key's outputs must carry the counts 1..m, each once."""

    @action(InputEvent)
    def relay(self, event: InputEvent, ctx: Any) -> None:
        value = event.input
        delay = float(value.get("sleep") or 0)
        if delay:
            time.sleep(delay)
        gate = value.get("until")
        while gate and not os.path.exists(gate):  # a test holds the job here until it opens
            time.sleep(0.02)
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(OutputEvent(output={"i": value["i"], "n": n}))
