"""`Agent`: actions (decorated `@staticmethod`s, or `add_action`) and resources."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ratchet.compat.flink_agents.api.resource import ResourceType

STRUCTURED_OUTPUT = "structured_output"


class Agent:
    """Subclass it and declare actions with `@action(...)` on `@staticmethod`s taking
    `(event, ctx)`, and resources with `@chat_model_setup`, `@tool`, ...; or add them to an
    instance with `add_action` / `add_resource`."""

    def __init__(self) -> None:
        self._actions: dict[str, tuple[list[str], Callable[..., Any], dict[str, Any] | None]] = {}
        self._resources: dict[ResourceType, dict[str, Any]] = {t: {} for t in ResourceType}

    @property
    def actions(self) -> dict[str, tuple[list[str], Callable[..., Any], dict[str, Any] | None]]:
        return self._actions

    @property
    def resources(self) -> dict[ResourceType, dict[str, Any]]:
        return self._resources

    def add_action(
        self, name: str, trigger_conditions: list[str], func: Callable[..., Any], **config: Any
    ) -> Agent:
        """Add an action `func(event, ctx)` on the event types `trigger_conditions`;
        `config` is what `ctx.action_config` returns in it."""
        if name in self._actions:
            raise ValueError(f"action {name!r} is already defined on this agent")
        if isinstance(trigger_conditions, str) or not trigger_conditions:
            raise ValueError(
                f"add_action({name!r}): trigger_conditions is a non-empty list of event type "
                f"strings, e.g. [EventType.InputEvent]"
            )
        self._actions[name] = (list(trigger_conditions), func, config or None)
        return self

    def add_resource(self, name: str, resource_type: ResourceType, instance: Any) -> Agent:
        """Add a resource: a `ResourceDescriptor`, or an instance (a prompt, a tool)."""
        if name in self._resources[resource_type]:
            raise ValueError(f"{resource_type.value} {name!r} is already defined on this agent")
        self._resources[resource_type][name] = instance
        return self
