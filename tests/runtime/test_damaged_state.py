"""Damaged or crafted bytes in a state are refused with a StateError naming the table and the
row (issue 11, item 10, the engine's side): never a crash, never a stray exception type."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ratchet import Agent, InputEvent, OutputEvent, StateError, action
from ratchet.agents._context import AgentBinding, install_task_factory
from ratchet.runtime._engine import Engine
from ratchet.runtime._io import CallbackSink, IterableSource
from ratchet.store import codec
from ratchet.store._base import CheckpointRows
from ratchet.store._memory import MemoryStore

GARBAGE = [
    b"\xc1",  # a msgpack byte that is never valid
    b"\xc7\x05\x7f\x01\x02",  # an ext record of an unknown kind, cut short
    b"",
]


class Count(Agent):
    @action(InputEvent)
    def go(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("n", ctx.short_term_memory.get("n", 0) + 1)
        ctx.send_event(OutputEvent(output=ctx.short_term_memory.get("n")))


def restore(store: MemoryStore) -> None:
    engine = Engine(AgentBinding(Count()), store, IterableSource([]), CallbackSink(print))

    async def main() -> None:
        install_task_factory(asyncio.get_running_loop())
        await engine.run()

    asyncio.run(main())


@pytest.mark.parametrize("blob", GARBAGE)
def test_damaged_memory_is_a_state_error_naming_the_key(blob: bytes) -> None:
    store = MemoryStore()
    store.write_checkpoint(CheckpointRows(keys=[(codec.encode("k"), "k", 1, blob, 1)]), 0.0)
    with pytest.raises(StateError, match=r"the state's keys row for 'k' cannot be read"):
        restore(store)


@pytest.mark.parametrize("blob", GARBAGE)
def test_a_damaged_journal_is_a_state_error_naming_the_run(blob: bytes) -> None:
    store = MemoryStore()
    event = codec.encode(("ratchet.InputEvent", {"input": {"key": "k"}}))
    store.write_checkpoint(
        CheckpointRows(
            new_inputs=[(7, codec.encode("k"), event)], runs=[(7, codec.encode("k"), 0, blob)]
        ),
        0.0,
    )
    with pytest.raises(StateError, match=r"the state's runs row for 'input 7' cannot be read"):
        restore(store)


def test_ratchet_run_on_damaged_state_exits_2_with_one_line(tmp_path: Path) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text(
        "from typing import Any\n"
        "from ratchet import Agent, InputEvent, action\n"
        "class A(Agent):\n"
        "    @action(InputEvent)\n"
        "    def go(self, event: InputEvent, ctx: Any) -> None:\n"
        "        ctx.short_term_memory.set('n', 1)\n"
    )
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"key": "k"}\n')
    cmd = [sys.executable, "-m", "ratchet.cli", "run", f"{agent}:A", "--input", str(inputs)]
    cmd += ["--output", str(tmp_path / "o.jsonl"), "--state", str(tmp_path / "s")]
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    with sqlite3.connect(tmp_path / "s" / "ratchet.db") as db:
        db.execute("UPDATE keys SET memory = ?", (b"\xc7\xff\x7f" + b"\x00" * 3,))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "ratchet: error: the state's keys row for 'k' cannot be read" in proc.stderr
