"""The Flink operations commands without PyFlink or a cluster: what a user sees when the
JobManager is not there or a job id is wrong, and `ratchet inspect --flink-memory` on a memory
output folder (the real-cluster side is tests/flink/test_ops.py)."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
from pathlib import Path

from ratchet.runtime._journal import encode_memory

RATCHET = [sys.executable, "-m", "ratchet.cli"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RATCHET, *args], capture_output=True, text=True, timeout=60)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: nothing listens


def test_an_unreachable_jobmanager_is_exit_2_naming_it_and_the_fix() -> None:
    port = _closed_port()
    for args in (
        ["flink", "status", "--jobmanager", f"127.0.0.1:{port}"],
        ["status", "--jobmanager", f"127.0.0.1:{port}", "--job", "a" * 32],
        ["flink", "stop", "a" * 32, "--jobmanager", f"127.0.0.1:{port}"],
    ):
        proc = _run(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert f"cannot reach the JobManager at http://127.0.0.1:{port}" in proc.stderr
        assert "--jobmanager HOST:PORT" in proc.stderr and "Traceback" not in proc.stderr


def test_a_malformed_job_id_is_exit_2_before_any_request() -> None:
    proc = _run("flink", "savepoint", "1234", "--jobmanager", "127.0.0.1:9")
    assert proc.returncode == 2
    assert "'1234' is not a Flink job id (32 hex digits)" in proc.stderr
    proc = _run("status", "--state", "x", "--job", "a" * 32)
    assert proc.returncode == 2 and "--job goes with --jobmanager" in proc.stderr


def _memory_line(key: object, memory: dict[str, object], inputs: int | None) -> str:
    rec: dict[str, object] = {
        "key": key,
        "memory": base64.b64encode(encode_memory(memory)).decode(),
    }
    if inputs is not None:
        rec["inputs"] = inputs
    return json.dumps(rec) + "\n"


def test_inspect_reads_the_latest_memory_of_each_key_from_a_flink_memory_folder(
    tmp_path: Path,
) -> None:
    mem = tmp_path / "mem"
    (mem / "2026-12-02--01").mkdir(parents=True)
    # Two runs of one job wrote key "a" twice (the resumed one, read first here, had admitted more inputs); the
    # integer key 7 keeps its type; in-progress files and `_` folders are not read.
    (mem / "2026-12-02--01" / "part-x-0-0").write_text(
        _memory_line("a", {"n": 9, "blob": b"\x01"}, 9) + _memory_line(7, {"n": 1}, 1)
    )
    (mem / "2026-12-02--01" / "part-y-0-0").write_text(
        _memory_line("a", {"n": 5, "blob": b"\x00\xff"}, 5) + _memory_line("b", {"n": 2}, None)
    )
    (mem / "2026-12-02--01" / ".part-z-0-0.inprogress").write_text(_memory_line("a", {"n": 99}, 99))
    (mem / "_bad").mkdir()
    (mem / "_bad" / "part").write_text(_memory_line("q", {"n": 1}, 1))

    proc = _run("inspect", "--flink-memory", str(mem), "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got == {"a": {"n": 9, "blob": got["a"]["blob"]}, "7": {"n": 1}, "b": {"n": 2}}, got
    proc = _run("inspect", "--flink-memory", str(mem), "--key", "a")
    assert proc.returncode == 0 and "9" in proc.stdout and "b'\\x01'" in proc.stdout, proc.stdout

    from ratchet.runtime._flink_files import latest_memories

    assert latest_memories(mem) == {"a": {"n": 9, "blob": b"\x01"}, 7: {"n": 1}, "b": {"n": 2}}

    proc = _run("inspect", "--flink-memory", str(tmp_path / "nowhere"))
    assert (
        proc.returncode == 2 and "--flink-memory" in proc.stderr and "no such folder" in proc.stderr
    )
    assert "Traceback" not in proc.stderr
