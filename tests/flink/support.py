"""Helpers of the Flink suite: subprocess runs with contained temp dirs, outputs, memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
AGENTS = HERE / "agents.py"
CLI = [sys.executable, str(HERE / "_cli.py"), "flink", "run"]

# `RATCHET_FLINK_EXECUTION_MODE=thread` runs the suite's jobs in thread mode (FlinkConfig's
# default follows it). There the Python code runs inside the JVM: a test that kills a separate
# Python worker process has nothing to kill without taking the local mini-cluster with it.
THREAD_MODE = os.environ.get("RATCHET_FLINK_EXECUTION_MODE") == "thread"
kills_a_python_worker = pytest.mark.skipif(
    THREAD_MODE,
    reason="kills a separate Python worker process; in thread mode the Python code runs inside "
    "the TaskManager's JVM, whose loss the TaskManager SIGKILL tests cover",
)


def flink_env(tmp: Path, **extra: str) -> dict[str, str]:
    """Environment for anything that starts a JVM: temp files under `tmp`, not /tmp."""
    jtmp = tmp / "jvm-tmp"
    jtmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        TMPDIR=str(jtmp),
        JVM_ARGS=f"-Djava.io.tmpdir={jtmp}",
        RATCHET_TEST_EXEC_LOG=str(tmp / "exec.log"),
    )
    env.update(extra)
    return env


def run_cli(
    tmp: Path, args: list[str], timeout: float, **env: str
) -> subprocess.CompletedProcess[str]:
    """`ratchet flink run ...` on a local mini-cluster; fails with its stderr on error/timeout."""
    cmd = [*CLI, *args, "--tmp-dir", str(tmp / "flink-tmp")]
    try:
        proc = subprocess.run(
            cmd, env=flink_env(tmp, **env), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"flink job did not finish within {timeout:.0f}s: {' '.join(cmd)}\n"
            f"stderr tail: {(exc.stderr or b'')[-3000:]!r}"
        ) from None
    if proc.returncode != 0:
        raise AssertionError(f"flink job failed ({proc.returncode}):\n{proc.stderr[-5000:]}")
    return proc


def kill_test_cmd(tmp: Path, agent: str, inputs: Path, *extra: str) -> list[str]:
    """`ratchet flink run` as the Python-worker kill tests start it: `kill_test_args`, and
    Flink's temp files under `tmp`."""
    return [*CLI, *kill_test_args(tmp, agent, inputs, *extra), "--tmp-dir", str(tmp / "flink-tmp")]


def kill_test_args(tmp: Path, agent: str, inputs: Path, *extra: str) -> list[str]:
    """The arguments of a job whose worker may be killed: outputs in `tmp/out`, checkpoints
    every 100 ms in `tmp/checkpoints`, a 200 ms restart delay; `extra` arguments
    (`--follow MS`, `--memory-output DIR`) go before those."""
    return [
        f"{AGENTS}:{agent}",
        "--input",
        str(inputs),
        *extra,
        "--output",
        str(tmp / "out"),
        "--checkpoint-interval",
        "100",
        "--checkpoint-dir",
        str(tmp / "checkpoints"),
        "--restart-delay",
        "200",
    ]


def submit_detached(
    cluster: Any, tmp: Path, inputs: Path, out: Path, *extra: str, agent: str = "MeteredCounter"
) -> str:
    """`ratchet flink run` of `agent` from agents.py (its memory to `tmp/mem`) submitted
    detached to the standalone `cluster`, following `inputs`; returns the job id once it is
    RUNNING."""
    from .cluster import wait_for

    cmd = [
        *CLI, f"{AGENTS}:{agent}", "--input", str(inputs), "--output", str(out),
        "--memory-output", str(tmp / "mem"), "--jobmanager", cluster.jobmanager, "--detach",
        "--follow", "300", "--checkpoint-interval", "300",
        "--checkpoint-dir", str(tmp / "checkpoints"), "--tmp-dir", str(tmp / "flink-tmp"), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=flink_env(tmp), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"submit failed:\n{proc.stderr[-4000:]}"
    job_id = str(json.loads(proc.stdout.splitlines()[0])["job_id"])
    wait_for(f"job {job_id} RUNNING", lambda: cluster.job_status(job_id) == "RUNNING", 120)
    return job_id


def write_inputs(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def per_key(
    outputs: list[dict[str, Any]], renumber: bool = False
) -> dict[Any, list[dict[str, Any]]]:
    """Outputs grouped by key, sorted by (seq, task). With `renumber`, `seq` is made per key
    (the embedded engine numbers inputs across the whole source, Flink per key)."""
    grouped: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for rec in outputs:
        # The embedded JSONL sink stamps its state's job id; Flink's file sink has none.
        grouped[rec["key"]].append({k: v for k, v in rec.items() if k != "job"})
    result = {}
    for key, recs in grouped.items():
        recs.sort(key=lambda r: (r["seq"], r["task"], r["id"]))
        if renumber:
            local = {s: i for i, s in enumerate(sorted({r["seq"] for r in recs}))}
            recs = [
                dict(
                    r,
                    seq=local[r["seq"]],
                    id=f"{key}:{local[r['seq']]}:{r['task']}:{r['id'].rsplit(':', 1)[1]}",
                )
                for r in recs
            ]
        result[key] = recs
    return result


def embedded_memory(state: Path) -> dict[Any, dict[str, Any]]:
    from ratchet.runtime._memops import from_wire
    from ratchet.store import codec
    from ratchet.store._sqlite import SqliteStore

    store = SqliteStore.open_readonly(state)
    try:
        loaded = store.load()
    finally:
        store.close()
    return {codec.decode(k): from_wire(codec.decode(mem)) for k, _nd, mem, _v in loaded.keys}


def flink_memory(directory: Path) -> dict[Any, dict[str, Any]]:
    from ratchet.flink import decode_memory_line, read_output_dir

    return dict(decode_memory_line(r) for r in read_output_dir(directory))


def exec_log(tmp: Path) -> list[list[str]]:
    log = tmp / "exec.log"
    if not log.exists():
        return []
    return [line.split() for line in log.read_text().splitlines() if line]


def assert_once_counted(
    outputs: list[dict[str, Any]], rows: list[dict[str, Any]], keys: list[str], per_key: int
) -> None:
    """The Slow agent's outputs after kills or stops: every input's output exactly once, and
    each key's counter going 1..per_key in input order (memory went on: no gap, no repeat)."""
    from collections import Counter

    ids = Counter(r["id"] for r in outputs)
    assert all(n == 1 for n in ids.values()), f"duplicated outputs: {ids.most_common(3)}"
    assert sorted(r["output"]["v"] for r in outputs) == sorted(r["v"] for r in rows)
    for key in keys:
        mine = sorted((r for r in outputs if r["key"] == key), key=lambda r: r["seq"])
        assert [r["output"]["n"] for r in mine] == list(range(1, per_key + 1)), key
