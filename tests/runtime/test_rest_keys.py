"""The REST API on keys a URL path cannot hold as they are: a key holding `/` (the dashboard
sends it encoded as %2F, which the server decodes before routing) reached no route (404),
and a signal body without `value` was taken as a signal of null (an approval's rejection);
and a run parked in a wait counts as in flight in /v1/job (it said 0)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from test_rest_metrics import free_port, get_json, poll, request, stop

AGENT_SRC = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Waiter(Agent):
    @action(InputEvent)
    async def go(self, event, ctx):
        ctx.short_term_memory.set("asked", True)
        got = await ctx.wait_for_signal("go")
        ctx.send_event(OutputEvent(output={"got": got}))
"""


def oversized_post(port: int, path: str, size: int, chunked: bool) -> bytes:
    """Send a POST announcing (or, chunked, sending) `size` bytes and return the answer. The
    body is never sent past what the server reads, so its early answer is not lost to a reset
    of unread data (http.client sending the whole body met a broken pipe now and then)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        if not chunked:
            sock.sendall(f"{head}Content-Length: {size}\r\n\r\n".encode())
        else:
            sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            piece = b"x" * 65536
            for _ in range(size // len(piece) + 1):  # past the limit; no final chunk
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            got = sock.recv(65536)
            if not got:
                break
            answer += got
        return answer


def test_a_key_holding_a_slash_is_reached_and_a_signal_body_needs_its_value(
    tmp_path: Path,
) -> None:
    (tmp_path / "agent.py").write_text(AGENT_SRC)
    (tmp_path / "in.jsonl").write_text(json.dumps({"key": "team/a[1]"}) + "\n")
    port = free_port()
    cmd = [sys.executable, "-m", "ratchet.cli", "run", f"{tmp_path / 'agent.py'}:Waiter",
           "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
           "--state", str(tmp_path / "state"), "--supervise", "--follow",
           "--rest-port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        key = urllib.parse.quote("team/a[1]", safe="")
        job = poll("the wait", lambda: (j := get_json(port, "/v1/job"))["waiting"] and j)
        assert job["in_flight_runs"] == 1, job  # a parked run is in flight (it said 0)
        # `status --url` shows the waiting run and the counts /v1/job has (it left them out).
        shown = subprocess.run(
            [sys.executable, "-m", "ratchet.cli", "status", "--url", f"http://127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        rows = _rows(shown.stdout)
        assert rows["in-flight runs"] == "1" and rows["queued inputs"] == "1", shown.stdout
        assert rows["waiting"].startswith("key team/a[1] input 0: signal go since "), rows
        assert rows["last exit"] == "-", rows
        status, body, _ = request(port, "POST", f"/v1/keys/{key}/signals/go", body={"ok": 1})
        assert status == 422, body
        # A body over 1 MiB is refused before it is read or stored, by its Content-Length and
        # sent in chunks (it was accepted, 20 MB stored in the state as the signal's value).
        for chunked in (False, True):
            answer = oversized_post(port, f"/v1/keys/{key}/signals/go", (1 << 20) + 1, chunked)
            assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
            assert b"the limit is 1048576 bytes" in answer, answer[:300]
        assert get_json(port, "/v1/job")["waiting"], "a refused signal woke the run"
        status, body, _ = request(port, "POST", f"/v1/keys/{key}/signals/go", body={"value": 7})
        assert status == 202, body
        out = tmp_path / "out.jsonl"
        poll("the output", lambda: out.exists() and out.read_text())
        assert json.loads(out.read_text())["output"] == {"got": 7}
        memory = poll("the key's memory", lambda: get_json(port, f"/v1/keys/{key}/memory"))
        assert memory["key"] == "team/a[1]", memory
        assert get_json(port, f"/v1/keys/{key}/runs"), "no run of the key"
    finally:
        err = stop(proc)
    assert "Traceback" not in err, err


def _rows(table: str) -> dict[str, str]:
    """The rows of a `status` table: label -> value (a continued value joined by newlines)."""
    rows: dict[str, str] = {}
    label = ""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) != 2:
            continue
        if cells[0]:
            label = cells[0]
            rows[label] = cells[1]
        elif label:
            rows[label] += "\n" + cells[1]
    return rows


def test_status_url_shows_the_rows_status_state_shows(tmp_path: Path) -> None:
    """Against an API answering what a sharded job whose worker died and whose resource is
    down reports: every row of /v1/job is shown (in flight, queued, waiting, paused, last
    exit, shards), not only the supervisor's own."""
    job = {
        "state": "running", "worker_pid": 41, "resource_id": "r", "restarts": 3,
        "restarts_counted": 1,
        "uptime_seconds": 9.5, "worker_uptime_seconds": 2.0,
        "last_exit": "killed by SIGKILL", "in_flight_runs": 3, "queued_inputs": 5,
        "waiting": [{"key": "bob", "seq": 2, "task": "t", "on": "signal approve",
                     "since": 1.7e9, "until": None}],
        "paused": [{"resource": "scoring", "since": 1.7e9, "next_probe": 1.7e9 + 5,
                    "error": "HTTP 503"}],
        "shards": [{"shard": 0, "pid": 42, "restarts": 2, "reported": True,
                    "in_flight_runs": 1, "queued_inputs": 2},
                   {"shard": 1, "pid": 43, "restarts": 0, "reported": False}],
    }  # fmt: skip
    ref = {"id": 4, "trigger_timestamp": 1.7e9, "duration_ms": 1.0, "size_bytes": 10}
    answers = {
        "/v1/job": job,
        "/v1/job/checkpoints": {
            "counts": {"completed": 4, "failed": 0, "in_progress": 0, "restored": 1, "total": 4},
            "latest": {"completed": ref, "failed": None, "restored": ref},
        },
        "/v1/job/config": {
            "checkpoint_interval_ms": 100, "tolerable_checkpoint_failures": 0,
            "max_concurrent_runs": 64, "max_buffered_inputs": 64, "state_dir": "s", "engine": {},
            "restart_strategy": {"type": "fixed-delay-with-reset", "attempts": 10,
                                 "delay_seconds": 0.3, "reset_after_seconds": 600,
                                 "unreachable_delay_factor": 2.0,
                                 "unreachable_max_delay_seconds": 30},
        },
    }  # fmt: skip

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = json.dumps(answers[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        shown = subprocess.run(
            [sys.executable, "-m", "ratchet.cli", "status", "--url", url],
            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "250"},
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert shown.returncode == 0, shown.stderr
    rows = _rows(shown.stdout)
    assert rows["last exit"] == "killed by SIGKILL", shown.stdout
    assert rows["restarts"] == "3 in all, 1 of 10 counted now", rows
    assert rows["restart strategy"] == (
        "fixed-delay-with-reset, 10 attempts, 0.3 s delay (doubling up to 30 s while a server "
        "cannot be reached), the count starts again after 600 s of running"
    ), rows
    assert rows["in-flight runs"] == "3" and rows["queued inputs"] == "5", shown.stdout
    assert rows["waiting"].startswith("key bob input 2: signal approve since "), rows
    assert rows["paused"].startswith("scoring unavailable since "), rows
    assert "(HTTP 503); no new input is admitted meanwhile" in rows["paused"], rows
    assert rows["shard 0"] == "pid 42, restarts 2, in flight 1, queued 2", rows
    assert rows["shard 1"] == "pid 43, restarts 0, in flight -, queued -", rows
