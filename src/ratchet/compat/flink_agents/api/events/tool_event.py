"""Tool request and response events, handled by the built-in tool action."""

from __future__ import annotations

from typing import Any, ClassVar
from uuid import UUID

from ratchet.compat.flink_agents.api.events.event import Event, _typed, _with_id


class ToolRequestEvent(Event):
    """Tool calls (dicts, as in `ChatMessage.tool_calls`) the model named `model` asked for."""

    EVENT_TYPE: ClassVar[str] = "_tool_request_event"

    def __init__(self, model: str, tool_calls: list[dict[str, Any]]) -> None:
        super().__init__(
            type=ToolRequestEvent.EVENT_TYPE,
            attributes={"model": model, "tool_calls": list(tool_calls)},
        )

    @classmethod
    def from_event(cls, event: Event) -> ToolRequestEvent:
        attrs = _typed(cls, event, ("model", "tool_calls"))
        result = ToolRequestEvent(model=attrs["model"], tool_calls=attrs["tool_calls"])
        _with_id(result, event)
        return result

    @property
    def model(self) -> str:
        return str(self.get_attr("model"))

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.get_attr("tool_calls") or [])


class ToolResponseEvent(Event):
    """The results of a `ToolRequestEvent`'s calls, by tool-call id."""

    EVENT_TYPE: ClassVar[str] = "_tool_response_event"

    def __init__(
        self,
        request_id: UUID,
        responses: dict[Any, Any],
        external_ids: dict[Any, str | None] | None = None,
        success: dict[Any, bool] | None = None,
        error: dict[Any, str] | None = None,
    ) -> None:
        super().__init__(
            type=ToolResponseEvent.EVENT_TYPE,
            attributes={
                "request_id": request_id,
                "responses": dict(responses),
                "success": dict(success) if success is not None else dict.fromkeys(responses, True),
                "error": dict(error or {}),
                "external_ids": dict(external_ids or {}),
            },
        )

    @classmethod
    def from_event(cls, event: Event) -> ToolResponseEvent:
        attrs = _typed(cls, event, ("request_id", "responses"))
        result = ToolResponseEvent(
            request_id=attrs["request_id"],
            responses=attrs["responses"],
            external_ids=attrs.get("external_ids"),
            success=attrs.get("success"),
            error=attrs.get("error"),
        )
        _with_id(result, event)
        return result

    @property
    def request_id(self) -> UUID:
        value = self.get_attr("request_id")
        return UUID(value) if isinstance(value, str) else value

    @property
    def responses(self) -> dict[Any, Any]:
        return dict(self.get_attr("responses") or {})

    @property
    def success(self) -> dict[Any, bool]:
        return dict(self.get_attr("success") or {})

    @property
    def error(self) -> dict[Any, str]:
        return dict(self.get_attr("error") or {})

    @property
    def external_ids(self) -> dict[Any, str | None]:
        return dict(self.get_attr("external_ids") or {})
