"""`AgentsExecutionEnvironment`: where a Flink Agents job is built and run.

`get_execution_environment()` with no Flink environment gives the local one, which runs the
agent on ratchet's embedded engine: `from_list(inputs).apply(agent).to_list()`, then
`execute()`. Given a state directory (`get_execution_environment(state_dir=...)`) the run is
durable: killed at any point, `execute()` again resumes it, each output exactly once. With a
PyFlink `StreamExecutionEnvironment`, the datastream path goes to `ratchet.flink`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

from ratchet.compat.flink_agents.api.agents.agent import Agent
from ratchet.compat.flink_agents.api.configuration import Configuration
from ratchet.compat.flink_agents.api.resource import ResourceType


class AgentBuilder(ABC):
    """Connects an agent to the environment's input and output."""

    @abstractmethod
    def apply(self, agent: Agent | str) -> AgentBuilder:
        """The agent to run."""

    @abstractmethod
    def to_list(self) -> list[dict[Any, Any]]:
        """The outputs, `[{key: output}, ...]`, filled by `execute()`."""

    def to_datastream(self) -> Any:
        raise NotImplementedError(
            "to_datastream() needs a Flink environment: "
            "get_execution_environment(env=StreamExecutionEnvironment...) (docs/flink-agents.md)"
        )

    def to_table(self, schema: Any = None, output_type: Any = None) -> Any:
        raise NotImplementedError("ratchet does not run Flink Agents' Table API path")


class AgentsExecutionEnvironment(ABC):
    """Base of the execution environments; holds resources shared by the agents it runs."""

    def __init__(self) -> None:
        self._resources: dict[ResourceType, dict[str, Any]] = {t: {} for t in ResourceType}
        self._agents: dict[str, Agent] = {}

    @property
    def resources(self) -> dict[ResourceType, dict[str, Any]]:
        return self._resources

    @staticmethod
    def get_execution_environment(
        env: Any = None,
        t_env: Any = None,
        *,
        state_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> AgentsExecutionEnvironment:
        """The local environment (ratchet's embedded engine; durable with `state_dir`), or,
        given a PyFlink `env`, one that builds the job with `ratchet.flink`."""
        if env is None:
            from ratchet.compat.flink_agents.runtime.local_execution_environment import (
                LocalExecutionEnvironment,
            )

            return LocalExecutionEnvironment(state_dir=state_dir)
        from ratchet.compat.flink_agents.runtime.remote_execution_environment import (
            RemoteExecutionEnvironment,
        )

        return RemoteExecutionEnvironment(env, t_env, **kwargs)

    @abstractmethod
    def get_config(self, path: str | None = None) -> Configuration:
        """The job's configuration (read from the YAML file `path` if given)."""

    @abstractmethod
    def from_list(self, input: list[dict[str, Any]]) -> AgentBuilder:  # noqa: A002
        """Inputs as dicts `{"key": ..., "value": ...}` (or `k`/`v`); read at `execute()`."""

    def from_datastream(self, input: Any, key_selector: Any = None) -> AgentBuilder:  # noqa: A002
        raise NotImplementedError(
            "from_datastream() needs a Flink environment: "
            "get_execution_environment(env=StreamExecutionEnvironment...)"
        )

    def from_table(self, input: Any, key_selector: Any = None) -> AgentBuilder:  # noqa: A002
        raise NotImplementedError("ratchet does not run Flink Agents' Table API path")

    @abstractmethod
    def execute(self, job_name: str | None = None) -> None:
        """Run the job."""

    def add_resource(
        self, name: str, resource_type: ResourceType, instance: Any
    ) -> AgentsExecutionEnvironment:
        """A resource every agent applied here can use (an agent's own of one name wins)."""
        if name in self._resources[resource_type]:
            raise ValueError(f"{resource_type.value} {name!r} is already defined")
        self._resources[resource_type][name] = instance
        return self
