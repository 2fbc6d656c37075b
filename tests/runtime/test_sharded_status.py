"""`ratchet status` of a job run with `--workers 2`: what re-sharding wrote into the new
shards is not a restore (a brand-new sharded job reported one per shard) nor a completed
checkpoint, and a restart's
restores are shown with the latest of them (it was always `-`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

RATCHET = [sys.executable, "-m", "ratchet.cli"]


def _run(tmp_path: Path) -> None:
    agent = tmp_path / "echo.py"
    if not agent.exists():
        agent.write_text(
            "from ratchet import Agent, InputEvent, OutputEvent, action\n"
            "class Echo(Agent):\n"
            "    @action(InputEvent, inline=True)\n"
            "    def echo(self, event, ctx):\n"
            "        ctx.send_event(OutputEvent(output=event.input))\n"
        )
    argv = [*RATCHET, "run", f"{agent}:Echo", "--input", str(tmp_path / "in.jsonl"), "--output"]
    argv += [str(tmp_path / "o.jsonl"), "--state", str(tmp_path / "st"), "--workers", "2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _checkpoints(tmp_path: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [*RATCHET, "status", "--state", str(tmp_path / "st"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    found: dict[str, Any] = json.loads(proc.stdout)["checkpoints"]
    return found


def _own_checkpoints(tmp_path: Path) -> int:
    """The checkpoints the shards' workers took: each shard's ids count from its seed (1),
    the one re-sharding wrote into it, which is not the job's own. (How many a worker takes
    depends on timing: a periodic one may come before the final one.)"""
    from ratchet.store._sqlite import SqliteStore

    own = 0
    for db in sorted((tmp_path / "st" / "shards").glob("*/ratchet.db")):
        store = SqliteStore.open_readonly(db.parent)
        try:
            own += store.stats()["latest_completed"]["id"] - 1
        finally:
            store.close()
    return own


def test_a_new_sharded_job_restored_nothing_and_a_restart_says_what_it_restored(
    tmp_path: Path,
) -> None:
    (tmp_path / "in.jsonl").write_text('{"key": "a"}\n{"key": "b"}\n{"key": "c"}\n')
    _run(tmp_path)
    first = _checkpoints(tmp_path)
    assert first["counts"]["restored"] == 0
    # The workers' own checkpoints; not what re-sharding wrote into the new shards (it said
    # 4 after two final checkpoints).
    assert first["counts"]["completed"] == _own_checkpoints(tmp_path) >= 2, first
    assert first["latest_restored"] is None
    with open(tmp_path / "in.jsonl", "a") as fh:
        fh.write('{"key": "d"}\n')
    _run(tmp_path)
    second = _checkpoints(tmp_path)
    assert second["counts"]["restored"] == 2  # each worker restored its shard's checkpoint
    assert second["counts"]["completed"] == _own_checkpoints(tmp_path) >= 4, second
    latest = second["latest_restored"]
    assert latest is not None and latest["trigger_timestamp"] > 0
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 4


def test_what_re_sharding_wrote_carries_the_time_it_was_written(tmp_path: Path) -> None:
    """Each new shard's seed checkpoint was written at time 0: `ratchet checkpoints` listed
    `#1 1970-01-01T00:00:00.000Z` after the job went back to one worker."""
    (tmp_path / "in.jsonl").write_text("".join(f'{{"key": "k{i}"}}\n' for i in range(20)))
    _run(tmp_path)
    back = [*RATCHET, "run", f"{tmp_path / 'echo.py'}:Echo", "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "o.jsonl"), "--state", str(tmp_path / "st"),
            "--workers", "1"]  # fmt: skip
    done = subprocess.run(back, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    listed = subprocess.run(
        [*RATCHET, "checkpoints", "--state", str(tmp_path / "st"), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["checkpoints"]
    assert rows, listed.stdout
    assert all(not r["time"].startswith("1970") for r in rows), rows
