"""A job's keyed state is laid out for its execution mode (process: byte arrays; thread: STRING
state under other names, since PyFlink's thread mode cannot read byte arrays back), and Flink
refuses a savepoint restored in the other mode (its job graph differs in an operator without a
uid) with a page of Java stack trace. `ratchet flink run --from-savepoint` therefore restores
in the mode the savepoint was taken in when no mode is named, and refuses a named mode that
differs before it starts a JVM (exit 2, the fix in the message). The first run leaves 2,000
keys of state, so the names are not at the head of `_metadata`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet.flink import read_output_dir  # noqa: E402

from .support import AGENTS, CLI, flink_env, run_cli, write_inputs  # noqa: E402

pytestmark = pytest.mark.flink

KEYS = 2000


@pytest.mark.parametrize("first", ["process", "thread"])
def test_a_savepoint_restores_in_its_own_mode_and_the_other_is_refused_clearly(
    tmp_path: Path, first: str
) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    rows = [{"key": "a", "v": 1}, {"key": 7, "v": 2}]
    rows += [{"key": f"k{i:05d}", "v": i} for i in range(KEYS)]
    write_inputs(inputs / "a.jsonl", rows)
    done = run_cli(
        tmp_path,
        [f"{AGENTS}:Counter", "--input", str(inputs), "--output", str(tmp_path / "out"),
         "--execution-mode", first],
        timeout=240,
    )  # fmt: skip
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["execution_mode"] == first
    savepoint = summary["savepoint"]

    # New inputs in a new file beside the old one.
    write_inputs(inputs / "b.jsonl", [{"key": "a", "v": 3}, {"key": "new", "v": 4}])
    other = "thread" if first == "process" else "process"
    restore = [
        *CLI, f"{AGENTS}:Counter", "--input", str(inputs), "--from-savepoint", savepoint,
        "--tmp-dir", str(tmp_path / "flink-tmp"),
    ]  # fmt: skip
    refused = subprocess.run(
        [*restore, "--output", str(tmp_path / "out-refused"), "--execution-mode", other],
        env=flink_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"was taken in {first} mode" in refused.stderr, refused.stderr[-3000:]
    assert f"--execution-mode {first}" in refused.stderr
    assert "Exception" not in refused.stderr and "Traceback" not in refused.stderr
    assert read_output_dir(tmp_path / "out-refused") == []

    # No mode named (and none in the environment): the savepoint's own. The restored job
    # reads only b.jsonl (a.jsonl is in the savepoint as read), runs it to completion, and
    # key a's counter goes on from its state.
    env = {k: v for k, v in flink_env(tmp_path).items() if k != "RATCHET_FLINK_EXECUTION_MODE"}
    again = subprocess.run(
        [*restore, "--output", str(tmp_path / "out2")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert again.returncode == 0, again.stderr[-5000:]
    summary2 = json.loads(again.stdout.splitlines()[-1])
    assert summary2["execution_mode"] == first
    assert summary2["savepoint"] != savepoint
    outputs = sorted((r["key"], r["output"]) for r in read_output_dir(tmp_path / "out2"))
    assert outputs == [("a", 2), ("new", 1)], outputs
