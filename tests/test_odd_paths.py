"""A state directory whose name holds URI characters ('#', '?', '%') is read like any other:
the read-only connection quotes its path (an unquoted one cut the path and wrote elsewhere)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ratchet
from ratchet import Agent, InputEvent, OutputEvent, action


class Echo(Agent):
    @action(InputEvent)
    def echo(self, event: InputEvent, ctx: object) -> None:
        ctx.short_term_memory.set("n", 1)  # type: ignore[attr-defined]
        ctx.send_event(OutputEvent(output=1))  # type: ignore[attr-defined]


def test_status_and_inspect_read_a_state_under_an_odd_name(tmp_path: Path) -> None:
    state = tmp_path / "we#ird?di%r" / "st"
    ratchet.run(Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=state)
    for args in (["status", "--json"], ["inspect", "--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "ratchet.cli", *args, "--state", str(state)],
            capture_output=True, text=True, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        json.loads(done.stdout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl", "we#ird?di%r"]
