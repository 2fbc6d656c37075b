"""`ratchet flink run` again, into an output folder that holds an earlier run's outputs.

A new run would write every output again (a Flink job starts from nothing unless it restores a
savepoint): it is refused, exit 2, naming what continues the earlier run. After a run that
finished, that is its savepoint; after a SIGKILL of the command itself (its mini-cluster dies
with it), the last checkpoint it retained in the output folder's `_checkpoints`, from which a
watching run goes on: every output once, no run whose output was committed executed again,
every key's counter without a gap or a repeat."""

from __future__ import annotations

import json
import re
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
    AGENTS,
    CLI,
    assert_once_counted,
    exec_log,
    flink_env,
    run_cli,
    write_inputs,
)

pytestmark = [pytest.mark.flink, pytest.mark.kill]

KEYS, PER_KEY = 4, 14


def command(tmp: Path, *extra: str) -> list[str]:
    """A local run of the Slow agent (150 ms per run) with no --checkpoint-dir."""
    return [
        *CLI, f"{AGENTS}:Slow", "--input", str(tmp / "in"), "--output", str(tmp / "out"),
        "--checkpoint-interval", "200", "--tmp-dir", str(tmp / "flink-tmp"), *extra,
    ]  # fmt: skip


def refused(tmp: Path) -> str:
    done = subprocess.run(
        command(tmp), env=flink_env(tmp), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr, done.stderr
    return done.stderr


def test_a_finished_runs_output_folder_is_refused_naming_its_savepoint(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    write_inputs(tmp_path / "in" / "a.jsonl", [{"key": "a", "v": 1}, {"key": "b", "v": 2}])
    done = run_cli(
        tmp_path,
        [f"{AGENTS}:Counter", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")],
        timeout=240,
    )
    savepoint = json.loads(done.stdout.splitlines()[-1])["savepoint"]
    before = read_output_dir(tmp_path / "out")
    err = refused(tmp_path)
    assert re.search(r"holds [1-9]\d* output file\(s\) of an earlier run", err), err
    assert f"--from-savepoint {savepoint.removeprefix('file:')}," in err, err
    assert read_output_dir(tmp_path / "out") == before


def test_sigkill_of_the_command_then_the_same_command_continues_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    (tmp_path / "in").mkdir()
    rows = [{"key": f"s{k}", "v": k * 100 + i} for i in range(PER_KEY) for k in range(KEYS)]
    write_inputs(tmp_path / "in" / "a.jsonl", rows)
    env = flink_env(tmp_path)
    with (tmp_path / "first.log").open("w") as log:
        proc = subprocess.Popen(command(tmp_path), env=env, stdout=log, stderr=log, text=True)
    try:
        wait_for(
            "a third of the outputs to be committed",
            lambda: len(read_output_dir(tmp_path / "out")) >= len(rows) // 3,
            180,
            every=0.05,
        )
        committed = read_output_dir(tmp_path / "out")
        proc.send_signal(signal.SIGKILL)  # the command, and the mini-cluster inside it
        proc.wait(timeout=30)
    finally:
        end_tree(proc)
    assert len(committed) < len(rows), "the job was done before the kill"
    log_mark = len(exec_log(tmp_path))

    err = refused(tmp_path)
    at = err.index("--from-savepoint ") + len("--from-savepoint ")
    checkpoint = err[at:].split()[0]
    assert f"{tmp_path / 'out' / '_checkpoints'}/" in checkpoint and "/chk-" in checkpoint, err
    assert "--follow MS" in err, err

    proc = subprocess.Popen(
        command(tmp_path, "--from-savepoint", checkpoint, "--follow", "200"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(
            "every input's output",
            lambda: len(read_output_dir(tmp_path / "out")) >= len(rows),
            240,
        )
        proc.send_signal(signal.SIGTERM)
        out, stderr = proc.communicate(timeout=120)
    finally:
        end_tree(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert json.loads(out.splitlines()[-1])["status"] == "STOPPED"

    outputs: list[dict[str, Any]] = read_output_dir(tmp_path / "out")
    assert_once_counted(outputs, rows, [f"s{k}" for k in range(KEYS)], PER_KEY)
    after = Counter(tuple(ln[2:]) for ln in exec_log(tmp_path)[log_mark:] if ln[1] == "exec")
    for r in committed:
        assert after[(r["key"], str(r["seq"]), "r>handle")] == 0, (r, after)
