"""Drive either engine in-process over in-memory state: the embedded engine over a MemoryStore,
the Flink core over MemoryKeyedState the way the PyFlink function drives it (an element per
input, processing-time timers while tasks run, an end-of-input timer per key). No PyFlink."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

from ratchet import Agent
from ratchet.agents._context import AgentBinding, install_task_factory
from ratchet.runtime._engine import Engine, EngineConfig, EngineResult
from ratchet.runtime._flink_core import AgentCore, CoreConfig, MemoryKeyedState, Step
from ratchet.runtime._io import CallbackSink, IterableSource
from ratchet.runtime._journal import decode_memory
from ratchet.store import codec
from ratchet.store._memory import MemoryStore


def run_embedded(
    agent: Agent,
    rows: Iterable[dict[str, Any]],
    store: MemoryStore | None = None,
    config: EngineConfig | None = None,
) -> tuple[list[dict[str, Any]], MemoryStore, EngineResult]:
    """One embedded run to the end of `rows`; the records the sink got, the store, the result."""
    store = store if store is not None else MemoryStore()
    got: list[dict[str, Any]] = []
    engine = Engine(
        AgentBinding(agent),
        store,
        IterableSource(list(rows)),
        CallbackSink(got.append),
        config or EngineConfig(checkpoint_interval=0.01),
    )

    async def main() -> EngineResult:
        install_task_factory(asyncio.get_running_loop())
        return await engine.run()

    result = asyncio.run(main())
    return got, store, result


def store_memory(store: MemoryStore) -> dict[Any, dict[str, Any]]:
    """Every key's committed memory in a MemoryStore."""
    return {codec.decode(k): decode_memory(mem) for k, (_t, _nd, mem, _v) in store.keys.items()}


class FlinkSim:
    """The Flink core driven as the PyFlink operator drives it, on in-memory keyed state."""

    def __init__(
        self,
        agent: Agent,
        state: MemoryKeyedState | None = None,
        journal: Any = None,
        journal_retry_s: float = 30.0,
    ) -> None:
        self.state = state if state is not None else MemoryKeyedState()
        config = CoreConfig(poll_min_ms=1, poll_max_ms=4, journal_retry_s=journal_retry_s)
        self.core = AgentCore(AgentBinding(agent), config, journal=journal)
        self.core.open()
        self.outputs: list[dict[str, Any]] = []
        self.polling: set[Any] = set()

    def _take(self, key: Any, step: Step) -> None:
        self.outputs.extend(json.loads(line) for line in step.outputs)
        if step.poll_ms is not None:
            self.polling.add(key)
        else:
            self.polling.discard(key)

    def element(self, key: Any, value: dict[str, Any]) -> None:
        self._take(key, self.core.element(key, value, self.state.view(key)))

    def poll(self) -> None:
        """Fire the processing-time timers registered so far (once each)."""
        for key in list(self.polling):
            self._take(key, self.core.timer(key, self.state.view(key)))

    def end(self) -> None:
        """The end-of-input timer of every key with state: each waits until its key is idle."""
        for key in sorted(self.state.keys(), key=repr):
            self._take(key, self.core.timer(key, self.state.view(key), end=True))

    def memory(self) -> dict[Any, dict[str, Any]]:
        out = {}
        for key in self.state.keys():
            mem = self.core.memory(key, self.state.view(key))
            if mem is not None:
                out[key] = mem
        return out

    def close(self) -> None:
        self.core.close()


def run_flink_core(
    agent: Agent, rows: Iterable[dict[str, Any]], key_field: str = "key"
) -> tuple[list[dict[str, Any]], dict[Any, dict[str, Any]]]:
    sim = FlinkSim(agent)
    try:
        for row in rows:
            sim.element(row[key_field], row)
            sim.poll()
        sim.end()
        return sim.outputs, sim.memory()
    finally:
        sim.close()


def per_key(outputs: list[dict[str, Any]]) -> dict[Any, list[Any]]:
    """Output payloads per key, in order (ids differ: Flink numbers inputs per key)."""
    grouped: dict[Any, list[Any]] = {}
    for rec in outputs:
        grouped.setdefault(rec["key"], []).append(rec["output"])
    return grouped
