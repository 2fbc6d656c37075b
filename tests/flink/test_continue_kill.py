"""SIGKILL of the Python worker while a run continued from a savepoint works off its new inputs.

A local `ratchet flink run` to completion ends with a savepoint; the next run, given it and an
input folder with a new file, reads only that file and runs it to completion. Killed half way,
Flink restores the continued job from its own last checkpoint: the new file's outputs are each
committed once, runs committed before the kill never run again, every key's memory goes on from
the first run's (its counter counts the first file's inputs too), and the run knows when it is
done although the restore replays admissions it had already counted."""

from __future__ import annotations

import json
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
    kill_test_cmd,
    kills_a_python_worker,
    write_inputs,
)

pytestmark = [pytest.mark.flink, pytest.mark.kill]

KEYS, FIRST, SECOND = 6, 3, 12


@kills_a_python_worker
def test_sigkill_in_a_continued_run_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    first = [{"key": f"c{k}", "v": k * 100 + i} for i in range(FIRST) for k in range(KEYS)]
    write_inputs(inputs / "a.jsonl", first)
    env = flink_env(tmp_path)
    done = subprocess.run(
        kill_test_cmd(tmp_path, "Slow", inputs), env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    savepoint = json.loads(done.stdout.splitlines()[-1])["savepoint"]
    before_second = {r["id"] for r in read_output_dir(tmp_path / "out")}
    assert len(before_second) == len(first)
    log_mark = len(exec_log(tmp_path))

    second = [{"key": f"c{k}", "v": k * 100 + i} for i in range(FIRST, FIRST + SECOND)
              for k in range(KEYS)]  # fmt: skip
    write_inputs(inputs / "b.jsonl", second)
    cmd = kill_test_cmd(tmp_path, "Slow", inputs, "--from-savepoint", savepoint)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def new_execs() -> list[list[str]]:
        return [ln for ln in exec_log(tmp_path)[log_mark:] if ln[1] == "exec"]

    def new_outputs() -> list[dict[str, object]]:
        return [r for r in read_output_dir(tmp_path / "out") if r["id"] not in before_second]

    killed = None
    try:
        wait_for(
            "a third of the new runs to execute and one of their outputs to be committed",
            lambda: len(new_execs()) >= len(second) // 3 and new_outputs(),
            180,
            every=0.05,
        )
        killed = int(new_execs()[0][0])
        assert killed in descendants(proc.pid), "the worker is not under this command's JVM"
        committed = new_outputs()
        executed = len(new_execs())
        os.kill(killed, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        end_tree(proc)
    assert proc.returncode == 0, err[-4000:]
    assert executed < len(second), f"every new run had executed ({executed}) before the kill"
    assert {ln[0] for ln in new_execs()} - {str(killed)}, "no worker ran after the kill"
    assert json.loads(out.splitlines()[-1])["savepoint"] != savepoint

    outputs = new_outputs()
    ids = Counter(r["id"] for r in outputs)
    assert all(n == 1 for n in ids.values()), f"duplicated outputs: {ids.most_common(3)}"
    assert sorted(r["output"]["v"] for r in outputs) == sorted(r["v"] for r in second)  # type: ignore[index]
    # A key's memory went on from the first run: its counter starts after the first file.
    for k in range(KEYS):
        mine = sorted((r for r in outputs if r["key"] == f"c{k}"), key=lambda r: r["seq"])  # type: ignore[arg-type,return-value]
        assert [r["output"]["n"] for r in mine] == list(range(FIRST + 1, FIRST + SECOND + 1))  # type: ignore[index]
    # Runs whose outputs a checkpoint had committed before the kill never ran again, and no run
    # of the first file ran in the continued one.
    execs = Counter(tuple(ln[2:]) for ln in new_execs())
    for r in committed:
        assert execs[(r["key"], str(r["seq"]), "r>handle")] == 1, (r, execs)
    assert all(int(seq) >= FIRST for _key, seq, _task in execs), execs
