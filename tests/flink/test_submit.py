"""`ratchet flink run` (and the savepoint commands) on a cluster: what is wrong with the
address, the agent, a line or a savepoint target is one line naming it and the fix, with the
documented exit code, before or instead of a Java stack trace (the cluster side uses the
suite's standalone cluster)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet._errors import EXIT_BAD_INPUT, EXIT_USAGE  # noqa: E402
from ratchet.flink import read_output_dir  # noqa: E402

from .cluster import wait_for  # noqa: E402
from .support import AGENTS, CLI, flink_env, submit_detached, write_inputs  # noqa: E402

pytestmark = pytest.mark.flink


def _serve(reply: bytes) -> socket.socket:
    """A TCP server on 127.0.0.1 that answers each connection with `reply` (not Flink)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return sock


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env=flink_env(tmp), capture_output=True, text=True, timeout=timeout
    )


def test_run_on_an_address_with_no_flink_rest_api_is_exit_2_at_once(tmp_path: Path) -> None:
    """Nothing listening took 64 s and ended in a Java stack trace, exit 31."""
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"key": "a", "v": 1}\n')
    web = _serve(b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\n\r\n<html>hi</html>")
    closed = _closed_port()
    try:
        for address, said in (
            (f"127.0.0.1:{closed}", f"cannot reach the JobManager at http://127.0.0.1:{closed}"),
            (f"127.0.0.1:{web.getsockname()[1]}", "is not a Flink REST address"),
            ("localhost:abc", "must look like host:port"),
        ):
            started = time.monotonic()
            proc = _run(
                tmp_path, f"{AGENTS}:Counter", "--input", str(inputs),
                "--output", str(tmp_path / "out"), "--jobmanager", address,
            )  # fmt: skip
            assert time.monotonic() - started < 30
            assert proc.returncode == EXIT_USAGE, (address, proc.stderr[-2000:])
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("ratchet flink: "), proc.stderr
            assert said in lines[0] and "--jobmanager" in lines[0], lines[0]
            assert "RATCHET_FLINK_JOBMANAGER" not in lines[0]  # `flink run` does not read it
            assert proc.stdout == ""
    finally:
        web.close()


REFUSED = """
from ratchet import Agent, InputEvent, OutputEvent, action


class NoActions(Agent):
    pass


class Versioned(Agent):
    memory_version = 2

    @action(InputEvent, inline=True)
    def handle(self, event, ctx):
        ctx.send_event(OutputEvent(output=1))
"""


def test_an_agent_a_worker_would_refuse_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """It was refused in every restart of the job's worker (~18 s), and the command said
    "MiniCluster is not yet running ...", exit 1; the embedded engine says why, exit 2."""
    (tmp_path / "refused.py").write_text(REFUSED)
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"key": "a", "v": 1}\n')
    for name, said in (
        ("NoActions", "NoActions has no actions; decorate a method with @action(...)"),
        ("Versioned", "Versioned declares memory_version 2; the Flink engine does not version"),
    ):
        started = time.monotonic()
        proc = _run(
            tmp_path, f"{tmp_path / 'refused.py'}:{name}", "--input", str(inputs),
            "--output", str(tmp_path / f"out-{name}"),
        )  # fmt: skip
        assert proc.returncode == EXIT_USAGE, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ratchet flink: "), proc.stderr[-3000:]
        assert said in lines[0], lines[0]
        assert proc.stdout == ""  # no job was submitted
        assert time.monotonic() - started < 15


