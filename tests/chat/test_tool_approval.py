"""`@tool(requires_approval=True)`: the approval request, the durable wait, the decision.

In process: a bounded `ratchet.run` returns with the run waiting for `approval:<call id>`;
`ratchet.send_signal` decides; `ratchet.run` again on the same state and inputs finishes the
run. And with a real `ratchet run` SIGKILLed while it waits (and while the approved tool
runs), the signal sent with the `ratchet signal` CLI while it is down.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from approval_agent import ApprovalAgent

import ratchet
from ratchet import ConfigError, EngineConfig
from ratchet.agents._events import event_from_wire, event_to_wire
from ratchet.agents.chat import (
    ScriptedChatModel,
    Tool,
    ToolApprovalRequestEvent,
    ToolCall,
    tool,
)
from ratchet.agents.chat._approval import ApprovalDecision, approval_call_id
from ratchet.agents.chat._tools import as_tool
from support.procs import kill as _kill
from support.procs import wait_for as _wait

HERE = Path(__file__).parent
AGENT = f"{HERE / 'approval_agent.py'}:ApprovalAgent"


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def marks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "marks"
    path.mkdir()
    monkeypatch.setenv("APPROVAL_MARKS", str(path))
    return path


def _run(tmp: Path, inputs: list[dict[str, Any]]) -> ratchet.EngineResult:
    """A bounded run on the test's state; it returns once every remaining run waits."""
    return ratchet.run(
        ApprovalAgent(),
        inputs=inputs,
        output=tmp / "out.jsonl",
        state_dir=tmp / "state",
        config=EngineConfig(checkpoint_interval=0.02),
    )


