"""A state directory whose job.json was written by a newer ratchet (a format above this one's):
every command that would run, copy or describe it says so and names the fix (that version),
exit 2. `run` called it "not a ratchet job file" (damage to restore); `checkpoints`,
`savepoint` and `fork` went on, and `fork` made a new job from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RATCHET = [sys.executable, "-m", "ratchet.cli"]
AGENT_SRC = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Count(Agent):
    @action(InputEvent, inline=True)
    def count(self, event, ctx):
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(OutputEvent(output=n))
"""


@pytest.fixture
def newer_state(tmp_path: Path) -> tuple[Path, list[str]]:
    (tmp_path / "agent.py").write_text(AGENT_SRC)
    (tmp_path / "in.jsonl").write_text('{"key": "a"}\n{"key": "b"}\n')
    run = [*RATCHET, "run", f"{tmp_path / 'agent.py'}:Count", "--input", str(tmp_path / "in.jsonl"),
           "--output", str(tmp_path / "out.jsonl"), "--state", str(tmp_path / "state")]  # fmt: skip
    first = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    job = tmp_path / "state" / "job.json"
    data = json.loads(job.read_text())
    job.write_text(json.dumps(dict(data, format=2)))
    return tmp_path, run


def said(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("ratchet")]
    return line


def test_run_says_the_state_is_a_newer_ratchets(newer_state: tuple[Path, list[str]]) -> None:
    tmp, run = newer_state
    line = said(subprocess.run(run, capture_output=True, text=True, timeout=60))
    assert "job.json was written by a newer ratchet (job file format 2; this version reads " in line
    assert "use that ratchet version (or newer) with this state directory" in line
    assert "not a ratchet job file" not in line


@pytest.mark.parametrize("command", ["savepoint", "fork", "checkpoints"])
def test_copies_and_descriptions_refuse_the_state_of_a_newer_ratchet(
    newer_state: tuple[Path, list[str]], command: str
) -> None:
    tmp, _run = newer_state
    state = str(tmp / "state")
    argv = {
        "savepoint": ["savepoint", "--state", state, str(tmp / "sp.db")],
        "fork": ["fork", "--state", state, "--to", str(tmp / "forked")],
        "checkpoints": ["checkpoints", "--state", state],
    }[command]
    line = said(subprocess.run([*RATCHET, *argv], capture_output=True, text=True, timeout=60))
    assert "job.json was written by a newer ratchet (job file format 2" in line, line
    assert not (tmp / "sp.db").exists() and not (tmp / "forked").exists()
