"""Agents and resources for the compat tests (importable: resources are found by dotted path)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel

from ratchet.compat.flink_agents.api.agents.agent import Agent
from ratchet.compat.flink_agents.api.chat_message import ChatMessage, MessageRole
from ratchet.compat.flink_agents.api.chat_models.chat_model import (
    BaseChatModelConnection,
    BaseChatModelSetup,
)
from ratchet.compat.flink_agents.api.decorators import (
    action,
    chat_model_connection,
    chat_model_setup,
    prompt,
    tool,
)
from ratchet.compat.flink_agents.api.events.chat_event import ChatRequestEvent, ChatResponseEvent
from ratchet.compat.flink_agents.api.events.event import Event, InputEvent, OutputEvent
from ratchet.compat.flink_agents.api.events.event_type import EventType
from ratchet.compat.flink_agents.api.prompts.prompt import Prompt
from ratchet.compat.flink_agents.api.resource import ResourceDescriptor
from ratchet.compat.flink_agents.api.runner_context import RunnerContext
from ratchet.compat.flink_agents.api.tools.tool import ToolType

MODEL_CALLS: list[int] = []


class Parcel(BaseModel):
    label: str
    grams: int


class Weighed(Event):
    EVENT_TYPE: ClassVar[str] = "weighed"

    def __init__(self, parcel: Parcel) -> None:
        super().__init__(type=Weighed.EVENT_TYPE, attributes={"parcel": parcel})


class ParcelAgent(Agent):
    """Input -> a typed event carrying a pydantic model -> a string-typed event -> output."""

    @action(EventType.InputEvent)
    @staticmethod
    def weigh(event: Event, ctx: RunnerContext) -> None:
        text = InputEvent.from_event(event).input
        ctx.send_event(Weighed(Parcel(label=text, grams=len(text) * 100)))

    @action(Weighed.EVENT_TYPE)
    @staticmethod
    def route(event: Event, ctx: RunnerContext) -> None:
        assert isinstance(event, Weighed)
        parcel = event.get_attr("parcel")
        assert isinstance(parcel, Parcel)
        ctx.send_event(Event(type="routed", attributes={"to": parcel.label.upper()}))

    @action("routed")
    @staticmethod
    def done(event: Event, ctx: RunnerContext) -> None:
        ctx.send_event(OutputEvent(output=event.get_attr("to")))


class EchoConnection(BaseChatModelConnection):
    """Asks for the `double` tool once, then answers with the tool's result."""

    def chat(
        self, messages: Sequence[ChatMessage], tools: list[Any] | None = None, **kwargs: Any
    ) -> ChatMessage:
        MODEL_CALLS.append(len(messages))
        last = messages[-1]
        if last.role == MessageRole.TOOL:
            return ChatMessage(role=MessageRole.ASSISTANT, content=f"result {last.content}")
        names = [t.name for t in tools or []]
        call = {
            "id": "call-1",
            "type": ToolType.FUNCTION,
            "function": {"name": names[0], "arguments": {"n": len(last.content)}},
        }
        system = [m.content for m in messages if m.role == MessageRole.SYSTEM]
        return ChatMessage(
            role=MessageRole.ASSISTANT, content="", tool_calls=[call], extra_args={"sys": system}
        )


class EchoSetup(BaseChatModelSetup):
    pass


class ToolAgent(Agent):
    @chat_model_connection
    @staticmethod
    def echo() -> ResourceDescriptor:
        return ResourceDescriptor(clazz=f"{__name__}.EchoConnection")

    @prompt
    @staticmethod
    def style() -> Prompt:
        return Prompt.from_text("be {tone}, {unknown} stays")

    @chat_model_setup
    @staticmethod
    def model() -> ResourceDescriptor:
        return ResourceDescriptor(
            clazz=f"{__name__}.EchoSetup", connection="echo", prompt="style", tools=["double"]
        )

    @tool(injected_args={"factor": {"source": "config", "key": "factor"}})
    @staticmethod
    def double(n: int, factor: int) -> int:
        """Multiply n by the configured factor."""
        return n * factor

    @action(EventType.InputEvent)
    @staticmethod
    def ask(event: Event, ctx: RunnerContext) -> None:
        text = InputEvent.from_event(event).input
        ctx.send_event(
            ChatRequestEvent(
                model="model",
                messages=[ChatMessage(role=MessageRole.USER, content=text)],
                prompt_args={"tone": "brief"},
            )
        )

    @action(EventType.ChatResponseEvent)
    @staticmethod
    def answer(event: Event, ctx: RunnerContext) -> None:
        ctx.send_event(OutputEvent(output=ChatResponseEvent.from_event(event).response.content))
