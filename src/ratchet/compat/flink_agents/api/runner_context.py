"""`RunnerContext`: what an action gets besides its event (the interface; ratchet's runner
implements it in `ratchet.compat.flink_agents.runtime`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from ratchet.compat.flink_agents.api.configuration import Configuration
from ratchet.compat.flink_agents.api.events.event import Event
from ratchet.compat.flink_agents.api.memory_object import MemoryObject
from ratchet.compat.flink_agents.api.resource import Resource, ResourceType


class RunnerContext(ABC):
    """Key, event sending, memories, resources, configuration and durable calls."""

    @property
    @abstractmethod
    def key(self) -> Any:
        """The key of the input being processed."""

    @abstractmethod
    def send_event(self, event: Event) -> None:
        """Send an event; it is delivered when this action commits."""

    @abstractmethod
    def get_resource(self, name: str, type: ResourceType, metric_group: Any = None) -> Resource:  # noqa: A002
        """The resource `name` of kind `type`."""

    @property
    @abstractmethod
    def action_config(self) -> dict[str, Any]:
        """The config given to this action with `Agent.add_action(..., **config)`."""

    @abstractmethod
    def get_action_config_value(self, key: str) -> Any:
        """One value of `action_config`."""

    @property
    @abstractmethod
    def sensory_memory(self) -> MemoryObject:
        """Memory of this run, cleared when it ends."""

    @property
    @abstractmethod
    def short_term_memory(self) -> MemoryObject:
        """Memory of this key, kept across runs."""

    @property
    @abstractmethod
    def long_term_memory(self) -> Any:
        """Not provided by ratchet."""

    @property
    def agent_metric_group(self) -> Any:
        return None

    @property
    def action_metric_group(self) -> Any:
        return None

    @abstractmethod
    def durable_execute(
        self,
        func: Callable[..., Any],
        *args: Any,
        reconciler: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Call `func(*args, **kwargs)`, recording its result: a replay returns the record."""

    @abstractmethod
    def durable_execute_async(
        self,
        func: Callable[..., Any],
        *args: Any,
        reconciler: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """The awaitable form of `durable_execute`."""

    @property
    @abstractmethod
    def config(self) -> Configuration:
        """The job's configuration."""

    def close(self) -> None:  # noqa: B027 - optional to override
        """Nothing to release."""
