"""SIGKILL a real `ratchet run` at each crash point of the tool loop; restart; check.

The model is a ScriptedChatModel served over HTTP in this process and reached through the
real `openai` SDK, so the requests that reach the "provider" are counted at the server.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _chat_wire import OpenAIServer

from ratchet.agents.chat import ScriptedChatModel
from support.procs import kill as _kill
from support.procs import wait_for as _wait

HERE = Path(__file__).parent
AGENT = f"{HERE / 'kill_agent.py'}:KillAgent"
SCRIPT = [
    ScriptedChatModel.tool_call("lookup_order", "call_1", order_id="A-1"),
    "Order A-1 has shipped with DHL.",
]

pytestmark = pytest.mark.kill


def _start(
    tmp: Path, server: OpenAIServer, interval_ms: int, hold_tool: bool
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "CHAT_SERVER": server.url,
        "CHAT_MARKS": str(tmp / "marks"),
        "CHAT_HOLD_TOOL": "1" if hold_tool else "0",
    }
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", AGENT,
        "--input", str(tmp / "in.jsonl"),
        "--output", str(tmp / "out.jsonl"),
        "--state", str(tmp / "state"),
        "--checkpoint-interval", str(interval_ms),
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _db(tmp: Path, sql: str) -> list[tuple[Any, ...]]:
    path = tmp / "state" / "ratchet.db"
    if not path.exists():
        return []
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
        try:
            return con.execute(sql).fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return []


def _recorded(tmp: Path, fn_suffix: str) -> bool:
    rows = _db(tmp, "SELECT fn, status FROM calls")
    return any(fn.endswith(fn_suffix) and status == "ok" for fn, status in rows)


def _checkpoints(tmp: Path) -> int:
    rows = _db(tmp, "SELECT count(*) FROM checkpoints")
    return rows[0][0] if rows else 0


def _finish(tmp: Path, server: OpenAIServer, interval_ms: int, hold_tool: bool) -> None:
    for _ in range(5):
        proc = _start(tmp, server, interval_ms, hold_tool)
        _, err = proc.communicate(timeout=60)
        if proc.returncode == 0:
            return
    raise AssertionError(f"agent did not finish after restarts: {err.decode()[-2000:]}")


def _setup(tmp: Path) -> None:
    (tmp / "marks").mkdir()
    (tmp / "in.jsonl").write_text(
        json.dumps({"key": "cust-1", "text": "Where is my order A-1?"}) + "\n"
    )


def _outputs(tmp: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp / "out.jsonl").read_text().splitlines()]


def _marks(tmp: Path, prefix: str) -> list[str]:
    return sorted(p.read_text() for p in (tmp / "marks").glob(f"{prefix}_*"))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The crash-free run: its single output is what every recovered run must reproduce."""
    tmp = tmp_path_factory.mktemp("baseline")
    _setup(tmp)
    with OpenAIServer(ScriptedChatModel(SCRIPT)) as server:
        _finish(tmp, server, 50, hold_tool=False)
        assert server.count(1) == 1
        assert server.count(2) == 1
    [out] = _outputs(tmp)
    assert out["output"]["reply"] == "Order A-1 has shipped with DHL."
    roles = [m["role"] for m in out["output"]["transcript"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    tool_msg = out["output"]["transcript"][3]
    assert tool_msg["content"] == '{"carrier": "DHL", "order_id": "A-1", "status": "shipped"}'
    assert tool_msg["extras"] == {}
    return out


def _check_recovered(tmp: Path, baseline: dict[str, Any]) -> dict[str, Any]:
    outs = _outputs(tmp)
    assert len(outs) == 1, outs  # exactly once
    [out] = outs
    assert out["id"] == baseline["id"]
    assert (
        out["output"] == baseline["output"]
    )  # the transcript after recovery equals the crash-free one
    keys = set(_marks(tmp, "tool_start"))
    assert len(keys) == 1  # a re-run tool got the same idempotency key
    return out


def test_kill_while_model_call_in_flight(tmp_path: Path, baseline: dict[str, Any]) -> None:
    _setup(tmp_path)
    with OpenAIServer(ScriptedChatModel(SCRIPT), marker_dir=tmp_path / "marks") as server:
        server.hang_on = {2: 20}  # the second model call stalls the first time
        proc = _start(tmp_path, server, 50, hold_tool=False)
        _wait(lambda: (tmp_path / "marks" / "request_2_1").exists(), proc, "model call 2 in flight")
        _kill(proc)
        _finish(tmp_path, server, 50, hold_tool=False)
        assert server.count(1) == 1  # returned before the kill: not sent again
        assert server.count(2) == 2  # was in flight: sent again
    _check_recovered(tmp_path, baseline)
    assert len(_marks(tmp_path, "tool_start")) == 1  # the tool had returned: not run again


def test_kill_after_model_returned_before_checkpoint(
    tmp_path: Path, baseline: dict[str, Any]
) -> None:
    _setup(tmp_path)
    with OpenAIServer(ScriptedChatModel(SCRIPT), marker_dir=tmp_path / "marks") as server:
        # no periodic checkpoint: only the durable-call record holds the model's reply
        proc = _start(tmp_path, server, 600_000, hold_tool=True)
        _wait(lambda: _recorded(tmp_path, "_call_model"), proc, "model reply recorded")
        # the process holds in the tool (which only runs after the reply was recorded)
        _wait(lambda: (tmp_path / "marks" / "tool_start_1").exists(), proc, "tool started")
        assert _checkpoints(tmp_path) == 0
        _kill(proc)
        _finish(tmp_path, server, 50, hold_tool=True)
        assert server.count(1) == 1  # the recorded reply came back from the journal
        assert server.count(2) == 1
    _check_recovered(tmp_path, baseline)


def test_kill_while_tool_running(tmp_path: Path, baseline: dict[str, Any]) -> None:
    _setup(tmp_path)
    with OpenAIServer(ScriptedChatModel(SCRIPT), marker_dir=tmp_path / "marks") as server:
        proc = _start(tmp_path, server, 20, hold_tool=True)
        _wait(lambda: (tmp_path / "marks" / "tool_start_1").exists(), proc, "tool started")
        seen = _checkpoints(tmp_path)
        _wait(lambda: _checkpoints(tmp_path) > seen, proc, "a checkpoint while the tool runs")
        _kill(proc)
        _finish(tmp_path, server, 50, hold_tool=True)
        assert server.count(1) == 1
        assert server.count(2) == 1
    _check_recovered(tmp_path, baseline)
    assert len(_marks(tmp_path, "tool_start")) == 2  # had not returned: run again (same key)
    assert len(_marks(tmp_path, "tool_done")) == 1


def test_kill_after_tool_returned(tmp_path: Path, baseline: dict[str, Any]) -> None:
    _setup(tmp_path)
    with OpenAIServer(ScriptedChatModel(SCRIPT), marker_dir=tmp_path / "marks") as server:
        server.hang_on = {2: 20}  # hold the process after the tool, before the final reply
        proc = _start(tmp_path, server, 600_000, hold_tool=False)
        _wait(lambda: _recorded(tmp_path, "_call_tool"), proc, "tool result recorded")
        assert _checkpoints(tmp_path) == 0
        _kill(proc)
        server.hang_on = {}
        _finish(tmp_path, server, 50, hold_tool=False)
        assert server.count(1) == 1
    _check_recovered(tmp_path, baseline)
    assert len(_marks(tmp_path, "tool_start")) == 1  # returned before the kill: not run again
    assert len(_marks(tmp_path, "tool_done")) == 1
