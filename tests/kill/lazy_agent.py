"""The agent of tests/kill/test_lazy_restore_kill.py, run by real `ratchet run` processes.
Durable calls log to the file named by LAZY_LOG (outside the state), one JSON line each."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, action


def log(**fields: Any) -> None:
    fields["pid"] = os.getpid()
    with open(os.environ["LAZY_LOG"], "a") as fh:
        fh.write(json.dumps(fields) + "\n")


async def stamp(iid: str) -> str:
    """A slow external call: the test counts how often each input's call began and ended."""
    log(what="begin", id=iid)
    await asyncio.sleep(0.3)
    token = f"{iid}@{os.getpid()}"
    log(what="end", id=iid, token=token)
    return token


class Tally(Agent):
    """Counts a key's inputs in its memory; an input may first wait for the signal `go`
    and/or make one durable call; outputs the count the run saw."""

    @action(InputEvent)
    async def count(self, event: InputEvent, ctx: Any) -> None:
        inp = event.input
        mem = ctx.short_term_memory
        n = mem.get("n", 0) + 1
        mem.set("n", n)
        out: dict[str, Any] = {"key": inp["key"], "id": inp["id"], "n": n}
        if inp.get("wait"):
            out["signal"] = (await ctx.wait_for_signal("go"))["v"]
        if inp.get("call"):
            out["token"] = await ctx.durable_execute_async(stamp, inp["id"])
        ctx.send_event(OutputEvent(output=out))
