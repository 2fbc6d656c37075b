"""SIGTERM or SIGINT (Ctrl-C) to a local `ratchet flink run` stops its job with a savepoint.

A run over a bounded input is stopped half way: exit 0, the summary says STOPPED and names a
savepoint, and stderr says how to continue. The same command continued from it with
`--follow` (and a new file in the input folder) finishes the first file's runs and the new
file's, each output committed once, no run committed before the stop executed again, every
key's memory going on (its counter has no gap and no repeat); Ctrl-C ends that watching run
the same way. A signal while the job starts waits for its tasks to run, then stops it with a
savepoint; a second signal once the stop has begun ends the command at once."""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet.flink import read_output_dir  # noqa: E402

from .cluster import end_tree, wait_for  # noqa: E402
from .support import (  # noqa: E402
    assert_once_counted,
    exec_log,
    flink_env,
    kill_test_cmd,
    write_inputs,
)

pytestmark = [pytest.mark.flink]

KEYS, FIRST, SECOND = 4, 12, 3


def stop(proc: subprocess.Popen[str], sig: int) -> tuple[str, str]:
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    return out, err


def test_a_signal_stops_the_job_with_a_savepoint_that_a_watching_run_continues(
    tmp_path: Path,
) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    first = [{"key": f"s{k}", "v": k * 100 + i} for i in range(FIRST) for k in range(KEYS)]
    write_inputs(inputs / "a.jsonl", first)
    env = flink_env(tmp_path)
    # The Slow agent's runs take 150 ms each, one at a time per key: 12 per key take about 2 s.
    proc = subprocess.Popen(
        kill_test_cmd(tmp_path, "Slow", inputs), env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for("an output to be committed", lambda: read_output_dir(tmp_path / "out"), 180, 0.05)
        out, err = stop(proc, signal.SIGTERM)
    finally:
        end_tree(proc)
    summary = json.loads(out.splitlines()[-1])
    assert summary["status"] == "STOPPED", out
    savepoint = summary["savepoint"]
    assert (Path(savepoint.removeprefix("file:")) / "_metadata").exists(), savepoint
    assert f"--from-savepoint {savepoint} --follow" in err, err[-2000:]
    committed = read_output_dir(tmp_path / "out")
    assert 0 < len(committed) < len(first), "the stop came after the whole input was done"
    log_mark = len(exec_log(tmp_path))

    second = [{"key": f"s{k}", "v": k * 100 + i} for i in range(FIRST, FIRST + SECOND)
              for k in range(KEYS)]  # fmt: skip
    write_inputs(inputs / "b.jsonl", second)
    every = first + second
    cmd = kill_test_cmd(tmp_path, "Slow", inputs, "--follow", "200", "--from-savepoint", savepoint)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(
            "every input's output",
            lambda: len(read_output_dir(tmp_path / "out")) >= len(every),
            240,
        )
        out, err = stop(proc, signal.SIGINT)
    finally:
        end_tree(proc)
    summary = json.loads(out.splitlines()[-1])
    assert summary["status"] == "STOPPED", out
    assert summary["savepoint"] != savepoint

    outputs: list[dict[str, Any]] = read_output_dir(tmp_path / "out")
    assert_once_counted(outputs, every, [f"s{k}" for k in range(KEYS)], FIRST + SECOND)
    # A run whose output was committed before the stop did not execute after it.
    after = Counter(tuple(ln[2:]) for ln in exec_log(tmp_path)[log_mark:] if ln[1] == "exec")
    for r in committed:
        assert after[(r["key"], str(r["seq"]), "r>handle")] == 0, (r, after)


@pytest.mark.parametrize("signals", [1, 2])
def test_a_signal_while_the_job_starts(tmp_path: Path, signals: int) -> None:
    """One signal: the stop waits until the job's tasks run (Flink takes no savepoint before),
    then stops with one. A second, once the stop has begun: the command ends at once."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_inputs(inputs / "a.jsonl", [{"key": f"s{k}", "v": k} for k in range(KEYS)])
    proc = subprocess.Popen(
        kill_test_cmd(tmp_path, "Slow", inputs, "--follow", "200"), env=flink_env(tmp_path),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert "job_id" in proc.stdout.readline()  # submitted (its tasks may still be starting)
        proc.send_signal(signal.SIGINT)
        seen = []
        while not seen or "stopping with a savepoint" not in seen[-1]:
            seen.append(proc.stderr.readline())
            assert seen[-1], f"ended before it said it was stopping: {seen}"
        if signals == 2:
            proc.send_signal(signal.SIGINT)  # only now: a signal sent twice at once arrives once
        out, err = proc.communicate(timeout=120)
    finally:
        end_tree(proc)
    assert "Traceback" not in err
    if signals == 2:
        assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
        assert "stopped without a savepoint" in err, err[-3000:]
    else:
        assert proc.returncode == 0, err[-3000:]
        summary = json.loads(out.splitlines()[-1])
        assert summary["status"] == "STOPPED"
        assert (Path(summary["savepoint"].removeprefix("file:")) / "_metadata").exists()
