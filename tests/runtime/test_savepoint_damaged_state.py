"""`ratchet savepoint` of a state whose database fails SQLite's integrity check: one sentence
naming what failed, that nothing was written, and the fix (it read "the copy of X; nothing was
written at Y: ...; see `sqlite3 ...` failed SQLite's integrity check (...)")."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from ratchet._errors import EXIT_OK, EXIT_USAGE

RATCHET = [sys.executable, "-m", "ratchet.cli"]
AGENT_SRC = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Keeper(Agent):
    @action(InputEvent, inline=True)
    def keep(self, event, ctx):
        ctx.short_term_memory.set("v", event.input["v"])
        ctx.send_event(OutputEvent(output={"k": ctx.key}))
"""


def test_a_savepoint_of_a_state_failing_the_integrity_check_says_so_in_one_sentence(
    tmp_path: Path,
) -> None:
    (tmp_path / "agent.py").write_text(AGENT_SRC)
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"key": f"k{i}", "v": "x" * 50}) + "\n" for i in range(20))
    )
    state = tmp_path / "state"
    ran = subprocess.run(
        [*RATCHET, "run", f"{tmp_path / 'agent.py'}:Keeper", "--input", str(tmp_path / "in.jsonl"),
         "--output", str(tmp_path / "out.jsonl"), "--state", str(state)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == EXIT_OK, ran.stderr
    # Damage SQLite's own check finds and reading does not: an index that no longer matches
    # its table (as a flipped bit in an index page does), deterministically.
    db = state / "ratchet.db"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA writable_schema=ON")
    conn.execute(
        "UPDATE sqlite_master SET sql = 'CREATE INDEX traces_by_time ON traces(seq)' "
        "WHERE name = 'traces_by_time'"
    )
    conn.commit()
    conn.close()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] != "ok"
    conn.close()

    target = tmp_path / "sp.db"
    proc = subprocess.run(
        [*RATCHET, "savepoint", "--state", str(state), str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_USAGE, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = lines[0]
    # Subject first, then what happened, what was not written, and the fix.
    assert line.startswith(f"ratchet: error: the copy of {db} failed SQLite's integrity check ("), (
        line
    )
    assert "missing from index traces_by_time" in line
    rest = line.split("); ", 1)[1]
    assert rest.startswith(f"nothing was written at {target}; "), line
    assert f"`sqlite3 {db} 'PRAGMA integrity_check'`" in rest
    assert rest.endswith("restore it from a backup or an earlier savepoint"), line
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "agent.py", "in.jsonl", "out.jsonl", "state",
    ]  # fmt: skip
