"""A signal's value of NaN, Infinity or -Infinity (Python's JSON extensions, not JSON) is
refused by every sender, and nothing is stored: `ratchet signal --value NaN` exited 0, the
REST API answered 202, and the waiting run later put the value in outputs no JSON sink takes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_rest_metrics import free_port, get_json, poll, request, stop

import ratchet
from ratchet._errors import EXIT_BAD_INPUT, BadInputError

AGENT_SRC = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Waiter(Agent):
    @action(InputEvent)
    async def go(self, event, ctx):
        got = await ctx.wait_for_signal("go")
        ctx.send_event(OutputEvent(output={"got": got}))
"""


def test_nan_and_infinity_are_refused_by_the_cli_rest_and_python(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text(AGENT_SRC)
    (tmp_path / "in.jsonl").write_text(json.dumps({"key": "a"}) + "\n")
    state = tmp_path / "state"
    port = free_port()
    cmd = [sys.executable, "-m", "ratchet.cli", "run", f"{tmp_path / 'agent.py'}:Waiter",
           "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
           "--state", str(state), "--supervise", "--follow", "--rest-port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        poll("the wait", lambda: get_json(port, "/v1/job")["waiting"])
        # The CLI: exit 3, one line naming --value.
        for arg in ("NaN", "Infinity", "--value=-Infinity", '{"x": [1, NaN]}', "1e999"):
            argv = [arg] if arg.startswith("--") else ["--value", arg]
            sent = subprocess.run(
                [sys.executable, "-m", "ratchet.cli", "signal", "--state", str(state),
                 "--key", "a", "go", *argv],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert sent.returncode == EXIT_BAD_INPUT, (arg, sent.stdout, sent.stderr)
            lines = sent.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("ratchet: error: --value "), lines
            assert "not JSON" in lines[0], lines
        # REST: json.dumps writes NaN and Infinity, as a careless client would send them.
        for value in (float("nan"), float("inf"), {"x": [float("-inf")]}):
            status, body, _ = request(port, "POST", "/v1/keys/a/signals/go", body={"value": value})
            assert status == 400, (value, status, body)
            assert "which is not JSON" in json.loads(body)["detail"], body
        # Python.
        with pytest.raises(BadInputError, match="holds NaN, which is not JSON"):
            ratchet.send_signal(state, "a", "go", {"score": float("nan")})
        assert get_json(port, "/v1/job")["waiting"], "a refused signal woke the run"
        with ratchet.open_state(state) as st:
            assert st.pending_signals() == []
        status, body, _ = request(port, "POST", "/v1/keys/a/signals/go", body={"value": 7})
        assert status == 202, body
        out = tmp_path / "out.jsonl"
        poll("the output", lambda: out.exists() and out.read_text())
        assert json.loads(out.read_text())["output"] == {"got": 7}
    finally:
        err = stop(proc)
    assert "Traceback" not in err, err
