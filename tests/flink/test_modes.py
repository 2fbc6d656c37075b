"""A job's keyed state is laid out for its execution mode (process: byte arrays; thread: STRING
state under other names, since PyFlink's thread mode cannot read byte arrays back). A savepoint
restored in the other mode is refused by Flink: the two modes' job graphs differ in an operator
without a uid, whose state Flink cannot map (with `--allow-non-restored-state` the agent's state
did not come back: docs/flink.md says never to restore across modes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from .support import AGENTS, CLI, flink_env, run_cli, write_inputs  # noqa: E402

pytestmark = [
    pytest.mark.flink,
    # Thread mode is experimental (docs/flink.md): its jobs run in the thread-mode suite,
    # `make test-flink-thread`; in a fresh-clone run of `make test-flink` a thread-mode local
    # job once failed with "MiniCluster is not yet running or has already been shut down".
    pytest.mark.skipif(
        os.environ.get("RATCHET_FLINK_EXECUTION_MODE") != "thread",
        reason="thread mode is experimental: run `make test-flink-thread`",
    ),
]


@pytest.mark.parametrize(("first", "then"), [("process", "thread"), ("thread", "process")])
def test_a_savepoint_restored_in_the_other_mode_is_refused(
    tmp_path: Path, first: str, then: str
) -> None:
    import subprocess

    write_inputs(tmp_path / "a.jsonl", [{"key": "a", "v": 1}, {"key": 7, "v": 2}])
    done = run_cli(
        tmp_path,
        [f"{AGENTS}:Counter", "--input", str(tmp_path / "a.jsonl"), "--output",
         str(tmp_path / "out"), "--execution-mode", first],
        timeout=240,
    )  # fmt: skip
    savepoint = json.loads(done.stdout.splitlines()[-1])["savepoint"]
    write_inputs(tmp_path / "b.jsonl", [{"key": "a", "v": 3}])
    cmd = [
        *CLI, f"{AGENTS}:Counter", "--input", str(tmp_path / "b.jsonl"), "--output",
        str(tmp_path / "out2"), "--execution-mode", then, "--from-savepoint", savepoint,
        "--restart-strategy", "none", "--tmp-dir", str(tmp_path / "flink-tmp"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=flink_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0, proc.stdout
    assert "Cannot map checkpoint/savepoint state for operator" in proc.stderr, proc.stderr[-3000:]
