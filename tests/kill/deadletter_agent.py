"""The agent of tests/kill/test_dead_letters.py: an input with "poison" fails unless the file
named by FIXED_FLAG exists (the fix deployed); CHARGES counts the side effect of good runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, action


def charge(n: int) -> int:
    with open(os.environ["CHARGES"], "a") as fh:
        fh.write(f"{n}\n")
    return n


class Payments(Agent):
    @action(InputEvent)
    def pay(self, event: InputEvent, ctx: Any) -> None:
        value = event.input
        if value.get("poison") and not Path(os.environ["FIXED_FLAG"]).exists():
            raise ValueError(f"cannot pay {value['n']}: amount missing")
        ctx.durable_execute(charge, value["n"])
        ctx.short_term_memory.set("paid", ctx.short_term_memory.get("paid", 0) + 1)
        ctx.send_event(OutputEvent(output={"paid": value["n"]}))
