"""The REST API on keys a URL path cannot hold as they are: a key holding `/` (the dashboard
sends it encoded as %2F, which the server decodes before routing) reached no route (404),
and a signal body without `value` was taken as a signal of null (an approval's rejection);
and a run parked in a wait counts as in flight in /v1/job (it said 0)."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import urllib.parse
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


def chunked_post(port: int, path: str, data: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        parts = (data[i : i + 65536] for i in range(0, len(data), 65536))
        headers = {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
        conn.request("POST", path, body=parts, headers=headers, encode_chunked=True)
        return conn.getresponse().status
    finally:
        conn.close()


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
        status, body, _ = request(port, "POST", f"/v1/keys/{key}/signals/go", body={"ok": 1})
        assert status == 422, body
        # A body over 1 MiB is refused before it is read or stored, by its Content-Length and
        # sent in chunks (it was accepted, 20 MB stored in the state as the signal's value).
        big = {"value": "x" * (1 << 20)}
        status, body, _ = request(port, "POST", f"/v1/keys/{key}/signals/go", body=big)
        assert status == 413 and b"the limit is 1048576 bytes" in body, (status, body)
        assert chunked_post(port, f"/v1/keys/{key}/signals/go", json.dumps(big).encode()) == 413
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
