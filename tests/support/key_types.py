"""What the tests of the two keys of one text (the string "1" and the integer 1) share: an
agent that tags each output with its key's type, written to a file `ratchet run` loads, and
the CLI as a subprocess."""

from __future__ import annotations

import subprocess
import sys

RATCHET = [sys.executable, "-m", "ratchet.cli"]
TAG_AGENT = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Tag(Agent):
    @action(InputEvent)
    async def tag(self, event, ctx):
        ctx.short_term_memory.set("n", event.input["n"])
        ctx.send_event(OutputEvent(output={"type": type(ctx.key).__name__}))
"""


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RATCHET, *argv], capture_output=True, text=True, timeout=120)
