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


def restore(store: MemoryStore, inputs: list[dict[str, Any]] | None = None) -> None:
    source = IterableSource(inputs or [])
    engine = Engine(AgentBinding(Count()), store, source, CallbackSink(print))

    async def main() -> None:
        install_task_factory(asyncio.get_running_loop())
        await engine.run()

    asyncio.run(main())


@pytest.mark.parametrize("blob", GARBAGE)
def test_damaged_memory_is_a_state_error_naming_the_key(blob: bytes) -> None:
    store = MemoryStore()
    store.write_checkpoint(CheckpointRows(keys=[(codec.encode("k"), "k", 1, blob, 1)]), 0.0)
    # Keys are restored lazily: an idle key is read when its first input arrives.
    with pytest.raises(StateError, match=r"the state's keys row for 'k' cannot be read"):
        restore(store, [{"key": "k"}])


@pytest.mark.parametrize("blob", GARBAGE)
def test_a_damaged_idle_key_does_not_stop_the_others(blob: bytes) -> None:
    store = MemoryStore()
    store.write_checkpoint(CheckpointRows(keys=[(codec.encode("k"), "k", 1, blob, 1)]), 0.0)
    restore(store, [{"key": "other"}])
    assert store.keys[codec.encode("other")][1] == 1  # its run completed: one task dispatched
    assert store.keys[codec.encode("k")][2] == blob  # left as it was


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
        good = db.execute("SELECT memory FROM keys").fetchone()[0]
        db.execute("UPDATE keys SET memory = ?", (b"\xc7\xff\x7f" + b"\x00" * 3,))
    with inputs.open("a") as fh:
        fh.write('{"key": "k"}\n')  # the key is read from the state at its next input
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "ratchet: error: the state's keys row for 'k' cannot be read" in proc.stderr
    # The input it stopped at was not taken: with the row repaired, the next run does it.
    with sqlite3.connect(tmp_path / "s" / "ratchet.db") as db:
        db.execute("UPDATE keys SET memory = ?", (good,))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with sqlite3.connect(tmp_path / "s" / "ratchet.db") as db:
        assert db.execute("SELECT next_dispatch FROM keys").fetchone()[0] == 2
