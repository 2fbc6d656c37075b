"""Chat messages, tool calls and token usage: registered with the codec, so they live in memory
and journals with their exact types."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ratchet.store import codec


class MessageRole(StrEnum):
    """Who a message is from (the names Flink Agents uses)."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class TokenUsage(BaseModel):
    """Tokens one or more model calls consumed, as the provider reported them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
        )


class ToolCall(BaseModel):
    """One tool invocation the model asked for; `id` pairs it with its result message."""

    model_config = ConfigDict(extra="forbid")

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ChatMessage(BaseModel):
    """One message of a conversation.

    `tool_calls` is set on assistant messages that ask for tools; `tool_call_id` (and `name`,
    the tool's name) on the tool message answering one. `extras` carries provider-specific
    data (e.g. `is_error` on a failed tool's result, `finish_reason`); `usage` is what the
    call that produced an assistant message cost.
    """

    model_config = ConfigDict(extra="forbid")

    role: MessageRole
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    extras: dict[str, Any] = Field(default_factory=dict)
    usage: TokenUsage | None = None

    @classmethod
    def system(cls, content: str) -> ChatMessage:
        return cls(role=MessageRole.SYSTEM, content=content)

    @classmethod
    def user(cls, content: str) -> ChatMessage:
        return cls(role=MessageRole.USER, content=content)

    @classmethod
    def assistant(cls, content: str = "", tool_calls: list[ToolCall] | None = None) -> ChatMessage:
        return cls(role=MessageRole.ASSISTANT, content=content, tool_calls=tool_calls or [])

    @property
    def is_error(self) -> bool:
        """True on a tool message that reports a failed or invalid tool call."""
        return bool(self.extras.get("is_error"))


codec.register(MessageRole, "ratchet.MessageRole")
codec.register(TokenUsage, "ratchet.TokenUsage")
codec.register(ToolCall, "ratchet.ToolCall")
codec.register(ChatMessage, "ratchet.ChatMessage")