def _outputs(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "out.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _requests(tmp: Path) -> list[dict[str, Any]]:
    return [
        o["output"]["approval_request"]
        for o in _outputs(tmp)
        if isinstance(o["output"], dict) and "approval_request" in o["output"]
    ]


def _replies(tmp: Path) -> list[dict[str, Any]]:
    return [
        o["output"]
        for o in _outputs(tmp)
        if isinstance(o["output"], dict) and "reply" in o["output"]
    ]


def _refunds(marks: Path, stage: str = "done") -> list[dict[str, Any]]:
    files = sorted(marks.glob(f"refund_{stage}_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    return [json.loads(p.read_text()) for p in files]


def _tool_message(reply: dict[str, Any], name: str) -> dict[str, Any]:
    [msg] = [t for t in reply["tools"] if t["name"] == name]
    return msg


def _decide(tmp: Path, decision: Any, inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """Run until the run waits, check it asked once, send `decision`, run again: the reply."""
    _run(tmp, inputs)
    [req] = _requests(tmp)
    assert _replies(tmp) == []  # the run waits
    ratchet.send_signal(tmp / "state", "k", req["signal"], decision)
    _run(tmp, inputs)
    assert len(_requests(tmp)) == 1  # asked exactly once
    [reply] = _replies(tmp)
    return reply


MIXED = [{"key": "k", "script": "mixed"}]


# -- the flow, in process -----------------------------------------------------------------------


def test_approval_request_output_and_the_run_waits(tmp_path: Path, marks: Path) -> None:
    _run(tmp_path, MIXED)
    [rec] = _outputs(tmp_path)
    req = rec["output"]["approval_request"]
    assert req == {
        "call_id": req["call_id"],
        "signal": f"approval:{req['call_id']}",
        "tool": "refund",
        "arguments": {"order_id": "A-1", "amount_cents": 5000},
        "description": "Refund an order.",
        "tool_call_id": "c2",
        "request_id": req["request_id"],
    }
    assert len(req["call_id"]) == 24 and int(req["call_id"], 16) >= 0
    # Derived from the run, the task that asked, the call's position and the model's call id.
    call = ToolCall(id="c2", name="refund", arguments={"order_id": "A-1", "amount_cents": 5000})
    assert req["call_id"] == approval_call_id("k", rec["seq"], rec["task"], 1, call)
    assert rec["task"].endswith(">ratchet_tools")
    assert _refunds(marks, "start") == []  # nothing runs before the decision
    # Running again without a decision asks nobody again and runs nothing.
    _run(tmp_path, MIXED)
    assert _outputs(tmp_path) == [rec]
    assert _refunds(marks, "start") == []


def test_approved_call_runs_once_with_the_models_arguments(tmp_path: Path, marks: Path) -> None:
    reply = _decide(tmp_path, {"approved": True, "reason": "fine by ann"}, MIXED)
    assert reply["reply"] == "done"
    [refund] = _refunds(marks)
    assert (refund["order_id"], refund["amount_cents"]) == ("A-1", 5000)
    assert len(_refunds(marks, "start")) == 1
    msg = _tool_message(reply, "refund")
    assert json.loads(msg["content"]) == {"order_id": "A-1", "refunded": 5000}
    [req] = _requests(tmp_path)
    assert msg["extras"] == {
        "approval": {"call_id": req["call_id"], "approved": True, "reason": "fine by ann"}
    }
    # The call that needed no approval ran too, in the same round trip.
    lookup = _tool_message(reply, "lookup_order")
    assert json.loads(lookup["content"]) == {"order_id": "A-1", "total_cents": 5000}
    assert lookup["extras"] == {}
    # Another run of the finished job does nothing again.
    _run(tmp_path, MIXED)
    assert len(_outputs(tmp_path)) == 2
    assert len(_refunds(marks, "start")) == 1


def test_approved_call_runs_with_edited_arguments(tmp_path: Path, marks: Path) -> None:
    edited = {"order_id": "A-1", "amount_cents": 1234}
    reply = _decide(tmp_path, {"approved": True, "arguments": edited}, MIXED)
    [refund] = _refunds(marks)
    assert (refund["order_id"], refund["amount_cents"]) == ("A-1", 1234)
    msg = _tool_message(reply, "refund")
    note, result = msg["content"].split("\n")
    assert note == (
        "NOTE: a reviewer approved this call with changed arguments: "
        '{"amount_cents": 1234, "order_id": "A-1"}'
    )
    assert json.loads(result) == {"order_id": "A-1", "refunded": 1234}
    assert msg["extras"]["approval"]["arguments"] == edited


def test_rejected_call_never_runs_and_the_model_reads_why(tmp_path: Path, marks: Path) -> None:
    reply = _decide(tmp_path, {"approved": False, "reason": "outside the refund window"}, MIXED)
    assert _refunds(marks, "start") == []
    assert reply["reply"] == "done"
    msg = _tool_message(reply, "refund")
    assert msg["content"] == (
        "REJECTED: a reviewer did not approve this call of tool 'refund'; it did not run. "
        "Reason: outside the refund window"
    )
    assert msg["extras"]["is_error"] is True
    assert msg["extras"]["approval"]["approved"] is False
    # Arguments sent with a rejection change nothing.
    assert "arguments" not in msg["extras"]["approval"]


def test_invalid_edited_arguments_reach_the_model_not_the_tool(tmp_path: Path, marks: Path) -> None:
    bad = {"order_id": "A-1", "amount_cents": "a lot", "note": "x"}
    reply = _decide(tmp_path, {"approved": True, "arguments": bad}, MIXED)
    assert _refunds(marks, "start") == []
    msg = _tool_message(reply, "refund")
    assert msg["content"].startswith(
        "ERROR: a reviewer approved this call of tool 'refund' with changed arguments "
    )
    assert "amount_cents: Input should be a valid integer" in msg["content"]
    assert "note: Extra inputs are not permitted" in msg["content"]
    assert msg["content"].endswith("the tool did not run.")
    assert msg["extras"]["is_error"] is True


MALFORMED = [
    ("yes", "the value is a string, not an object"),
    (True, "the value is true or false, not an object"),
    (None, "the value is null, not an object"),
    ({"approve": True}, 'it has no "approved"'),
    ({"approved": "yes"}, '"approved" is "yes", not true or false'),
    ({"approved": True, "arguments": [1]}, '"arguments" is [1], not an object'),
    ({"approved": True, "reason": 7}, '"reason" is 7, not a string'),
]


@pytest.mark.parametrize(("value", "problem"), MALFORMED)
def test_a_malformed_decision_is_refused_when_sent_and_the_run_keeps_waiting(
    tmp_path: Path, marks: Path, value: Any, problem: str
) -> None:
    # It was stored (exit 0 / 202) and taken as a rejection for good: a corrected decision
    # sent after it was never read.
    _run(tmp_path, MIXED)
    [req] = _requests(tmp_path)
    with pytest.raises(
        ratchet.BadInputError, match=f"decides a tool approval.*{re.escape(problem)}"
    ):
        ratchet.send_signal(tmp_path / "state", "k", req["signal"], value)
    assert ratchet.open_state(tmp_path / "state").pending_signals() == []
    ratchet.send_signal(tmp_path / "state", "k", req["signal"], {"approved": True})
    _run(tmp_path, MIXED)
    assert _refunds(marks, "start") != []  # the corrected decision is the one taken


@pytest.mark.parametrize(("value", "problem"), MALFORMED)
def test_a_malformed_decision_stored_before_is_a_rejection_saying_what_is_wrong(
    value: Any, problem: str
) -> None:
    # A decision stored by an earlier ratchet, which did not check it when it was sent.
    decision = ApprovalDecision.from_signal("c1", value)
    assert not decision.approved and decision.malformed
    assert decision.reason is not None
    assert f"is not valid ({problem}; got " in decision.reason
    assert decision.reason.endswith("so the call was treated as rejected")


def test_two_approvals_decided_in_any_order(tmp_path: Path, marks: Path) -> None:
    inputs = [{"key": "k", "script": "two"}]
    _run(tmp_path, inputs)
    first, second = _requests(tmp_path)
    assert (first["tool_call_id"], second["tool_call_id"]) == ("c1", "c2")
    assert first["call_id"] != second["call_id"]
    # The later call's decision first: it is kept until the run waits for it.
    ratchet.send_signal(tmp_path / "state", "k", second["signal"], {"approved": True})
    _run(tmp_path, inputs)
    assert _replies(tmp_path) == []  # still waits for the first
    assert _refunds(marks, "start") == []
    ratchet.send_signal(tmp_path / "state", "k", first["signal"], {"approved": False})
    _run(tmp_path, inputs)
    [reply] = _replies(tmp_path)
    assert [r["order_id"] for r in _refunds(marks)] == ["A-2"]
    assert [t["content"].split(";")[0] for t in reply["tools"]] == [
        "REJECTED: a reviewer did not approve this call of tool 'refund'",
        '{"order_id": "A-2", "refunded": 200}',
    ]
    assert len(_requests(tmp_path)) == 2


def test_invalid_model_arguments_ask_nobody(tmp_path: Path, marks: Path) -> None:
    inputs = [{"key": "k", "script": "invalid"}]
    _run(tmp_path, inputs)  # completes without a decision
    assert _requests(tmp_path) == []
    [reply] = _replies(tmp_path)
    [msg] = reply["tools"]
    assert msg["content"].startswith("ERROR: invalid arguments for tool 'refund': amount_cents")
    assert _refunds(marks, "start") == []


def test_a_waiting_run_holds_back_only_its_own_key(tmp_path: Path, marks: Path) -> None:
    inputs = [
        {"key": "k", "script": "mixed"},
        {"key": "other", "script": "invalid"},
        {"key": "k", "script": "invalid"},
    ]
    _run(tmp_path, inputs)
    assert [(o["key"], o["seq"]) for o in _outputs(tmp_path) if "reply" in o["output"]] == [
        ("other", 1)
    ]
    [req] = _requests(tmp_path)
    ratchet.send_signal(tmp_path / "state", "k", req["signal"], {"approved": True})
    _run(tmp_path, inputs)
    done = [(o["key"], o["seq"]) for o in _outputs(tmp_path) if "reply" in o["output"]]
    assert sorted(done) == [("k", 0), ("k", 2), ("other", 1)]
    assert len(_refunds(marks)) == 1


# -- declaring tools ----------------------------------------------------------------------------


def test_requires_approval_is_declared_on_the_tool() -> None:
    def plain(x: int) -> int:
        """Plain."""
        return x

    @tool(requires_approval=True)
    def guarded(x: int) -> int:
        """Guarded."""
        return x

    assert as_tool(plain).requires_approval is False
    assert as_tool(tool(plain)).requires_approval is False
    assert as_tool(guarded).requires_approval is True
    assert Tool(plain, requires_approval=True).requires_approval is True
    assert repr(as_tool(guarded)) == "Tool('guarded', requires_approval=True)"
    assert guarded(3) == 3  # still a plain function
    with pytest.raises(ConfigError, match="requires_approval must be True or False"):
        tool(requires_approval="yes")  # type: ignore[arg-type]
    agent = ApprovalAgent()
    assert agent.resources.setup("desk").tools["refund"].requires_approval is True
    assert agent.resources.setup("desk").tools["lookup_order"].requires_approval is False


def test_approval_call_id_is_stable_and_distinct() -> None:
    call = ToolCall(id="c1", name="refund", arguments={"order_id": "A-1"})
    base = approval_call_id("k", 3, "r>ask.0>ratchet_chat.0>ratchet_tools", 0, call)
    assert base == approval_call_id("k", 3, "r>ask.0>ratchet_chat.0>ratchet_tools", 0, call)
    others = {
        approval_call_id("k2", 3, "r>ask.0>ratchet_chat.0>ratchet_tools", 0, call),
        approval_call_id("k", 4, "r>ask.0>ratchet_chat.0>ratchet_tools", 0, call),
        approval_call_id("k", 3, "r>ask.0>ratchet_chat.0>ratchet_tools.0>x", 0, call),
        approval_call_id("k", 3, "r>ask.0>ratchet_chat.0>ratchet_tools", 1, call),
        approval_call_id(
            "k", 3, "r>ask.0>ratchet_chat.0>ratchet_tools", 0, call.model_copy(update={"id": "c2"})
        ),
    }
    assert base not in others and len(others) == 5


def test_decisions_parse_without_raising() -> None:
    ok = ApprovalDecision.from_signal("id", {"approved": True, "arguments": {"a": 1}, "by": "x"})
    assert (ok.approved, ok.arguments, ok.reason, ok.malformed) == (True, {"a": 1}, None, False)
    no = ApprovalDecision.from_signal("id", {"approved": False, "arguments": {"a": 1}})
    assert (no.approved, no.arguments) == (False, None)
    bad = ApprovalDecision.from_signal("id", {"approved": True, "arguments": {1: 2}})
    assert bad.malformed and not bad.approved
    assert "keys that are not strings" in (bad.reason or "")
    long = ApprovalDecision.from_signal("id", "x" * 1000)
    assert long.malformed and len(long.reason or "") < 600


def test_approval_event_round_trips_and_checks_its_shape() -> None:
    calls = [ToolCall(id="c1", name="refund", arguments={"n": 1}), ToolCall(id="c2", name="x")]
    ev = ToolApprovalRequestEvent(
        request_id="r", model="m", tool_calls=calls, approval_ids=["a" * 24, None]
    )
    assert event_from_wire(*event_to_wire(ev)) == ev
    with pytest.raises(ValueError, match="approval_ids has 1 entries for 2 tool calls"):
        ToolApprovalRequestEvent(request_id="r", model="m", tool_calls=calls, approval_ids=[None])


def test_tools_without_approval_never_wait(tmp_path: Path) -> None:
    def lookup(order_id: str) -> str:
        """Look up."""
        return "shipped"

    model = ScriptedChatModel([ScriptedChatModel.tool_call("lookup", order_id="A"), "ok"])
    out: list[dict[str, Any]] = []
    ratchet.run(
        ratchet.ReActAgent(model, tools=[lookup]),
        inputs=[{"key": "k"}],
        output=out.append,
        state_dir=tmp_path / "state",
    )
    assert [o["output"] for o in out] == ["ok"]
    assert "approval" not in model.calls[1][-1].extras


# -- a real process, killed -----------------------------------------------------------------


def _start(tmp: Path, *, follow: bool, hold: bool = False) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "APPROVAL_MARKS": str(tmp / "marks"),
        "APPROVAL_HOLD_REFUND": "1" if hold else "0",
    }
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", AGENT,
        "--input", str(tmp / "in.jsonl"),
        "--output", str(tmp / "out.jsonl"),
        "--state", str(tmp / "state"),
        "--checkpoint-interval", "20",
    ]  # fmt: skip
    if follow:
        cmd.append("--follow")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _cli_signal(tmp: Path, name: str, value: Any) -> None:
    cmd = [
        sys.executable, "-m", "ratchet.cli", "signal",
        "--state", str(tmp / "state"), "--key", "k", name, "--value", json.dumps(value),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _finish(tmp: Path) -> None:
    """Restart bounded; it must exit 0 with the run completed."""
    proc = _start(tmp, follow=False)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]


def _setup(tmp: Path) -> None:
    (tmp / "marks").mkdir()
    (tmp / "in.jsonl").write_text(json.dumps({"key": "k", "script": "mixed"}) + "\n")


@pytest.mark.kill
def test_kill_while_waiting_then_signal_while_down(tmp_path: Path) -> None:
    _setup(tmp_path)
    proc = _start(tmp_path, follow=True)
    _wait(lambda: bool(_requests(tmp_path)), proc, "the approval request")
    _kill(proc)  # the run was waiting for approval:<call id>
    [req] = _requests(tmp_path)
    edited = {"order_id": "A-1", "amount_cents": 2500}
    _cli_signal(tmp_path, req["signal"], {"approved": True, "arguments": edited})
    _finish(tmp_path)
    assert len(_requests(tmp_path)) == 1  # the request was not repeated after the restart
    [reply] = _replies(tmp_path)
    assert reply["reply"] == "done"
    [refund] = _refunds(tmp_path / "marks")
    assert (refund["order_id"], refund["amount_cents"]) == ("A-1", 2500)
    assert len(_refunds(tmp_path / "marks", "start")) == 1
    msg = _tool_message(reply, "refund")
    assert msg["extras"]["approval"] == {
        "call_id": req["call_id"],
        "approved": True,
        "arguments": edited,
    }
    assert len(_outputs(tmp_path)) == 2
    _finish(tmp_path)  # nothing is left to do, nothing is repeated
    assert len(_outputs(tmp_path)) == 2
    assert len(_refunds(tmp_path / "marks", "start")) == 1


@pytest.mark.kill
def test_kill_while_the_approved_tool_runs_keeps_the_decision(tmp_path: Path) -> None:
    _setup(tmp_path)
    proc = _start(tmp_path, follow=True, hold=True)
    _wait(lambda: bool(_requests(tmp_path)), proc, "the approval request")
    [req] = _requests(tmp_path)
    edited = {"order_id": "A-1", "amount_cents": 700}
    _cli_signal(tmp_path, req["signal"], {"approved": True, "arguments": edited})
    marks = tmp_path / "marks"
    _wait(lambda: (marks / "refund_start_1").exists(), proc, "the approved refund started")
    _kill(proc)  # the decision was taken; the tool had not returned
    _finish(tmp_path)
    # The decision was not lost and is not needed again: the tool ran again (at least once,
    # like any tool killed while running) with the same arguments and idempotency key.
    starts = _refunds(marks, "start")
    assert [s["amount_cents"] for s in starts] == [700, 700]
    assert len({s["idempotency_key"] for s in starts}) == 1
    assert len(_refunds(marks)) == 1
    assert len(_requests(tmp_path)) == 1
    [reply] = _replies(tmp_path)
    assert json.loads(_tool_message(reply, "refund")["content"].split("\n")[1]) == {
        "order_id": "A-1",
        "refunded": 700,
    }
