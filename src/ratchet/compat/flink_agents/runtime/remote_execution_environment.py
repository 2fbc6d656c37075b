"""The Flink path: a Flink Agents agent as a PyFlink job built by `ratchet.flink`."""

from __future__ import annotations

from typing import Any

from ratchet.compat.flink_agents.api.agents.agent import Agent
from ratchet.compat.flink_agents.api.configuration import Configuration
from ratchet.compat.flink_agents.api.execution_environment import (
    AgentBuilder,
    AgentsExecutionEnvironment,
)
from ratchet.compat.flink_agents.runtime._adapter import to_ratchet


class _RemoteBuilder(AgentBuilder):
    def __init__(self, env: RemoteExecutionEnvironment, builder: Any) -> None:
        self._env = env
        self._builder = builder

    def apply(self, agent: Agent | str) -> AgentBuilder:
        if isinstance(agent, str):
            raise ValueError("ratchet applies agent instances, not names of YAML agents")
        native = to_ratchet(agent, config=self._env.config, resources=self._env.resources)
        self._builder = self._builder.apply(native)
        return self

    def to_list(self) -> list[dict[Any, Any]]:
        raise NotImplementedError(
            "to_list() is the local environment's; a Flink job's output is to_datastream()"
        )

    def to_datastream(self) -> Any:
        return self._builder.to_datastream()


class RemoteExecutionEnvironment(AgentsExecutionEnvironment):
    """Builds the job on a PyFlink `StreamExecutionEnvironment` with `ratchet.flink`."""

    def __init__(self, env: Any, t_env: Any = None, **kwargs: Any) -> None:
        super().__init__()
        try:
            from ratchet.flink import AgentsEnvironment
        except ImportError as exc:
            raise ModuleNotFoundError(
                f"a Flink environment needs PyFlink (pip install 'ratchet[flink]'): {exc}"
            ) from exc
        self._native = AgentsEnvironment(env)
        self.config = Configuration()

    def get_config(self, path: str | None = None) -> Configuration:
        if path is not None:
            self.config.load_from_file(path)
        return self.config

    def from_list(self, input: list[dict[str, Any]]) -> AgentBuilder:  # noqa: A002
        raise NotImplementedError(
            "from_list() is the local environment's: get_execution_environment() without env="
        )

    def from_datastream(self, input: Any, key_selector: Any = None) -> AgentBuilder:  # noqa: A002
        return _RemoteBuilder(self, self._native.from_datastream(input, key_selector))

    def execute(self, job_name: str | None = None) -> Any:
        return self._native.execute(job_name or "ratchet")
