"""The local environment: a Flink Agents job on ratchet's embedded engine.

Inputs are read from the list at `execute()`, in order; each is `{"key": k, "value": v}`
(`k`/`v` also work; without a key one is generated, stable across restarts). Outputs come back
as `[{key: output}, ...]` in input order. An action that raises fails `execute()` with its
exception. Without a state directory the job runs in a temporary one, deleted afterwards;
with one (`get_execution_environment(state_dir=...)`) it is durable: `execute()` after a
crash resumes where the last checkpoint left it, and `to_list()` gives every output of the
job once.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from ratchet._errors import ConfigError
from ratchet.agents._run import run as ratchet_run
from ratchet.compat.flink_agents.api.agents.agent import Agent
from ratchet.compat.flink_agents.api.configuration import Configuration
from ratchet.compat.flink_agents.api.events.event import Event
from ratchet.compat.flink_agents.api.execution_environment import (
    AgentBuilder,
    AgentsExecutionEnvironment,
)
from ratchet.compat.flink_agents.runtime._adapter import Hooks, to_ratchet
from ratchet.store import codec

OUTPUT_FILE = "flink-agents-outputs.jsonl"
_KEY_NAMESPACE = uuid.UUID("5b0e4c8e-1f0a-4d8e-9a55-3c1b8f0f7a21")


class ActionError(RuntimeError):
    """An action failed; raised by `execute()` when the exception itself is not at hand (it
    failed in an earlier process of a durable job)."""


class LocalAgentBuilder(AgentBuilder):
    def __init__(self, env: LocalExecutionEnvironment) -> None:
        self._env = env
        self._applied = False

    def apply(self, agent: Agent | str) -> AgentBuilder:
        if self._applied:
            raise RuntimeError("the local environment runs one agent; apply() was already called")
        if isinstance(agent, str):
            found = self._env._agents.get(agent)
            if found is None:
                raise ValueError(f"no agent named {agent!r} is registered on this environment")
            agent = found
        self._env._agent = agent
        self._applied = True
        return self

    def to_list(self) -> list[dict[Any, Any]]:
        return self._env._outputs


class LocalExecutionEnvironment(AgentsExecutionEnvironment):
    """Runs one agent over one list of inputs on the embedded engine."""

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self._state_dir = Path(state_dir) if state_dir is not None else None
        self._config = Configuration()
        self._input: list[dict[str, Any]] | None = None
        self._agent: Agent | None = None
        self._outputs: list[dict[Any, Any]] = []
        self._executed = False
        self._hooks = Hooks()

    def get_config(self, path: str | None = None) -> Configuration:
        if path is not None:
            self._config.load_from_file(path)
        return self._config

    def from_list(self, input: list[dict[str, Any]]) -> AgentBuilder:  # noqa: A002
        if self._input is not None:
            raise RuntimeError("the local environment takes one input list; from_list() was called")
        if not isinstance(input, list):
            raise TypeError(f"from_list() takes a list of dicts, got {type(input).__name__}")
        self._input = input
        return LocalAgentBuilder(self)

    def get_tool_request_events(self) -> list[Event]:
        """The tool requests actions sent in this process, in the order they were sent."""
        return list(self._hooks.tool_requests)

    def execute(self, job_name: str | None = None) -> None:
        if self._executed:
            raise RuntimeError("the local environment runs once; execute() was already called")
        if self._input is None or self._agent is None:
            raise RuntimeError("nothing to run: call env.from_list(inputs).apply(agent) first")
        self._executed = True
        agent = to_ratchet(
            self._agent,
            config=self._config,
            resources=self.resources,
            hooks=self._hooks,
            input_field="value",
        )
        try:
            # After to_ratchet(): it registers the models of the agent's module.
            records = [_record(i, item) for i, item in enumerate(self._input)]
            if self._state_dir is not None:
                outputs = self._run_durable(agent, records)
            else:
                with tempfile.TemporaryDirectory(prefix="ratchet-flink-agents-") as tmp:
                    outputs = self._run(agent, records, tmp)
        finally:
            resources = getattr(agent, "flink_resources", None)
            if resources is not None:
                resources.close()
        self._raise_first_error(outputs)
        outputs.sort(key=lambda rec: rec["seq"])  # stable: a run's outputs keep their order
        self._outputs.extend({rec["key"]: rec["output"]} for rec in outputs)

    def _run(self, agent: Any, records: list[dict[str, Any]], state: str) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        seen: set[str] = set()

        def collect(rec: dict[str, Any]) -> None:
            if rec["id"] not in seen:
                seen.add(rec["id"])
                got.append(rec)

        ratchet_run(agent, inputs=records, output=collect, state_dir=state)
        return got

    def _run_durable(self, agent: Any, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        assert self._state_dir is not None
        path = self._state_dir / OUTPUT_FILE
        ratchet_run(agent, inputs=records, output=path, state_dir=self._state_dir)
        got = []
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    got.append(json.loads(line))
        return got

    def _raise_first_error(self, outputs: list[dict[str, Any]]) -> None:
        failed = [rec for rec in outputs if rec.get("error")]
        if not failed and not self._hooks.errors:
            return
        if self._hooks.errors:
            raise min(self._hooks.errors, key=lambda e: e[1])[2]
        first = min(failed, key=lambda rec: rec["seq"])
        err = first["error"]
        raise ActionError(
            f"action {err['action']} failed on key {first['key']!r}: {err['type']}: "
            f"{err['message']}"
        )


def _record(index: int, item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise TypeError(
            f"input {index} is {type(item).__name__}; each input is a dict like "
            f"{{'key': ..., 'value': ...}}"
        )
    if "value" in item:
        value = item["value"]
    elif "v" in item:
        value = item["v"]
    else:
        raise RuntimeError(
            f"input {index} has no 'value' (or 'v'): each input is a dict like "
            f"{{'key': ..., 'value': ...}}"
        )
    if "key" in item:
        key = item["key"]
    elif "k" in item:
        key = item["k"]
    else:
        # Generated, and the same when a durable job reads its list again after a crash.
        key = str(uuid.uuid5(_KEY_NAMESPACE, str(index)))
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise ConfigError(
            f"input {index} has key {key!r} ({type(key).__name__}); ratchet keys are str or "
            f"int: pass str(key)"
        )
    codec.check_admissible(value, f"input {index} value")
    return {"key": key, "value": value}
