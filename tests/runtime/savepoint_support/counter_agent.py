"""The agent the savepoint tests run in real `ratchet run` subprocesses: a counter per key.

Each input is counted by a threaded sync action (memory `count`, `sum`) and then answered by
an async one that emits the output, so checkpoints catch runs half done. An input with
`"gate": true` waits in its async step until the file named by $RATCHET_TEST_GATE exists:
a test holds one run in flight, deterministically, while it takes a savepoint. `"pad": N`
stores N bytes in the key's memory.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from ratchet import Agent, Event, InputEvent, OutputEvent, action


class Counted(Event):
    event_name = "savepointtest.Counted"
    n: int
    gate: bool = False


class Counter(Agent):
    @action(InputEvent)
    def count(self, event: InputEvent, ctx: Any) -> None:
        mem = ctx.short_term_memory
        n = mem.get("count", 0) + 1
        mem.set("count", n)
        mem.set("sum", mem.get("sum", 0) + event.input["v"])
        if event.input.get("pad"):
            mem.set("pad", "x" * event.input["pad"])  # bulk: a state big enough to take time
        ctx.send_event(Counted(n=n, gate=bool(event.input.get("gate"))))

    @action(Counted)
    async def answer(self, event: Counted, ctx: Any) -> None:
        if event.gate:
            gate = Path(os.environ.get("RATCHET_TEST_GATE", "/nonexistent/gate"))
            # Polls a file another process creates: no event to wait on.
            while not gate.exists():  # noqa: ASYNC110, ASYNC240
                await asyncio.sleep(0.01)
        else:
            await asyncio.sleep(0.001)
        ctx.send_event(OutputEvent(output={"n": event.n}))
