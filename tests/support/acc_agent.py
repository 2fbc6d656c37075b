"""A one-action agent counting each key's inputs (memory `n`, an output `{key, n}` per input):
the source of a file the supervised-job tests write beside their state, as a user's agent."""

AGENT_SRC = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Acc(Agent):
    @action(InputEvent, inline=True)
    def acc(self, event, ctx):
        n = (ctx.short_term_memory.get("n") or 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(OutputEvent(output={"key": event.input["key"], "n": n}))
"""
