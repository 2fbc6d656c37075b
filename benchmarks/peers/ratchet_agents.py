"""ratchet's side of the five workloads: the agents (importable, so the CLI can load them)."""

from __future__ import annotations

import asyncio
import os

import _common

from ratchet import Agent, Event, InputEvent, OutputEvent, RunnerContext, action


class Mid(Event):
    event_name = "peers.Mid"
    v: int


class Last(Event):
    event_name = "peers.Last"
    v: int


class ThreeSteps(Agent):
    """Workload 1: an event, a per-key memory write, an output."""

    @action(InputEvent, inline=True)
    def one(self, event: InputEvent, ctx: RunnerContext) -> None:
        ctx.send_event(Mid(v=event.input["v"]))

    @action(Mid, inline=True)
    def two(self, event: Mid, ctx: RunnerContext) -> None:
        ctx.short_term_memory.set("v", event.v)
        ctx.send_event(Last(v=event.v))

    @action(Last, inline=True)
    def three(self, event: Last, ctx: RunnerContext) -> None:
        ctx.send_event(OutputEvent(output={"id": f"i{event.v}", "v": event.v}))


async def simulated_model(v: int) -> str:
    await asyncio.sleep(0.05)
    return f"answer {v}"


class SlowCall(Agent):
    """Workload 2: one 50 ms model call, recorded like any model call."""

    @action(InputEvent)
    async def call(self, event: InputEvent, ctx: RunnerContext) -> None:
        answer = await ctx.durable_execute_async(simulated_model, event.input["v"])
        ctx.short_term_memory.set("n", ctx.short_term_memory.get("n", 0) + 1)
        ctx.send_event(OutputEvent(output={"id": event.input["id"], "answer": answer}))


_client: _common.AsyncModelClient | None = None


async def ask_model(url: str, iid: str, call: int) -> str:
    """One request to the counting model server."""
    global _client
    if _client is None:
        _client = _common.AsyncModelClient(url)
    return await _client.call(iid, call)


class TwoCalls(Agent):
    """Workload 3: two model calls over HTTP, each durable, then an output."""

    @action(InputEvent)
    async def ask(self, event: InputEvent, ctx: RunnerContext) -> None:
        url = os.environ["PEER_MODEL_URL"]
        first = await ctx.durable_execute_async(ask_model, url, event.input["id"], 1)
        second = await ctx.durable_execute_async(ask_model, url, event.input["id"], 2)
        ctx.short_term_memory.set("last", event.input["id"])
        ctx.send_event(OutputEvent(output={"id": event.input["id"], "answers": [first, second]}))


class Keyed(Agent):
    """Workload 4: a counter and a profile per key."""

    @action(InputEvent, inline=True)
    def keep(self, event: InputEvent, ctx: RunnerContext) -> None:
        m = ctx.short_term_memory
        m.set("count", m.get("count", 0) + 1)
        m.set("profile", {"name": f"customer {event.input['key']}", "tier": event.input["v"] % 3})
        ctx.send_event(OutputEvent(output={"id": event.input["id"]}))
