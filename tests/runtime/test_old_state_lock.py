"""`ratchet signal` and `ratchet redrive` bring a state from before signals (schema 10) or
dead letters (schema 4) up to date first, under the state's lock: a lock file that could not be
opened (here a directory where `ratchet.lock` belongs; a read-only directory is the other
case) reached the user as an IsADirectoryError traceback. Now it is one line naming the
directory and the fix, exit 2, and the state is left as it was. Real `ratchet run`,
`ratchet signal` and `ratchet redrive` processes on SQLite states, one worker and two."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.store import codec
from ratchet.store._sqlite import DB_NAME, LOCK_NAME

RATCHET = [sys.executable, "-m", "ratchet.cli"]
AGENT = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Fails(Agent):
    @action(InputEvent)
    async def go(self, event, ctx):
        ctx.short_term_memory.set("seen", True)
        if event.input.get("fail"):
            raise RuntimeError("boom")
        ctx.send_event(OutputEvent(output={"ok": True}))
"""


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RATCHET, *argv], capture_output=True, text=True, timeout=120)


def databases(state: Path) -> list[Path]:
    return sorted(state.glob(f"**/{DB_NAME}"))


def schema(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
    conn.close()
    version: int = codec.decode(row[0])
    return version


def old_state_with_a_lock_that_cannot_be_opened(tmp: Path, workers: str, version: int) -> Path:
    """A job's state marked as written at schema `version`, each `ratchet.lock` beside a
    database a directory."""
    (tmp / "agent.py").write_text(AGENT)
    lines = [{"key": "k1"}, {"key": "k2", "fail": True}, {"key": "k3", "fail": True}]
    (tmp / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    state = tmp / "st"
    done = cli("run", f"{tmp / 'agent.py'}:Fails", "--input", str(tmp / "in.jsonl"),
               "--output", str(tmp / "out.jsonl"), "--state", str(state), "--workers", workers,
               "--allow-errors")  # fmt: skip
    assert done.returncode == 0, done.stderr
    for db in databases(state):
        with sqlite3.connect(db) as conn:
            conn.execute(
                "UPDATE meta SET value = ? WHERE name = 'schema_version'", (codec.encode(version),)
            )
        conn.close()
        lock = db.parent / LOCK_NAME
        lock.unlink(missing_ok=True)
        lock.mkdir()
    return state


def one_line(got: subprocess.CompletedProcess[str]) -> str:
    assert got.returncode == 2, (got.returncode, got.stdout, got.stderr)
    assert "Traceback" not in got.stderr, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ratchet: error: "), got.stderr
    return lines[0]


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-worker", "two-workers"])
@pytest.mark.parametrize(
    ("argv", "version", "what"),
    [
        (["signal", "--key", "k1", "go"], 10, "signals"),
        (["redrive", "--all"], 4, "dead letters"),
        (["redrive", "--key", "k2"], 4, "dead letters"),
    ],
    ids=["signal", "redrive-all", "redrive-key"],
)
def test_an_old_state_whose_lock_cannot_be_opened_is_one_line(
    tmp_path: Path, workers: str, argv: list[str], version: int, what: str
) -> None:
    state = old_state_with_a_lock_that_cannot_be_opened(tmp_path, workers, version)
    line = one_line(cli(*argv, "--state", str(state)))
    # The directory given, the file that could not be opened, and what it must be.
    assert f"--state {state} cannot be used as a state directory" in line, line
    assert "Is a directory" in line and f"/{LOCK_NAME}'" in line, line
    assert f"its lock files, {LOCK_NAME} and supervisor.lock, plain files" in line, line
    assert f"it is at state schema {version}, before {what}" in line, line
    assert [schema(db) for db in databases(state)] == [version] * len(databases(state))
