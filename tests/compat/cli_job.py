"""A Flink Agents agent turned into a ratchet agent, for `ratchet run cli_job:agent`."""

from ratchet.compat.flink_agents import to_ratchet
from ratchet.compat.flink_agents.api.agents.agent import Agent
from ratchet.compat.flink_agents.api.decorators import action
from ratchet.compat.flink_agents.api.events.event import Event, InputEvent, OutputEvent
from ratchet.compat.flink_agents.api.events.event_type import EventType
from ratchet.compat.flink_agents.api.runner_context import RunnerContext


class Counter(Agent):
    @action(EventType.InputEvent)
    @staticmethod
    def count(event: Event, ctx: RunnerContext) -> None:
        record = InputEvent.from_event(event).input
        n = (ctx.short_term_memory.get("n") or 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(Event(type="counted", attributes={"line": f"{record['word']}={n}"}))

    @action("counted")
    @staticmethod
    def emit(event: Event, ctx: RunnerContext) -> None:
        ctx.send_event(OutputEvent(output=event.get_attr("line")))


agent = to_ratchet(Counter())
