"""The built-in event types' strings, for `@action(EventType.InputEvent)` and the like."""

from __future__ import annotations

from ratchet.compat.flink_agents.api.events.chat_event import ChatRequestEvent, ChatResponseEvent
from ratchet.compat.flink_agents.api.events.event import InputEvent, OutputEvent
from ratchet.compat.flink_agents.api.events.tool_event import ToolRequestEvent, ToolResponseEvent


class EventType:
    """Type strings of the built-in events."""

    InputEvent: str = InputEvent.EVENT_TYPE
    OutputEvent: str = OutputEvent.EVENT_TYPE
    ChatRequestEvent: str = ChatRequestEvent.EVENT_TYPE
    ChatResponseEvent: str = ChatResponseEvent.EVENT_TYPE
    ToolRequestEvent: str = ToolRequestEvent.EVENT_TYPE
    ToolResponseEvent: str = ToolResponseEvent.EVENT_TYPE
    ContextRetrievalRequestEvent: str = "_context_retrieval_request_event"
    ContextRetrievalResponseEvent: str = "_context_retrieval_response_event"
