"""SIGKILL of the Python worker while the last runs of a bounded input are worked off (every
input admitted, every key still has queued runs). `ratchet flink run` runs a bounded input as a
stream until every input's run is done, so checkpoints keep completing meanwhile: outputs
committed before the kill are never produced again, the job ends with every output committed
exactly once and every key's memory exact, and it stops with a savepoint."""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet.flink import read_output_dir  # noqa: E402

from .cluster import descendants, end_tree, wait_for  # noqa: E402
from .support import (  # noqa: E402
    exec_log,
    flink_env,
    flink_memory,
    kill_test_cmd,
    kills_a_python_worker,
    write_inputs,
)

pytestmark = [pytest.mark.flink, pytest.mark.kill]

KEYS, PER_KEY = 6, 16


@kills_a_python_worker
def test_sigkill_while_the_last_runs_are_worked_off_loses_and_duplicates_nothing(
    tmp_path: Path,
) -> None:
    inputs = tmp_path / "in.jsonl"
    rows = [{"key": f"d{k}", "v": k * 100 + i} for i in range(PER_KEY) for k in range(KEYS)]
    write_inputs(inputs, rows)
    cmd = kill_test_cmd(tmp_path, "Slow", inputs, "--memory-output", str(tmp_path / "mem"))
    proc = subprocess.Popen(
        cmd, env=flink_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    killed = None
    try:
        # The whole input is admitted within milliseconds; its runs take 16 x 150 ms per key.
        # Kill once a third of them executed and a checkpoint committed outputs (on a loaded
        # machine the first checkpoint can take longer than a third of the runs).
        def execs() -> int:
            return sum(1 for ln in exec_log(tmp_path) if ln[1] == "exec")

        wait_for(
            "a third of the runs to execute and an output to be committed",
            lambda: execs() >= len(rows) // 3 and read_output_dir(tmp_path / "out"),
            180,
            every=0.05,
        )
        # The agent's Python worker: the process that logged the executions.
        killed = int(next(ln[0] for ln in exec_log(tmp_path) if ln[1] == "exec"))
        assert killed in descendants(proc.pid), "the worker is not under this command's JVM"
        before = read_output_dir(tmp_path / "out")  # committed by a checkpoint before the kill
        executed = execs()
        os.kill(killed, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        end_tree(proc)
    assert proc.returncode == 0, err[-4000:]

    log = exec_log(tmp_path)
    pids = {ln[0] for ln in log if ln[1] == "exec"}
    assert str(killed) in pids and len(pids) >= 2, "no worker ran after the kill"
    # Checkpoints completed while the keys worked through their inputs (with the whole input
    # in, a bounded source's end would have blocked them until the last run).
    assert before and executed < len(rows), (
        f"the kill came after every run had executed ({executed}): nothing was left to drain"
    )
    assert '"savepoint"' in out, out
    outputs = read_output_dir(tmp_path / "out")
    ids = Counter(r["id"] for r in outputs)
    assert all(n == 1 for n in ids.values()), f"duplicated outputs: {ids.most_common(3)}"
    assert sorted(r["output"]["v"] for r in outputs) == sorted(r["v"] for r in rows)
    # Runs whose outputs a checkpoint had committed before the kill never ran again.
    execs = Counter(tuple(ln[2:]) for ln in log if ln[1] == "exec")
    for r in before:
        assert execs[(r["key"], str(r["seq"]), "r>handle")] == 1, (r, execs)
    memory = flink_memory(tmp_path / "mem")
    assert memory == {f"d{k}": {"seen": [k * 100 + i for i in range(PER_KEY)]} for k in range(KEYS)}
    for k in range(KEYS):
        mine = sorted((r for r in outputs if r["key"] == f"d{k}"), key=lambda r: r["seq"])
        assert [r["output"]["n"] for r in mine] == list(range(1, PER_KEY + 1))
