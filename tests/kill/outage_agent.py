"""The agent of tests/kill/test_outage.py: each input is one call to a local HTTP service
(SERVICE_URL) that the test takes down and brings back."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, Resource, Retry, action


def unavailable(exc: BaseException) -> bool:
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code == 429 or exc.code >= 500
    return isinstance(exc, OSError | TimeoutError)


SERVICE = Resource("scoring-service", transient=unavailable, probe_delay=0.2, max_probe_delay=1.0)


def score(n: int) -> int:
    with urllib.request.urlopen(f"{os.environ['SERVICE_URL']}/score/{n}", timeout=5) as resp:
        return int(json.loads(resp.read())["score"])


class Scorer(Agent):
    @action(InputEvent)
    async def score(self, event: InputEvent, ctx: Any) -> None:
        n = event.input["n"]
        got = await ctx.durable_execute_async(
            score, n, retry=Retry(max_attempts=2, initial_delay=0.05), resource=SERVICE
        )
        ctx.short_term_memory.set("scored", ctx.short_term_memory.get("scored", 0) + 1)
        ctx.send_event(OutputEvent(output={"n": n, "score": got}))
