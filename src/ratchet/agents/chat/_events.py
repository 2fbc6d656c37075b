"""The built-in chat events. Their names are fixed: they are stored in journals."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from ratchet.agents._events import Event
from ratchet.agents.chat._messages import ChatMessage, TokenUsage, ToolCall
from ratchet.agents.chat._model import register_schema
from ratchet.store import codec


class ChatRequestEvent(Event):
    """Ask the chat model setup (or model) registered as `model` on the agent.

    `messages` follow the setup's prompt (formatted with `prompt_args`); with no prompt on
    the setup, `prompt_args` fill `{placeholders}` in `messages` themselves. `output_schema`
    is a pydantic model class (stored by its registered name) the final reply is validated
    into. The answer arrives as a `ChatResponseEvent`, after any tool round trips.
    """

    event_name: ClassVar[str] = "ratchet.ChatRequestEvent"

    model: str
    messages: list[ChatMessage] = Field(default_factory=list)
    prompt_args: dict[str, Any] = Field(default_factory=dict)
    output_schema: str | None = None

    @field_validator("output_schema", mode="before")
    @classmethod
    def _schema_name(cls, value: Any) -> Any:
        return None if value is None else register_schema(value)


class ChatResponseEvent(Event):
    """The model's final reply to a `ChatRequestEvent`.

    `response` is the assistant message; `structured` the validated `output_schema`
    instance (rebuilt from its registered name after recovery); `messages` the whole
    transcript including tool calls and results; `usage` what this request cost.
    """

    event_name: ClassVar[str] = "ratchet.ChatResponseEvent"

    request_id: str
    model: str
    response: ChatMessage
    messages: list[ChatMessage] = Field(default_factory=list)
    output_schema: str | None = None
    structured: Any = None
    usage: TokenUsage = Field(default_factory=TokenUsage)

    @model_validator(mode="after")
    def _rebuild_structured(self) -> ChatResponseEvent:
        if self.output_schema and isinstance(self.structured, dict):
            try:
                cls = codec.lookup(self.output_schema)
            except codec.UnknownTypeError:
                return self
            self.structured = cls.model_validate(self.structured)  # type: ignore[attr-defined]
        return self


class ToolRequestEvent(Event):
    """The model asked for tools; the built-in tool action runs them (concurrently)."""

    event_name: ClassVar[str] = "ratchet.ToolRequestEvent"

    request_id: str
    model: str
    tool_calls: list[ToolCall]


class ToolResponseEvent(Event):
    """Results of a `ToolRequestEvent`, one tool message per call, in the calls' order."""

    event_name: ClassVar[str] = "ratchet.ToolResponseEvent"

    request_id: str
    model: str
    responses: list[ChatMessage]


class ToolApprovalRequestEvent(Event):
    """Some tool calls of a `ToolRequestEvent` need a person's approval before they run.

    Emitted by the built-in tool action, together with one `approval_request` output per such
    call, instead of running the calls. `approval_ids[i]` is the approval's call id for
    `tool_calls[i]` (None for a call that needs none); the built-in `ratchet_tool_approval`
    action waits for the signal `approval:<call id>` of each, then runs the approved calls
    (and the others) and answers with the `ToolResponseEvent`. An agent may listen for it too,
    e.g. to notify a reviewer.
    """

    event_name: ClassVar[str] = "ratchet.ToolApprovalRequestEvent"

    request_id: str
    model: str
    tool_calls: list[ToolCall]
    approval_ids: list[str | None]

    @model_validator(mode="after")
    def _aligned(self) -> ToolApprovalRequestEvent:
        if len(self.approval_ids) != len(self.tool_calls):
            raise ValueError(
                f"approval_ids has {len(self.approval_ids)} entries for "
                f"{len(self.tool_calls)} tool calls; give one per call (None: no approval)"
            )
        return self
