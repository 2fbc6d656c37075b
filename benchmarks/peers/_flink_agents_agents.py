"""The Flink Agents 0.2.0 agents (an importable module: Pemja loads the actions by module name)."""

from __future__ import annotations

import os
import time
from typing import Any

from flink_agents.api.agents.agent import Agent
from flink_agents.api.decorators import action
from flink_agents.api.events.event import Event, InputEvent, OutputEvent
from flink_agents.api.runner_context import RunnerContext


class Mid(Event):
    v: int


class Last(Event):
    v: int


class ThreeSteps(Agent):
    """Workload 1: an event, a per-key memory write, an output."""

    @action(InputEvent)
    @staticmethod
    def one(event: Event, ctx: RunnerContext) -> None:
        ctx.send_event(Mid(v=event.input["v"]))

    @action(Mid)
    @staticmethod
    def two(event: Event, ctx: RunnerContext) -> None:
        ctx.short_term_memory.set("v", event.v)
        ctx.send_event(Last(v=event.v))

    @action(Last)
    @staticmethod
    def three(event: Event, ctx: RunnerContext) -> None:
        ctx.send_event(OutputEvent(output={"id": f"i{event.v}", "v": event.v}))


def simulated_model(v: int) -> str:
    time.sleep(0.05)
    return f"answer {v}"


class SlowCall(Agent):
    """Workload 2: one 50 ms model call through durable_execute_async."""

    @action(InputEvent)
    @staticmethod
    async def call(event: Event, ctx: RunnerContext) -> None:
        answer = await ctx.durable_execute_async(simulated_model, event.input["v"])
        stm = ctx.short_term_memory
        stm.set("n", (stm.get("n") or 0) + 1)
        ctx.send_event(OutputEvent(output={"id": event.input["id"], "answer": answer}))


_client: Any = None


def ask_model(url: str, iid: str, n: int) -> str:
    global _client
    if _client is None:
        import _common

        _client = _common.SyncModelClient(url)
    return str(_client.call(iid, n))


class TwoCalls(Agent):
    """Workload 3: two model calls over HTTP, each durable, then an output."""

    @action(InputEvent)
    @staticmethod
    async def ask(event: Event, ctx: RunnerContext) -> None:
        url = os.environ["PEER_MODEL_URL"]
        first = await ctx.durable_execute_async(ask_model, url, event.input["id"], 1)
        second = await ctx.durable_execute_async(ask_model, url, event.input["id"], 2)
        ctx.short_term_memory.set("last", event.input["id"])
        ctx.send_event(OutputEvent(output={"id": event.input["id"], "answers": [first, second]}))


class Keyed(Agent):
    """Workload 4: a counter and a profile per key."""

    @action(InputEvent)
    @staticmethod
    def keep(event: Event, ctx: RunnerContext) -> None:
        stm = ctx.short_term_memory
        stm.set("count", (stm.get("count") or 0) + 1)
        stm.set("profile", {"name": f"customer {event.input['key']}", "tier": event.input["v"] % 3})
        ctx.send_event(OutputEvent(output={"id": event.input["id"]}))
