"""`--workers N` with a PostgreSQL sink: a shard whose state lost its history (its write-ahead
log removed after a kill) is refused before any worker starts when the table holds outputs of
keys that shard owns, as with a JSON Lines file (tests/store/test_first_start.py). Without
`holds_outputs_where` the check was skipped for this sink, and the shard's keys were run
again from their first input, repeating every durable call."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from connector_servers import RATCHET, Postgres

from ratchet.runtime._shards import read_layout, shard_of
from ratchet.store._sqlite import DB_NAME, SqliteStore

AGENT = f"{Path(__file__).parents[1] / 'kill' / 'kill_agent.py'}:KillAgent"
INPUTS = 1000
_names = itertools.count()


def _killed_after_outputs(
    pg: Postgres, tmp_path: Path, keys: int
) -> tuple[list[str], Path, str, dict[str, str]]:
    """A job of two workers SIGKILLed once 60 outputs are in its table: each shard's committed
    work is in its ratchet.db-wal, left as the kill left it."""
    name = f"shard_outs_{next(_names)}"
    with (tmp_path / "in.jsonl").open("w") as fh:
        for i in range(INPUTS):
            fh.write(json.dumps({"key": f"k{i % keys}", "id": i, "value": i}) + "\n")
    state = tmp_path / "st"
    argv = [*RATCHET, "run", AGENT, "--input", str(tmp_path / "in.jsonl"),
            "--output", f"{pg.dsn}?table={name}", "--state", str(state),
            "--checkpoint-interval", "20", "--workers", "2"]  # fmt: skip
    env = dict(os.environ, RATCHET_TEST_EXEC_LOG=str(tmp_path / "exec.log"))
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the job ended before the kill"
            assert time.monotonic() < deadline, "no progress in 60 s"
            made = pg.execute("SELECT to_regclass(%s) IS NOT NULL", (name,))[0][0]
            if made and pg.execute(f"SELECT count(*) FROM {name}")[0][0] >= 60:
                break
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)  # its workers die with it (PR_SET_PDEATHSIG)
        proc.wait()
    return argv, state, name, env


def _lose_log(shard: Path) -> None:
    for name in (DB_NAME + "-wal", DB_NAME + "-shm"):
        (shard / name).unlink(missing_ok=True)


def _ids(pg: Postgres, name: str) -> list[str]:
    return [r[0] for r in pg.execute(f"SELECT id FROM {name} ORDER BY id")]


@pytest.mark.kill
def test_a_removed_log_of_one_shard_is_refused_with_a_postgres_sink(
    postgres: Postgres, tmp_path: Path
) -> None:
    argv, state, name, env = _killed_after_outputs(postgres, tmp_path, keys=4)
    dirs = read_layout(state).dirs
    shard = dirs[shard_of("k1", len(dirs))]
    assert (shard / (DB_NAME + "-wal")).exists()
    _lose_log(shard)
    store = SqliteStore.open_readonly(shard)
    try:  # all of its history was in the log
        assert store.stats()["counts"]["completed"] == 0
    finally:
        store.close()
    outputs = _ids(postgres, name)
    assert any(i.startswith("k1:") for i in outputs)
    calls_before = (tmp_path / "exec.log").read_text()
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2, again.stderr
    assert (
        f"{shard / DB_NAME} has no completed checkpoint, but --output {postgres.dsn}?table="
        f"{name} (table {name}) holds outputs of its job" in again.stderr
    ), again.stderr
    assert f"remove {state} and write" in again.stderr and "Traceback" not in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert (tmp_path / "exec.log").read_text() == calls_before  # nothing ran again
    assert _ids(postgres, name) == outputs


@pytest.mark.slow
@pytest.mark.kill
def test_a_removed_log_of_a_shard_that_had_no_work_resumes_with_a_postgres_sink(
    postgres: Postgres, tmp_path: Path
) -> None:
    """One key: the other shard released nothing, so losing its log loses nothing, and the
    table's outputs (all of the busy shard's key) are no reason to refuse it."""
    argv, state, name, env = _killed_after_outputs(postgres, tmp_path, keys=1)
    dirs = read_layout(state).dirs
    busy = dirs[shard_of("k0", len(dirs))]
    (idle,) = [d for d in dirs if d != busy]
    _lose_log(idle)
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    ids = _ids(postgres, name)
    assert len(ids) == len(set(ids)) == INPUTS
