"""The agent of tests/kill/test_layout_kill.py, run by real `ratchet run` processes."""

from __future__ import annotations

import asyncio
from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, action


class Padded(Agent):
    """Counts a key's inputs and keeps a pad of the size each input names (memories small
    and large, crossing the store's inline limit either way); outputs the count and the size
    of the pad the key's previous run left (-1: none)."""

    @action(InputEvent)
    async def pad(self, event: InputEvent, ctx: Any) -> None:
        mem = ctx.short_term_memory
        n = mem.get("n", 0) + 1
        seen = len(mem.get("pad")) if mem.get("pad") is not None else -1
        mem.set("n", n)
        mem.set("pad", "p" * event.input["size"])
        await asyncio.sleep(0.002)  # a kill finds runs in flight
        ctx.send_event(OutputEvent(output={"id": event.input["id"], "n": n, "seen": seen}))
