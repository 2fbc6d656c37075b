"""Chat messages as Flink Agents shapes them: a role, text, tool calls as dicts, extra args."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, Field

from ratchet.store import codec


class MessageRole(str, Enum):  # noqa: UP042 - their type: a str subclass
    """Who a message is from: the system prompt, the user, the model, or a tool's result."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class ChatMessage(BaseModel):
    """One message; `tool_calls` are dicts `{"id", "type", "function": {"name", "arguments"}}`."""

    role: MessageRole = MessageRole.USER
    content: str = Field(default_factory=str)
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    extra_args: dict[str, Any] = Field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.role.value}: {self.content}"


def find_first_system_message(messages: list[ChatMessage]) -> int:
    """The index of the first SYSTEM message, or -1."""
    for i, message in enumerate(messages):
        if message.role == MessageRole.SYSTEM:
            return i
    return -1


codec.register(MessageRole, "flink_agents.MessageRole")
codec.register(ChatMessage, "flink_agents.ChatMessage")
