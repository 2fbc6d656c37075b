"""An inline agent (its runs pure Python in the engine's thread, as a busy job's are), loaded
by spec by tests that run shard workers."""

from __future__ import annotations

from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, action


class Inline(Agent):
    @action(InputEvent, inline=True)
    def one(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("i", event.input["i"])
        ctx.send_event(OutputEvent(output={"i": event.input["i"]}))
