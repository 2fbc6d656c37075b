"""The REST API's refusals of what a user can send it: a body holding a number JSON cannot
answer with (1e400, NaN) is a 422 in JSON like any invalid body (it was a 500 in plain text
and a traceback in the supervisor's log); a signal whose name holds "/" is sent with the name
percent-encoded (it reached no route: 404); a key whose type must be said is refused naming
REST's ?key_type= (it named only the CLI's --key-type and Python's way)."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_rest_metrics import free_port, get_json, poll, request, stop

import ratchet
from ratchet._errors import ConfigError
from ratchet.runtime._shards import shard_of

AGENT_SRC = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Waiter(Agent):
    @action(InputEvent)
    async def go(self, event, ctx):
        got = await ctx.wait_for_signal(event.input["signal"])
        ctx.send_event(OutputEvent(output={"got": got}))
"""


def supervised(tmp: Path, lines: list[dict[str, Any]], port: int) -> subprocess.Popen[bytes]:
    (tmp / "agent.py").write_text(AGENT_SRC)
    (tmp / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = [sys.executable, "-m", "ratchet.cli", "run", f"{tmp / 'agent.py'}:Waiter",
           "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl"),
           "--state", str(tmp / "state"), "--supervise", "--follow",
           "--rest-port", str(port)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def post_raw(port: int, path: str, body: str) -> tuple[int, str, bytes]:
    """POST `body` as it is (json.dumps cannot write 1e400): status, content type, body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type") or "", resp.read()
    finally:
        conn.close()


def test_a_body_with_a_number_json_has_not_is_a_422_in_json(tmp_path: Path) -> None:
    port = free_port()
    proc = supervised(tmp_path, [{"key": "a", "signal": "go"}], port)
    try:
        poll("the wait", lambda: get_json(port, "/v1/job")["waiting"])
        redrive = "/v1/dead-letters/redrive"
        for path, body in [
            (redrive, '{"id":1e400}'),
            (redrive, '{"key":1e400}'),
            (redrive, '{"id":NaN}'),
            (redrive, '{"all":NaN}'),
            (redrive, '{"key":"k5","key_type":-1e400}'),
            ("/v1/keys/a/signals/go", '{"valu":NaN}'),
            ("/v1/keys/a/signals/go", '{"value":1,"extra":1e400}'),
        ]:
            status, content_type, answer = post_raw(port, path, body)
            assert status == 422, (body, status, answer)
            assert content_type == "application/json", (body, content_type)
            detail = json.loads(answer)["detail"]  # strict JSON: no NaN, no Infinity
            assert detail and all({"loc", "msg", "type"} <= set(d) for d in detail), detail
            echoed = json.dumps([d.get("input") for d in detail])
            assert '"NaN"' in echoed or 'Infinity"' in echoed, (body, echoed)
        status, _, answer = post_raw(port, "/v1/keys/a/signals/go", '{"value":1e400}')
        assert status == 400, answer  # a value that is no JSON: refused by the sender as before
        assert get_json(port, "/v1/job")["waiting"], "a refused body woke the run"
    finally:
        err = stop(proc)
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err


def test_a_signal_name_holding_a_slash_is_sent_percent_encoded(tmp_path: Path) -> None:
    port = free_port()
    lines = [{"key": "team/a", "signal": "a/b"}, {"key": "k", "signal": "s/signals/t"}]
    proc = supervised(tmp_path, lines, port)
    try:
        poll("both waits", lambda: len(get_json(port, "/v1/job")["waiting"] or []) == 2)
        for path, key, name in [
            ("/v1/keys/team%2Fa/signals/a%2Fb", "team/a", "a/b"),
            ("/v1/keys/k/signals/s%2Fsignals%2Ft", "k", "s/signals/t"),
            ("/v1/keys/team/z/signals/c/d", "team/z", "c/d"),  # not encoded: kept for team/z
        ]:
            status, body, _ = request(port, "POST", path, body={"value": name})
            assert status == 202, (path, status, body)
            sent = json.loads(body)
            assert (sent["key"], sent["name"]) == (key, name), sent
        out = tmp_path / "out.jsonl"
        poll("both outputs", lambda: out.exists() and len(out.read_text().splitlines()) == 2)
        got = sorted(json.loads(line)["output"]["got"] for line in out.read_text().splitlines())
        assert got == ["a/b", "s/signals/t"], got
    finally:
        err = stop(proc)
    assert "Traceback" not in err, err


def test_a_key_of_either_type_is_refused_naming_the_query_parameter(tmp_path: Path) -> None:
    port = free_port()
    proc = supervised(tmp_path, [{"key": "7", "signal": "go"}, {"key": 7, "signal": "go"}], port)
    try:
        poll("both waits", lambda: len(get_json(port, "/v1/job")["waiting"] or []) == 2)
        status, body, _ = request(port, "POST", "/v1/keys/7/signals/go", body={"value": 1})
        assert status == 400, body
        detail = json.loads(body)["detail"]
        assert "holds both the string key '7' and the integer key 7" in detail, detail
        assert "REST: ?key_type=str or ?key_type=int" in detail, detail
        status, body, _ = request(port, "POST", "/v1/keys/7/signals/go?key_type=int", body={})
        assert status == 202 and json.loads(body)["key_type"] == "int", body
    finally:
        err = stop(proc)
    assert "Traceback" not in err, err


def test_a_sharded_key_of_either_type_is_refused_naming_the_query_parameter(
    tmp_path: Path,
) -> None:
    """The other refusal of a text key: the job is sharded, its two keys live in two shards,
    and neither is held."""
    text = next(str(i) for i in range(1000) if shard_of(str(i), 2) != shard_of(i, 2))
    (tmp_path / "agent.py").write_text(AGENT_SRC)
    (tmp_path / "in.jsonl").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "run", f"{tmp_path / 'agent.py'}:Waiter",
         "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
         "--state", str(tmp_path / "state"), "--workers", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with pytest.raises(ConfigError, match=r"could be the text .*; REST: \?key_type=str or"):
        ratchet.send_signal(tmp_path / "state", text, "go", key_type="auto")
