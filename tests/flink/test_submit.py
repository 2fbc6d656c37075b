"""`ratchet flink run --jobmanager`: what is wrong with the address, the agent or a line is one
line naming it and the fix, with the documented exit code, before or instead of a Java stack
trace (the cluster side uses the suite's standalone cluster)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet._errors import EXIT_USAGE  # noqa: E402

from .support import AGENTS, CLI, flink_env  # noqa: E402

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
