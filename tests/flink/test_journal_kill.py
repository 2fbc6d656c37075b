"""The external call journal on a standalone cluster: no durable call that had returned is made
again, neither after a TaskManager SIGKILL nor after a stop-with-savepoint and a resume.

The agent (`agents.Journaled`) makes two durable calls per input and notes each real call
("call journaled KEY V") and each result back in the action ("returned KEY V") in a log outside
ratchet's state. A result back in the action was committed to PostgreSQL first, so every call
noted as returned before the kill (or the stop) must be noted as made exactly once at the end.
Calls in flight at the kill are made again (they had not returned): that is allowed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet.flink import read_output_dir  # noqa: E402

from .cluster import descendants, kill_pids, running, wait_for  # noqa: E402
from .support import AGENTS, CLI, exec_log, flink_env, write_inputs  # noqa: E402

pytestmark = [pytest.mark.flink, pytest.mark.kill]

KEYS = 6


def _submit(cluster, tmp: Path, inputs: Path, out: Path, dsn: str, *extra: str) -> str:
    cmd = [
        *CLI, f"{AGENTS}:Journaled", "--input", str(inputs), "--output", str(out),
        "--jobmanager", cluster.jobmanager, "--detach", "--follow", "300",
        "--checkpoint-interval", "300", "--checkpoint-dir", str(tmp / "checkpoints"),
        "--restart-delay", "500", "--restart-attempts", "1000", "--tmp-dir", str(tmp / "flink-tmp"), *extra,
    ]  # fmt: skip
    env = flink_env(tmp, RATCHET_CALL_JOURNAL=dsn)  # the URI through the environment
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"submit failed:\n{proc.stderr[-4000:]}"
    said = json.loads(proc.stdout.splitlines()[0])
    job_id, NAMESPACE[0] = said["job_id"], said["call_journal_namespace"]
    wait_for(f"job {job_id} RUNNING", lambda: cluster.job_status(job_id) == "RUNNING", 120)
    return str(job_id)


NAMESPACE = [""]  # the journal namespace the last submission printed


def _rows(start: int, n: int) -> list[dict[str, int | str]]:
    return [{"key": f"k{i % KEYS}", "v": i} for i in range(start, start + n)]


def _returned(log: list[list[str]]) -> set[tuple[str, str]]:
    return {(ln[2], ln[3]) for ln in log if ln[1] == "returned"}


def _made(log: list[list[str]]) -> Counter[tuple[str, str]]:
    return Counter((ln[3], ln[4]) for ln in log if ln[1:3] == ["call", "journaled"])


def _gone(pid: int) -> bool:
    return not running(pid)


def test_no_returned_call_is_made_again_after_a_kill_or_a_savepoint(
    cluster, postgres, tmp_path: Path
) -> None:
    logdir = cluster.exec_log.parent
    inputs = tmp_path / "in"
    inputs.mkdir()
    out = tmp_path / "out"
    first = _rows(0, 240)
    write_inputs(inputs / "a.jsonl", first)
    job = _submit(cluster, tmp_path, inputs, out, postgres.dsn)
    start_log = len(exec_log(logdir))
    try:
        wait_for(
            "60 calls to return and 2 checkpoints to complete",
            lambda: (
                len(_returned(exec_log(logdir)[start_log:])) >= 60
                and cluster.checkpoints(job)["counts"]["completed"] >= 2
            ),
            300,
        )
        tms = cluster.taskmanager_pids()
        assert len(tms) == 1, tms
        workers = descendants(tms[0])
        os.kill(tms[0], signal.SIGKILL)
        wait_for("the TaskManager to be gone", lambda: _gone(tms[0]), 30)
        try:
            wait_for("its Python workers to end", lambda: all(_gone(p) for p in workers), 60)
        finally:
            kill_pids([p for p in workers if not _gone(p)])
        # Every result back in an action by now was committed to the journal before.
        log = exec_log(logdir)[start_log:]
        before_kill = _returned(log)
        cluster.start_taskmanager()
        wait_for(
            "the job to restore",
            lambda: cluster.checkpoints(job)["counts"]["restored"] >= 1,
            300,
        )
        wait_for("all 240 outputs", lambda: len(read_output_dir(out)) >= 240, 600)
        log = exec_log(logdir)[start_log:]
        made = _made(log)
        again = sorted(c for c in before_kill if made[c] > 1)
        in_flight = sorted(c for c, n in made.items() if n > 1 and c not in before_kill)
        print(
            f"\nTaskManager SIGKILL: {len(before_kill)} calls had returned, {len(again)} of them "
            f"made again; {len(in_flight)} calls in flight at the kill were made again"
        )
        assert again == [], again

        # Stop with a savepoint while runs are in flight, resume from it: the same namespace.
        second = _rows(240, 120)
        write_inputs(inputs / "b.jsonl", second)
        mark = len(exec_log(logdir))
        wait_for(
            "30 calls of the new inputs to return",
            lambda: len(_returned(exec_log(logdir)[mark:])) >= 30,
            300,
        )
        savepoint = cluster.stop_with_savepoint(job, tmp_path / "savepoints")
        stopped = exec_log(logdir)
        before_stop = _returned(stopped[start_log:])
        job = _submit(cluster, tmp_path, inputs, out, postgres.dsn, "--from-savepoint", savepoint)
        wait_for("all 360 outputs", lambda: len(read_output_dir(out)) >= 360, 600)
        # A call that had returned before the stop is never made after it. (Counting all its
        # makings instead would blame the savepoint for the calls in flight at the kill above,
        # rightly made again after that restore and returned later.)
        made_after = _made(exec_log(logdir)[len(stopped) :])
        again_sp = sorted(c for c in before_stop if made_after[c] > 0)
        print(
            f"stop-with-savepoint: {len(before_stop)} calls had returned, {len(again_sp)} of "
            f"them made again"
        )
        assert again_sp == [], again_sp
    finally:
        cluster.cancel(job)

    # The detached job's journal, pruned by `ratchet flink prune-journal` (margin 0: every run
    # completed before the last checkpoint's trigger); what stays is at most the runs after it.
    from ratchet.connectors._pg_journal import PostgresCallJournal

    journal = PostgresCallJournal(postgres.dsn, NAMESPACE[0])
    try:
        rows = journal.count()
        proc = subprocess.run(
            [sys.executable, "-m", "ratchet.cli", "flink", "prune-journal", job, "--once",
             "--call-journal-namespace", NAMESPACE[0], "--call-journal-margin", "0",
             "--jobmanager", cluster.jobmanager],
            env=flink_env(tmp_path, RATCHET_CALL_JOURNAL=postgres.dsn),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        pruned = json.loads(proc.stdout)["pruned"]
        left = journal.count()
    finally:
        journal.close()
    print(f"prune-journal: {rows} rows, {pruned} pruned, {left} left")
    assert pruned > 0 and left == rows - pruned and left < 2 * 2 * KEYS, (rows, pruned, left)

    outputs = read_output_dir(out)
    ids = Counter(r["id"] for r in outputs)
    assert all(n == 1 for n in ids.values()), f"duplicated outputs: {ids.most_common(3)}"
    assert sorted(r["output"]["v"] for r in outputs) == list(range(360))
    last = {}
    for r in sorted(outputs, key=lambda r: (r["key"], r["seq"])):
        last[r["key"]] = r["output"]
    for k in range(KEYS):
        vs = [r["v"] for r in first + second if r["key"] == f"k{k}"]
        assert last[f"k{k}"]["n"] == len(vs)
        assert last[f"k{k}"]["sum"] == sum(v * 7 + (-v - 1) * 7 for v in vs)


def test_an_unusable_call_journal_is_exit_2_before_anything_runs(tmp_path: Path) -> None:
    from .cluster import free_port

    inputs = tmp_path / "in.jsonl"
    write_inputs(inputs, _rows(0, 3))
    base = [*CLI, f"{AGENTS}:Journaled", "--input", str(inputs), "--output", str(tmp_path / "o")]
    for uri, said in [
        ("postgresql://u:hunter2@127.0.0.1/db?nonsense=1", "invalid"),
        (f"postgresql://u:hunter2@127.0.0.1:{free_port()}/db", "cannot use PostgreSQL"),
    ]:
        proc = subprocess.run(
            [*base, "--call-journal", uri],
            env=flink_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert said in proc.stderr and "u:***@127.0.0.1" in proc.stderr, proc.stderr
        assert "hunter2" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr
        assert proc.stdout == ""  # nothing was submitted