# The worker's own check, as a job that reaches it meets it: `ratchet flink run` with its
# client-side check of the agent turned off (nothing else changed).
WORKER_CHECKS = """
import argparse, sys
import ratchet.flink._function as function
from ratchet.cli import _flink
function.agent_core = lambda *a, **k: None
parser = argparse.ArgumentParser(prog="ratchet")
_flink.register(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def test_a_job_its_worker_refuses_says_the_workers_reason(tmp_path: Path) -> None:
    """A local job that failed took its mini-cluster down: the status poll's "MiniCluster is
    not yet running" was reported, not the job's failure; and of that failure, ratchet's
    error line is the one to show, with its exit code (a ConfigError: 2)."""
    (tmp_path / "refused.py").write_text(REFUSED)
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"key": "a", "v": 1}\n')
    proc = subprocess.run(
        [
            sys.executable, "-c", WORKER_CHECKS, "flink", "run",
            f"{tmp_path / 'refused.py'}:NoActions", "--input", str(inputs),
            "--output", str(tmp_path / "out"), "--restart-strategy", "none",
            "--tmp-dir", str(tmp_path / "flink-tmp"),
        ],
        env=flink_env(tmp_path), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stderr[-3000:]
    assert "MiniCluster is not yet running" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ratchet flink: job ") and last.endswith(
        "failed: ratchet_user_refused.NoActions has no actions; decorate a method with @action(...)"
    ), last


def _ops(tmp: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "flink", *args],
        env=flink_env(tmp), capture_output=True, text=True, timeout=120, cwd=cwd,
    )  # fmt: skip


def test_savepoint_targets_are_folders_where_the_command_runs(cluster: Any, tmp_path: Path) -> None:
    """A relative --target was resolved in the JobManager's working folder; no --target on
    a cluster without a default savepoint folder was Flink's RestHandlerException text."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_inputs(inputs / "a.jsonl", [{"key": "a", "v": 1}])
    job = submit_detached(cluster, tmp_path, inputs, tmp_path / "out")
    # Every task running (an output is committed): Flink takes no savepoint before.
    wait_for("an output", lambda: read_output_dir(tmp_path / "out"), 180)
    here = tmp_path / "here"
    here.mkdir()
    jm = ["--jobmanager", cluster.jobmanager]
    try:
        proc = _ops(tmp_path, "savepoint", job, *jm, cwd=here)
        assert proc.returncode == EXIT_USAGE, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "RestHandlerException" not in proc.stderr, proc.stderr
        assert "has no default savepoint folder" in lines[0] and "pass --target" in lines[0]
        proc = _ops(tmp_path, "stop", job, *jm, cwd=here)
        assert proc.returncode == EXIT_USAGE and "pass --target" in proc.stderr, proc.stderr
        assert cluster.job_status(job) == "RUNNING"

        proc = _ops(tmp_path, "savepoint", job, "--target", "sp/one", *jm, cwd=here)
        assert proc.returncode == 0, proc.stderr[-3000:]
        taken = json.loads(proc.stdout)["savepoint"]
        assert taken.removeprefix("file:").startswith(str(here / "sp" / "one")), taken
        assert list((here / "sp" / "one").glob("savepoint-*/_metadata")), taken

        proc = _ops(tmp_path, "stop", job, "--target", "sp/two", *jm, cwd=here)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert list((here / "sp" / "two").glob("savepoint-*/_metadata")), proc.stdout
        wait_for("the job to finish", lambda: cluster.job_status(job) == "FINISHED", 60)
    finally:
        if cluster.job_status(job) == "RUNNING":
            cluster.cancel(job)


def test_a_bad_line_in_a_followed_input_on_a_cluster_is_exit_3_naming_it(
    cluster: Any, tmp_path: Path
) -> None:
    """An attached `--follow` job on a cluster printed ~40 lines of the flink client's stack
    trace and exited with its code (31); a local one says the line's error, exit 3. Neither
    named the input ("input line: ...")."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.jsonl").write_text('{"key": "k", "v": 1}\n{"key": [1], "v": 2}\n')
    proc = subprocess.run(
        [
            *CLI, f"{AGENTS}:Counter", "--input", str(inputs), "--output", str(tmp_path / "out"),
            "--follow", "200", "--restart-strategy", "none", "--jobmanager", cluster.jobmanager,
            "--checkpoint-dir", str(tmp_path / "checkpoints"),
            "--tmp-dir", str(tmp_path / "flink-tmp"),
        ],
        env=flink_env(tmp_path), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(
        f'ratchet flink: bad input: a line of {inputs} (\'{{"key": [1], "v": 2}}\'): '
        "key field 'key' is list"
    ), lines[0]
    assert "--on-bad-input skip or dead-letter" in lines[0]
