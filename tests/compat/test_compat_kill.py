"""A Flink Agents agent on the local environment with a state directory survives SIGKILL
like a native ratchet agent: every output once, memory exact, no durable call repeated."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ratchet

SCRIPT = Path(__file__).with_name("kill_script.py")
SRC = Path(__file__).resolve().parents[2] / "src"


def _start(state: Path, work: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(state), str(work), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_sigkill_mid_run_then_restart_gives_each_output_once(tmp_path: Path) -> None:
    state, work = tmp_path / "state", tmp_path / "work"
    work.mkdir()
    job = _start(state, work, "pause")
    try:
        while not (work / "paused").exists():
            assert job.poll() is None, job.communicate()[1]
            time.sleep(0.02)
    finally:
        job.send_signal(signal.SIGKILL)
        job.communicate()
    # The charge for the paused input returned before the kill.
    assert "ann:stop" in (work / "charges.log").read_text().splitlines()

    done = _start(state, work)
    stdout, stderr = done.communicate(timeout=120)
    assert done.returncode == 0, stderr
    outputs = ast.literal_eval(stdout.strip().splitlines()[-1])
    assert outputs == [
        {"ann": "receipt-ann-tea#1"},
        {"bo": "receipt-bo-cake#1"},
        {"ann": "receipt-ann-stop#2"},
        {"bo": "receipt-bo-pie#2"},
        {"ann": "receipt-ann-jam#3"},
    ]
    charges = (work / "charges.log").read_text().splitlines()
    assert sorted(charges) == sorted(["ann:tea", "bo:cake", "ann:stop", "bo:pie", "ann:jam"]), (
        "a durable call that returned was made again"
    )
    with ratchet.open_state(state) as st:
        assert st.memory("ann") == {"seen": 3}
        assert st.memory("bo") == {"seen": 2}
