"""Agents of the DataStream test (shipped to the Python workers with env.add_python_file):
the same counter written natively and with the Apache Flink Agents compatibility API."""

from __future__ import annotations

from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, action
from ratchet.compat.flink_agents.api.agents.agent import Agent as FaAgent
from ratchet.compat.flink_agents.api.decorators import action as fa_action
from ratchet.compat.flink_agents.api.events.event import Event as FaEvent
from ratchet.compat.flink_agents.api.events.event import InputEvent as FaInputEvent
from ratchet.compat.flink_agents.api.events.event import OutputEvent as FaOutputEvent
from ratchet.compat.flink_agents.api.events.event_type import EventType
from ratchet.compat.flink_agents.api.runner_context import RunnerContext as FaContext


class NativeCounter(Agent):
    @action(InputEvent, inline=True)
    def count(self, event: InputEvent, ctx: Any) -> None:
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(OutputEvent(output={"user": event.input["user"], "n": n}))


class CompatCounter(FaAgent):
    @fa_action(EventType.InputEvent)
    @staticmethod
    def count(event: FaEvent, ctx: FaContext) -> None:
        value = FaInputEvent.from_event(event).input
        n = (ctx.short_term_memory.get("n") or 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(FaOutputEvent(output={"user": value["user"], "n": n}))
