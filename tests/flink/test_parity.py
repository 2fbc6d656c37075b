"""Semantics parity: the same agent over the same input gives the same outputs and memory on the
Flink engine (a local mini-cluster) as on the embedded engine, with and without a crash."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

import ratchet  # noqa: E402
from ratchet.agents._run import load_agent  # noqa: E402
from ratchet.flink import read_output_dir  # noqa: E402

from .support import (  # noqa: E402
    AGENTS,
    embedded_memory,
    exec_log,
    flink_memory,
    kill_test_args,
    kills_a_python_worker,
    per_key,
    run_cli,
    write_inputs,
)

pytestmark = pytest.mark.flink

ROWS = [{"key": f"k{i % 3}", "v": i} for i in range(12)]


def embedded(tmp: Path, monkeypatch: pytest.MonkeyPatch, inputs: Path) -> tuple[dict, dict]:
    monkeypatch.setenv("RATCHET_TEST_EXEC_LOG", str(tmp / "embedded-exec.log"))
    out = tmp / "embedded.jsonl"
    ratchet.run(
        load_agent(f"{AGENTS}:ScenarioAgent"),
        inputs=str(inputs),
        output=str(out),
        state_dir=tmp / "embedded-state",
    )
    import json

    outputs = [json.loads(line) for line in out.read_text().splitlines()]
    return per_key(outputs, renumber=True), embedded_memory(tmp / "embedded-state")


def flink(tmp: Path, inputs: Path, **env: str) -> tuple[dict, dict]:
    run_cli(
        tmp,
        kill_test_args(tmp, "ScenarioAgent", inputs, "--memory-output", str(tmp / "mem")),
        timeout=180,
        **env,
    )
    return per_key(read_output_dir(tmp / "out")), flink_memory(tmp / "mem")


def test_outputs_and_memory_match_the_embedded_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = tmp_path / "in.jsonl"
    write_inputs(inputs, ROWS)
    want_out, want_mem = embedded(tmp_path, monkeypatch, inputs)
    got_out, got_mem = flink(tmp_path, inputs)
    assert got_out == want_out
    assert got_mem == want_mem
    # Ordering and FIFO commit, spelled out: inputs in order per key; the slow child's write
    # lands before the fast one's although the fast one finishes first.
    assert got_mem["k0"]["order"] == [0, 3, 6, 9]
    assert got_mem["k0"]["last"] == "fast"
    # The fast child's emit sees the slow child's sensory write: slow committed first.
    assert [o["output"] for o in got_out["k1"][:2]] == [
        {"by": "fast", "value": 4, "sensory": 1},
        {"by": "slow", "value": 1, "sensory": 1},
    ]
    assert type(got_mem["k2"]["blob"]) is bytes and got_mem["k2"]["blob"] == bytes([11, 0, 255])


@kills_a_python_worker
def test_after_a_worker_crash_replay_gives_the_same_outputs_and_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Python worker dies (os._exit) while `slow` of input v=7 waits and its sibling `fast`
    has finished but cannot commit (FIFO). Flink restarts from its last checkpoint and replays:
    outputs (exactly once) and memory are the embedded engine's. What is not re-executed is
    checked by the TaskManager kill test, where checkpoints are known to cover the parked run."""
    inputs = tmp_path / "in.jsonl"
    write_inputs(inputs, ROWS)
    want_out, want_mem = embedded(tmp_path, monkeypatch, inputs)
    crash = tmp_path / "crash"
    crash.mkdir()
    got_out, got_mem = flink(tmp_path, inputs, RATCHET_TEST_CRASH=str(crash))
    assert (crash / "crashed").exists(), "the worker never crashed: the test did not test replay"
    assert got_out == want_out
    assert got_mem == want_mem
    crashed_pid = (crash / "crashed").read_text()
    log = exec_log(tmp_path)
    assert any(line[0] != crashed_pid for line in log if line[1] == "exec"), "no restart seen"
