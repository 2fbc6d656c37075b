"""The Flink operations commands without PyFlink or a cluster: what a user sees when the
JobManager is not there or a job id is wrong, and `ratchet inspect --flink-memory` on a memory
output folder (the real-cluster side is tests/flink/test_ops.py)."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

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


def test_inspect_of_a_flink_memory_folder_shows_one_key_of_a_text_held_twice(
    tmp_path: Path,
) -> None:
    """The string key "7" and the integer key 7, as `inspect --state` takes them: `--key 7`
    showed both memories as the one key asked for."""
    mem = tmp_path / "mem" / "2026-12-02--01"
    mem.mkdir(parents=True)
    (mem / "part-x-0-0").write_text(
        _memory_line("7", {"n": "text"}, 1) + _memory_line(7, {"n": "int"}, 1)
    )
    both = _run("inspect", "--flink-memory", str(tmp_path / "mem"), "--key", "7", "--json")
    assert both.returncode == 2 and not both.stdout, both.stdout
    assert "holds both the string key '7' and the integer key 7" in both.stderr
    assert "--key-type str or --key-type int" in both.stderr and "Traceback" not in both.stderr
    for kind, shown in (("int", {"7 (int)": {"n": "int"}}), ("str", {"7": {"n": "text"}})):
        one = _run("inspect", "--flink-memory", str(tmp_path / "mem"), "--key", "7",
                   "--key-type", kind, "--json")  # fmt: skip
        assert one.returncode == 0 and json.loads(one.stdout) == shown, one.stderr


def test_inspect_of_a_folder_that_is_not_a_memory_output_is_one_line_exit_2(
    tmp_path: Path,
) -> None:
    """The job's --output folder was a `KeyError: 'memory'` traceback; a savepoint's folder
    (its files are hidden) printed nothing, exit 0."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-a-0.jsonl").write_text(json.dumps({"key": "k", "output": {"n": 1}}) + "\n")
    savepoint = tmp_path / "savepoint-1a2b3c-0123456789ab"
    savepoint.mkdir()
    (savepoint / "_metadata").write_bytes(b"\x00\x01binary")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_bytes(b"not json \xff\n")
    for folder, named in (
        (out, out / "part-a-0.jsonl"),
        (savepoint, None),
        (junk, junk / "notes.txt"),
    ):
        proc = _run("inspect", "--flink-memory", str(folder))
        assert proc.returncode == 2, (folder, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"--flink-memory {folder} holds no memory records" in lines[0], lines[0]
        assert "--memory-output" in lines[0]
        if named is not None:
            assert f"({named} is not one)" in lines[0], lines[0]


class _FakeJobManager(ThreadingHTTPServer):
    """The two REST calls `ratchet status --jobmanager` makes for an agent operator's
    metrics, answered from `metrics` (id -> value), recording every query it was sent."""

    def __init__(self, metrics: dict[str, float]) -> None:
        self.metrics = metrics
        self.queries: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urlsplit(self.path)
                owner.queries.append(url.query)
                job = "a" * 32
                if url.path.endswith(f"/jobs/{job}"):
                    body: object = {"jid": job, "name": "j", "state": "RUNNING",
                                    "duration": 1000, "vertices": [{"id": "v1"}]}  # fmt: skip
                elif url.path.endswith("/checkpoints"):
                    body = {"counts": {}, "latest": {}}
                elif url.path.endswith("/subtasks/metrics") and not url.query:
                    body = [{"id": n} for n in owner.metrics]
                elif url.path.endswith("/subtasks/metrics"):
                    asked = parse_qs(url.query)["get"][0].split(",")
                    body = [{"id": n, "sum": owner.metrics[n]} for n in asked]
                else:
                    self.send_error(404)
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_status_reads_counters_whatever_their_names_and_however_many() -> None:
    """Counter names are the user's: `&`, `#`, `+` and non-ASCII letters reach the query
    escaped (they cut it short, or raised UnicodeEncodeError, before), and 45 counters are
    asked for in several requests."""
    op = "ratchet_agent_(ratchet-agent).ratchet."
    names = ["orders&refunds", "retries#model", "a+b", "commandes_remboursées"]
    names += [f"c{i}" for i in range(41)]
    metrics = {f"{op}counter.{n}.total": float(i + 1) for i, n in enumerate(names)}
    metrics[f"{op}inputs"] = 7.0
    server = _FakeJobManager(metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        proc = _run(
            "status", "--jobmanager", f"127.0.0.1:{server.server_address[1]}",
            "--job", "a" * 32, "--json",
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    got = json.loads(proc.stdout)["ratchet"]
    want = {f"ratchet.counter.{n}.total": float(i + 1) for i, n in enumerate(names)}
    assert got == {**want, "ratchet.inputs": 7.0}, got
    gets = [q for q in server.queries if q.startswith("get=")]
    assert len(gets) == 3 and all("#" not in q and "é" not in q for q in gets), gets


class _NotFlink:
    """A TCP server on 127.0.0.1 that answers every connection with the same bytes: an SSH
    banner, or a web page that is not Flink's REST API."""

    def __init__(self, reply: bytes) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = int(self.sock.getsockname()[1])
        self.reply = reply
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(self.reply)


def test_a_jobmanager_address_that_is_not_flinks_rest_api_is_exit_2() -> None:
    """A non-numeric port, an SSH port, a plain web server: one line naming the address, exit
    2 (they were tracebacks, exit 1: InvalidURL, BadStatusLine, JSONDecodeError)."""
    ssh = _NotFlink(b"SSH-2.0-OpenSSH_9.6\r\n")
    web = _NotFlink(b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\n\r\n<html>hello</html>")
    try:
        for address in ("localhost:abc", f"127.0.0.1:{ssh.port}", f"127.0.0.1:{web.port}"):
            for args in (
                ["flink", "status", "--jobmanager", address],
                ["status", "--jobmanager", address],
                ["flink", "status", "a" * 32, "--jobmanager", address],
            ):
                proc = _run(*args)
                assert proc.returncode == 2, (args, proc.stderr)
                assert "Traceback" not in proc.stderr, proc.stderr
                lines = proc.stderr.strip().splitlines()
                assert len(lines) == 1, proc.stderr
                assert lines[0].startswith("ratchet flink: ")
                assert f"http://{address} is not a Flink REST address" in lines[0], lines[0]
                assert "--jobmanager HOST:PORT" in lines[0]
    finally:
        ssh.sock.close()
        web.sock.close()
