"""`ratchet run --workers 2 --follow`: the coordinator restarts a shard's killed worker at most
RESTARTS times in a row, and a worker that ran RESET_AFTER seconds since its restore starts
that count again, so a job that runs for months is not stopped by kills weeks apart.

The limits are set low in the job's own process (RESTARTS 1, RESET_AFTER 1 s), as the
constants would be after months; the workers are real forked processes, SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ratchet.runtime._multiproc import PIDS_FILE
from ratchet.runtime._shards import shard_of
from support.procs import kill, wait_for

pytestmark = [pytest.mark.kill, pytest.mark.slow]

AGENT = f"{Path(__file__).with_name('kill_agent.py')}:KillAgent"
KEYS = 8
# `ratchet run` with the coordinator's restart budget set low (RESTARTS 1, RESET_AFTER as the
# first argument); the forked workers inherit the module as set.
RUN = (
    "import sys; import ratchet.runtime._multiproc as m; m.RESTARTS = 1; "
    "m.RESET_AFTER = float(sys.argv.pop(1)); from ratchet.cli import main; "
    "sys.argv[0] = 'ratchet'; sys.exit(main())"
)


def _append(inp: Path, lo: int, hi: int) -> None:
    with inp.open("a") as fh:
        for i in range(lo, hi):
            fh.write(json.dumps({"key": f"k{i % KEYS}", "id": i, "value": i % 97}) + "\n")


def _outputs(out: Path) -> list[dict[str, object]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]


def _start(tmp: Path, reset_after: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable, "-c", RUN, str(reset_after), "run", AGENT,
            "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl"),
            "--state", str(tmp / "state"), "--workers", "2", "--follow",
            "--checkpoint-interval", "50",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def _worker(tmp: Path, shard: int) -> int:
    return int(
        json.loads((tmp / "state" / "shards" / PIDS_FILE).read_text())["workers"][str(shard)]
    )


def _kill_shard0_after(tmp: Path, proc: subprocess.Popen[bytes], n: int, ran: float) -> int:
    """Append inputs up to `n`, wait for all their outputs (the current workers restored and
    running), let shard 0's worker run `ran` seconds more, SIGKILL it; its pid."""
    have = len(_outputs(tmp / "out.jsonl"))
    _append(tmp / "in.jsonl", have, n)
    wait_for(lambda: len(_outputs(tmp / "out.jsonl")) >= n, proc, f"{n} outputs", limit=60)
    time.sleep(ran)
    pid = _worker(tmp, 0)
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_shard_worker_that_ran_long_enough_starts_the_count_again(tmp_path: Path) -> None:
    """Three kills of shard 0's worker, each after it ran past RESET_AFTER: each is restart 1
    of 1, the job goes on, and every input's output is there once."""
    assert {shard_of(f"k{i}", 2) for i in range(KEYS)} == {0, 1}  # both shards have keys
    (tmp_path / "in.jsonl").touch()
    proc = _start(tmp_path, reset_after=1.0)
    try:
        killed = []
        for round_ in range(1, 4):
            pid = _kill_shard0_after(tmp_path, proc, 40 * round_, ran=1.5)
            killed.append(pid)
            wait_for(lambda: _worker(tmp_path, 0) not in killed, proc, "shard 0's new worker", 60)
        _append(tmp_path / "in.jsonl", 120, 160)
        wait_for(lambda: len(_outputs(tmp_path / "out.jsonl")) >= 160, proc, "160 outputs", 60)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode == 0, text[-3000:]
    assert text.count("1/1 in a row") == 3, text[-3000:]
    seqs = sorted(int(str(o["seq"])) for o in _outputs(tmp_path / "out.jsonl"))
    assert seqs == list(range(160)), "an output lost or written twice"


def test_kills_in_a_row_still_stop_the_job(tmp_path: Path) -> None:
    """The control: with no reset (RESET_AFTER 0), the second kill of the same shard's worker
    is one too many for RESTARTS 1, and the job stops with an error naming it."""
    (tmp_path / "in.jsonl").touch()
    proc = _start(tmp_path, reset_after=0.0)
    try:
        first = _kill_shard0_after(tmp_path, proc, 40, ran=1.5)
        wait_for(lambda: _worker(tmp_path, 0) != first, proc, "shard 0's new worker", 60)
        _kill_shard0_after(tmp_path, proc, 80, ran=1.5)
        _, raw = proc.communicate(timeout=60)
    except BaseException:
        kill(proc)
        raise
    err = raw.decode()
    assert proc.returncode not in (0, None), err[-3000:]
    assert "killed again after 1 restarts in a row" in err, err[-3000:]
