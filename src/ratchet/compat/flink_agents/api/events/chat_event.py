"""Chat request and response events, handled by the built-in chat action."""

from __future__ import annotations

from typing import Any, ClassVar
from uuid import UUID

from ratchet.compat.flink_agents.api.chat_message import ChatMessage
from ratchet.compat.flink_agents.api.events.event import Event, _typed, _with_id


def _message(value: Any) -> ChatMessage:
    return value if isinstance(value, ChatMessage) else ChatMessage.model_validate(value)


class ChatRequestEvent(Event):
    """Ask the chat model setup named `model` to answer `messages`."""

    EVENT_TYPE: ClassVar[str] = "_chat_request_event"

    def __init__(
        self,
        model: str,
        messages: list[ChatMessage],
        prompt_args: dict[str, Any] | None = None,
        output_schema: Any = None,
    ) -> None:
        super().__init__(
            type=ChatRequestEvent.EVENT_TYPE,
            attributes={
                "model": model,
                "messages": list(messages),
                "prompt_args": dict(prompt_args or {}),
                "output_schema": output_schema,
            },
        )

    @classmethod
    def from_event(cls, event: Event) -> ChatRequestEvent:
        attrs = _typed(cls, event, ("model", "messages"))
        result = ChatRequestEvent(
            model=attrs["model"],
            messages=[_message(m) for m in attrs["messages"]],
            prompt_args=attrs.get("prompt_args"),
            output_schema=attrs.get("output_schema"),
        )
        _with_id(result, event)
        return result

    @property
    def model(self) -> str:
        return str(self.get_attr("model"))

    @property
    def messages(self) -> list[ChatMessage]:
        return list(self.get_attr("messages") or [])

    @property
    def prompt_args(self) -> dict[str, Any]:
        return dict(self.get_attr("prompt_args") or {})

    @property
    def output_schema(self) -> Any:
        return self.get_attr("output_schema")


class ChatResponseEvent(Event):
    """The model's final answer to the request whose id is `request_id`."""

    EVENT_TYPE: ClassVar[str] = "_chat_response_event"

    def __init__(
        self,
        request_id: UUID,
        response: ChatMessage,
        retry_count: int = 0,
        total_retry_wait_sec: int = 0,
    ) -> None:
        super().__init__(
            type=ChatResponseEvent.EVENT_TYPE,
            attributes={
                "request_id": request_id,
                "response": response,
                "retry_count": retry_count,
                "total_retry_wait_sec": total_retry_wait_sec,
            },
        )

    @classmethod
    def from_event(cls, event: Event) -> ChatResponseEvent:
        attrs = _typed(cls, event, ("request_id", "response"))
        result = ChatResponseEvent(
            request_id=attrs["request_id"],
            response=_message(attrs["response"]),
            retry_count=attrs.get("retry_count", 0),
            total_retry_wait_sec=attrs.get("total_retry_wait_sec", 0),
        )
        _with_id(result, event)
        return result

    @property
    def request_id(self) -> UUID:
        value = self.get_attr("request_id")
        return UUID(value) if isinstance(value, str) else value

    @property
    def response(self) -> ChatMessage:
        return self.get_attr("response")  # type: ignore[no-any-return]

    @property
    def retry_count(self) -> int:
        return int(self.get_attr("retry_count") or 0)

    @property
    def total_retry_wait_sec(self) -> int:
        return int(self.get_attr("total_retry_wait_sec") or 0)
