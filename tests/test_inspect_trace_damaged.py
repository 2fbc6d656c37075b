"""`ratchet inspect` and `ratchet trace` on a state with a damaged row: one line naming the
file, the key (and the input for a trace) and the fix, exit 2; the rows that do decode are
still shown. They said `cannot decode 5 bytes: ValueError: ...` (no file, key or fix), and
`inspect` of all keys showed none for one bad key."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import ratchet
from ratchet._errors import EXIT_OK, EXIT_USAGE, StateError

RATCHET = [sys.executable, "-m", "ratchet.cli"]
AGENT_SRC = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Counter(Agent):
    @action(InputEvent, inline=True)
    def count(self, event, ctx):
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(OutputEvent(output={"n": n}))
"""
FIX = "restore it from a backup or a savepoint"


def ratchet_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RATCHET, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == EXIT_USAGE, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ratchet: error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k1 ran twice (inputs 0 and 3), k2 and k3 once; then k2's memory, k3's trace and k1's
    older trace are overwritten with bytes that are not what ratchet wrote."""
    tmp = tmp_path_factory.mktemp("damaged")
    (tmp / "agent.py").write_text(AGENT_SRC)
    (tmp / "in.jsonl").write_text(
        "".join(json.dumps({"key": k}) + "\n" for k in ("k1", "k2", "k3", "k1"))
    )
    state = tmp / "state"
    ran = ratchet_cli("run", f"{tmp / 'agent.py'}:Counter", "--input", tmp / "in.jsonl",
                      "--output", tmp / "out.jsonl", "--state", state)  # fmt: skip
    assert ran.returncode == EXIT_OK, ran.stderr
    conn = sqlite3.connect(state / "ratchet.db")
    assert conn.execute("UPDATE keys SET memory = x'82a1768ff1' WHERE key_text = 'k2'").rowcount
    assert conn.execute("UPDATE traces SET trace = x'c1c1c1' WHERE key_text = 'k3'").rowcount
    assert conn.execute(
        "UPDATE traces SET trace = x'c1' WHERE key_text = 'k1' AND seq = 0"
    ).rowcount
    conn.commit()
    conn.close()
    return state


def test_inspect_of_a_damaged_key_names_the_file_the_key_and_the_fix(damaged: Path) -> None:
    for extra in ([], ["--json"]):
        proc = ratchet_cli("inspect", "--state", damaged, "--key", "k2", *extra)
        line = error_line(proc)
        assert f"{damaged / 'ratchet.db'}: the memory of key 'k2' cannot be decoded (" in line
        assert FIX in line and "--state" in line, line
        assert proc.stdout == ""


def test_inspect_of_all_keys_shows_the_good_ones_and_reports_the_bad_one(damaged: Path) -> None:
    proc = ratchet_cli("inspect", "--state", damaged, "--json")
    assert json.loads(proc.stdout) == {"k1": {"n": 2}, "k3": {"n": 1}}
    line = error_line(proc)
    assert f"{damaged / 'ratchet.db'}: the memory of key 'k2' cannot be decoded (" in line
    assert "the other keys are shown above" in line and FIX in line, line
    proc = ratchet_cli("inspect", "--state", damaged)
    assert "k1" in proc.stdout and "k3" in proc.stdout and "k2" not in proc.stdout
    assert "'k2'" in error_line(proc)


def test_trace_of_a_damaged_run_names_the_file_the_key_the_input_and_the_fix(
    damaged: Path,
) -> None:
    db = damaged / "ratchet.db"
    for args in (["--key", "k3"], ["--key", "k3", "--json"], ["--key", "k1", "--seq", "0"]):
        line = error_line(ratchet_cli("trace", "--state", damaged, *args))
        key, seq = ("k3", 2) if args[1] == "k3" else ("k1", 0)
        assert f"{db}: the trace of key {key!r}, input {seq}, cannot be decoded (" in line
        assert FIX in line, line
    # A damaged older run does not hide the newest one, which is shown as before.
    proc = ratchet_cli("trace", "--state", damaged, "--key", "k1", "--json")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert json.loads(proc.stdout)["seq"] == 3


def test_the_python_api_names_the_damaged_key_and_run_and_the_fix(damaged: Path) -> None:
    with ratchet.open_state(damaged) as state:
        with pytest.raises(StateError, match=r"the memory of key 'k2' cannot be decoded") as m:
            state.memory("k2")
        assert FIX in str(m.value)
        with pytest.raises(StateError, match=r"the trace of key 'k3', input 2, cannot be") as t:
            state.traces("k3")
        assert FIX in str(t.value)
        assert [t["seq"] for t in state.traces("k1", 3)] == [3]
