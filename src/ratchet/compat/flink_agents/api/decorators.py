"""Decorators that declare an agent's actions and resources on `@staticmethod`s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ratchet.compat.flink_agents.api.tools.tool_parameter_injection import (
    InjectedArg,
    normalize_injected_args,
    validate_injected_arg_names,
)

TRIGGERS_ATTR = "_flink_trigger_conditions"
RESOURCE_ATTR = "_flink_resource_kind"
INJECTED_ATTR = "_flink_injected_args"


def _mark(func: Any, attr: str, value: Any) -> None:
    setattr(func, attr, value)
    inner = getattr(func, "__func__", None)
    if inner is not None:
        setattr(inner, attr, value)


def action(*trigger_conditions: str, target: Any = None) -> Callable[[Any], Any]:
    """Run the decorated `(event, ctx)` function on events whose type is one of
    `trigger_conditions` (type strings, e.g. `EventType.InputEvent` or "MyEvent")."""
    if not trigger_conditions:
        raise ValueError(
            "@action() needs at least one event type string, e.g. @action(EventType.InputEvent)"
        )
    for entry in trigger_conditions:
        if not isinstance(entry, str) or not entry:
            raise ValueError(
                f"@action() takes event type strings (e.g. EventType.InputEvent or "
                f"MyEvent.EVENT_TYPE), got {entry!r}"
            )
    if target is not None:
        raise NotImplementedError(
            "@action(target=...) dispatches to a Java function; ratchet runs Python actions only"
        )

    def decorator(func: Any) -> Any:
        _mark(func, TRIGGERS_ATTR, tuple(trigger_conditions))
        return func

    return decorator


def _resource(kind: str) -> Callable[[Any], Any]:
    def decorator(func: Any) -> Any:
        _mark(func, RESOURCE_ATTR, kind)
        return func

    decorator.__doc__ = f"Declare a {kind.replace('_', ' ')} resource, named after the function."
    return decorator


chat_model_connection = _resource("chat_model_connection")
chat_model_setup = _resource("chat_model")
embedding_model_connection = _resource("embedding_model_connection")
embedding_model_setup = _resource("embedding_model")
prompt = _resource("prompt")
vector_store = _resource("vector_store")
mcp_server = _resource("mcp_server")
skills = _resource("skills")


def tool(
    func: Any = None,
    *,
    injected_args: dict[str, InjectedArg | dict[str, Any]] | None = None,
) -> Any:
    """Declare a function as a tool named after it; `injected_args` name parameters the runner
    fills (from config or memory) and the model does not see."""
    injected = normalize_injected_args(injected_args)

    def decorator(target: Any) -> Any:
        inner = target.__func__ if isinstance(target, staticmethod) else target
        validate_injected_arg_names(inner, injected)
        _mark(target, RESOURCE_ATTR, "tool")
        _mark(target, INJECTED_ATTR, injected)
        return target

    return decorator(func) if func is not None else decorator
