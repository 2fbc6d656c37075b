"""A followed (unbounded) input whose Python worker is SIGKILLed three times while every key has
runs in flight: after each restore every key runs again, and all its outputs are committed
exactly once. There is no end of input here to fire end timers, so a key whose restored state
has work and no processing-time timer would never run again: PyFlink's process mode leaves the
timers of the bundle a checkpoint barrier finishes out of that checkpoint, and before the wake
registries (docs/flink.md) this test lost the key whose inputs came last in about one run in
ten (in 1 of 12 loop runs, and in a CI run)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet.flink import read_output_dir  # noqa: E402

from .cluster import descendants, end_tree, wait_for  # noqa: E402
from .support import (  # noqa: E402
    assert_once_counted,
    exec_log,
    flink_env,
    kill_test_cmd,
    kills_a_python_worker,
    write_inputs,
)

pytestmark = [pytest.mark.flink, pytest.mark.kill]

KEYS, PER_KEY, KILLS = 6, 10, 3


@kills_a_python_worker
def test_every_key_runs_again_after_each_worker_kill_on_a_followed_input(tmp_path: Path) -> None:
    rows = [{"key": f"f{k}", "v": k * 100 + i} for i in range(PER_KEY) for k in range(KEYS)]
    (tmp_path / "in").mkdir()
    write_inputs(tmp_path / "in" / "a.jsonl", rows)
    cmd = kill_test_cmd(tmp_path, "Slow", tmp_path / "in", "--follow", "60000")
    with (tmp_path / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(
            cmd, env=flink_env(tmp_path), stdout=subprocess.DEVNULL, stderr=err, text=True
        )

    def runs_done() -> int:
        return len({(ln[2], ln[3]) for ln in exec_log(tmp_path) if ln[1] == "exec"})

    killed: list[str] = []
    try:
        for n in range(KILLS):
            # Kill the worker that is running now, once it ran a few more runs.
            goal = (n + 1) * len(rows) // (KILLS + 2)
            wait_for(f"{goal} runs to execute", lambda g=goal: runs_done() >= g, 240, every=0.05)
            pid = next(ln[0] for ln in reversed(exec_log(tmp_path)) if ln[1] == "exec")
            assert int(pid) in descendants(proc.pid), "the worker is not under this command's JVM"
            os.kill(int(pid), signal.SIGKILL)
            killed.append(pid)
        # Every input's output committed, whatever the kills interrupted.
        wait_for(
            "every output to be committed",
            lambda: len(read_output_dir(tmp_path / "out")) >= len(rows),
            240,
            every=0.5,
        )
    finally:
        end_tree(proc)
    pids = {ln[0] for ln in exec_log(tmp_path) if ln[1] == "exec"}
    assert set(killed) <= pids and len(pids) >= KILLS + 1, (killed, pids)
    outputs = read_output_dir(tmp_path / "out")
    assert_once_counted(outputs, rows, [f"f{k}" for k in range(KEYS)], PER_KEY)
