"""Operating a running job on a standalone cluster through ratchet's own commands: `ratchet flink
status` (and `ratchet status --jobmanager`) with the agent operator's metrics, `ratchet flink
savepoint`, `ratchet flink stop --drain`, a resume from the savepoint, and `ratchet inspect
--flink-memory` on the memory the drained job wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet.flink import read_output_dir  # noqa: E402

from .cluster import wait_for  # noqa: E402
from .support import flink_env, submit_detached, write_inputs  # noqa: E402

pytestmark = pytest.mark.flink

RATCHET = [sys.executable, "-m", "ratchet.cli"]


def _ratchet(tmp: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [*RATCHET, *args], env=flink_env(tmp), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == code, f"{args}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _local(uri: str) -> Path:
    return Path(uri.removeprefix("file:").removeprefix("//"))


def test_status_savepoint_stop_resume_and_inspect(cluster: Any, tmp_path: Path) -> None:
    jm = cluster.jobmanager
    inputs = tmp_path / "in"
    inputs.mkdir()
    out = tmp_path / "out"
    first = [{"key": k, "v": i} for i, k in enumerate(["a", "b", 7] * 10)]
    write_inputs(inputs / "a.jsonl", first)
    job = submit_detached(cluster, tmp_path, inputs, out)
    try:
        wait_for(
            "30 outputs",
            lambda: len(read_output_dir(out)) >= 30,
            180,
            explain=lambda: cluster.explain(job),
        )

        listed = json.loads(
            _ratchet(tmp_path, "flink", "status", "--jobmanager", jm, "--json").stdout
        )
        assert {j["jid"]: j["state"] for j in listed}[job] == "RUNNING"

        def summary() -> dict[str, Any]:
            proc = _ratchet(tmp_path, "status", "--jobmanager", jm, "--job", job, "--json")
            return dict(json.loads(proc.stdout))

        # Operator metrics reach the REST API on the JobManager's fetch interval: wait for them.
        s = wait_for(
            "the agent operator's metrics",
            lambda: (got := summary())["ratchet"].get("ratchet.inputs") == 30 and got,
            90,
        )
        assert s["state"] == "RUNNING" and s["checkpoints"]["counts"]["completed"] >= 1, s
        assert s["ratchet"]["ratchet.outputs"] == 30, s
        assert s["ratchet"]["ratchet.runs_in_flight"] == 0, s
        # `ctx.metrics` counters: the action's own, and the engine's count of durable calls
        # (a dot in a counter's name is a `_` in the metric's identifier).
        counters = wait_for(
            "the ctx.metrics counters",
            lambda: (
                (got := summary()["ratchet"]).get("ratchet.counter.counted.total") == 30 and got
            ),
            90,
        )
        assert counters["ratchet.counter.durable_calls_made.total"] == 30, counters
        text = _ratchet(tmp_path, "flink", "status", job, "--jobmanager", jm).stdout
        assert "ratchet.inputs" in text and "RUNNING" in text, text
        assert "ratchet.counter.counted.total" in text, text

        sp = json.loads(
            _ratchet(
                tmp_path, "flink", "savepoint", job, "--target", str(tmp_path / "sp"),
                "--jobmanager", jm,
            ).stdout
        )  # fmt: skip
        assert (_local(sp["savepoint"]) / "_metadata").is_file(), sp
        assert cluster.job_status(job) == "RUNNING"  # a savepoint does not stop the job

        stopped = json.loads(
            _ratchet(
                tmp_path, "flink", "stop", job, "--target", str(tmp_path / "sp"),
                "--jobmanager", jm,
            ).stdout
        )  # fmt: skip
        wait_for("the job to finish", lambda: cluster.job_status(job) == "FINISHED", 60)
    finally:
        if cluster.job_status(job) == "RUNNING":
            cluster.cancel(job)

    # Resume from the stop's savepoint with more input; then stop it draining: its memory.
    second = [{"key": k, "v": 100 + i} for i, k in enumerate(["a", 7, "c"] * 5)]
    write_inputs(inputs / "b.jsonl", second)
    job = submit_detached(cluster, tmp_path, inputs, out, "--from-savepoint", stopped["savepoint"])
    try:
        wait_for(
            "45 outputs",
            lambda: len(read_output_dir(out)) >= 45,
            180,
            explain=lambda: cluster.explain(job),
        )
        _ratchet(
            tmp_path, "flink", "stop", job, "--drain", "--target", str(tmp_path / "sp"),
            "--jobmanager", jm,
        )  # fmt: skip
        wait_for("the job to finish", lambda: cluster.job_status(job) == "FINISHED", 60)
    finally:
        if cluster.job_status(job) == "RUNNING":
            cluster.cancel(job)

    outputs = read_output_dir(out)
    ids = Counter(r["id"] for r in outputs)
    assert len(outputs) == 45 and all(n == 1 for n in ids.values()), ids.most_common(3)
    want = Counter(str(r["key"]) for r in first + second)
    mem = json.loads(
        _ratchet(tmp_path, "inspect", "--flink-memory", str(tmp_path / "mem"), "--json").stdout
    )
    assert {k: v["n"] for k, v in mem.items()} == dict(want), mem
    one = json.loads(
        _ratchet(
            tmp_path, "inspect", "--flink-memory", str(tmp_path / "mem"), "--key", "7", "--json"
        ).stdout
    )
    assert one == {"7": {"n": want["7"]}}, one


def test_unknown_jobs_and_unreachable_jobmanagers_are_exit_2(cluster: Any, tmp_path: Path) -> None:
    jm = cluster.jobmanager
    for args, said in [
        (["flink", "status", "0" * 32, "--jobmanager", jm], "no job " + "0" * 32),
        (["flink", "stop", "0" * 32, "--jobmanager", jm], "no job " + "0" * 32),
        (["flink", "savepoint", "nope", "--jobmanager", jm], "not a Flink job id"),
        (["status", "--jobmanager", "127.0.0.1:9"], "cannot reach the JobManager"),
    ]:
        proc = _ratchet(tmp_path, *args, code=2)
        assert said in proc.stderr, (args, proc.stderr)
