"""Outputs restored from the outbox after a crash keep their emission order (issue 11, item 5)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from ratchet import Agent, InputEvent, OutputEvent, action
from ratchet.agents._context import AgentBinding, install_task_factory
from ratchet.runtime._engine import Engine
from ratchet.runtime._io import CallbackSink, IterableSource
from ratchet.store import codec
from ratchet.store._base import CheckpointRows
from ratchet.store._memory import MemoryStore


class Many(Agent):
    @action(InputEvent)
    def go(self, event: InputEvent, ctx: Any) -> None:
        for i in range(12):
            ctx.send_event(OutputEvent(output=i))


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_outputs_restored_from_the_outbox_keep_their_emission_order(
    tmp_path: Path, backend: str
) -> None:
    """Issue 11, item 5: twelve outputs of one task wait in the outbox at a crash; after the
    restart they are released in the order emitted, not by id ("...:10" sorts before "...:2")."""
    from ratchet.store._sqlite import SqliteStore

    records = [
        {"id": f"k:0:r>go:{i}", "key": "k", "seq": 0, "task": "r>go", "output": i}
        for i in range(12)
    ]
    store: Any = MemoryStore()
    if backend == "sqlite":
        store = SqliteStore.open(tmp_path, "a", AgentBinding(Many()).fingerprint, ["go"])
    store.write_checkpoint(
        CheckpointRows(outbox=[(r["id"], 0, codec.encode(r)) for r in records]), 0.0
    )
    got: list[dict[str, Any]] = []
    engine = Engine(AgentBinding(Many()), store, IterableSource([]), CallbackSink(got.append))

    async def main() -> None:
        install_task_factory(asyncio.get_running_loop())
        await engine.run()

    asyncio.run(main())
    assert [r["output"] for r in got] == list(range(12))
