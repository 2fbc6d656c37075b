"""Tool calls that need a person's approval: call ids, the request record, the decision."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ratchet.agents.chat._messages import ToolCall

#: The prefix of the signal that carries a decision: `approval:<call id>`.
SIGNAL_PREFIX = "approval:"

#: The value a decision signal must have, as the error for a malformed one quotes it.
DECISION_SHAPE = (
    '{"approved": true|false, "arguments": {...} (optional, approved calls only), '
    '"reason": "..." (optional)}'
)


def approval_call_id(key: Any, seq: int, task_id: str, index: int, call: ToolCall) -> str:
    """The id of the approval of one tool call: the same after a crash, distinct elsewhere.

    Derived like the tool calls' idempotency keys, from the run (key, input sequence number),
    the task that asked (its id is deterministic), the call's position in the model's reply
    and the model's id for the call (which comes back from the journal on replay).
    """
    raw = f"approval|{key!r}|{seq}|{task_id}|{index}|{call.id}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def approval_signal(call_id: str) -> str:
    """The name of the signal that decides the approval `call_id`."""
    return f"{SIGNAL_PREFIX}{call_id}"


def approval_request_record(
    call_id: str, call: ToolCall, request_id: str, description: str
) -> dict[str, Any]:
    """The output that asks a person to decide one tool call (docs/chat.md has the shape)."""
    return {
        "approval_request": {
            "call_id": call_id,
            "signal": approval_signal(call_id),
            "tool": call.name,
            "arguments": call.arguments,
            "description": description,
            "tool_call_id": call.id,
            "request_id": request_id,
        }
    }


@dataclass(frozen=True)
class ApprovalDecision:
    """What the signal `approval:<call id>` decided about one tool call.

    `arguments` replaces the model's arguments of an approved call (None: run them as the
    model gave them). A malformed signal value is a rejection whose `reason` says what is
    wrong with it (`malformed` is True).
    """

    call_id: str
    approved: bool
    arguments: dict[str, Any] | None = None
    reason: str | None = None
    malformed: bool = False

    @classmethod
    def from_signal(cls, call_id: str, value: Any) -> ApprovalDecision:
        """The decision a signal's value holds; never raises (a bad value is a rejection)."""
        problem = decision_problem(value)
        if problem is not None:
            shown = _show(value)
            return cls(
                call_id,
                approved=False,
                reason=(
                    f"the decision sent as signal {approval_signal(call_id)!r} is not valid "
                    f"({problem}; got {shown}); expected {DECISION_SHAPE}, so the call was "
                    f"treated as rejected"
                ),
                malformed=True,
            )
        assert isinstance(value, dict)
        approved = value["approved"]
        arguments = value.get("arguments") if approved else None
        return cls(call_id, approved=approved, arguments=arguments, reason=value.get("reason"))

    def extras(self) -> dict[str, Any]:
        """What the tool message's `extras["approval"]` records of this decision."""
        rec: dict[str, Any] = {"call_id": self.call_id, "approved": self.approved}
        if self.reason is not None:
            rec["reason"] = self.reason
        if self.arguments is not None:
            rec["arguments"] = self.arguments
        if self.malformed:
            rec["malformed"] = True
        return rec


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    return f"a {type(value).__name__}"


def decision_problem(value: Any) -> str | None:
    """What is wrong with a decision signal's value, or None (senders refuse a bad one)."""
    if not isinstance(value, dict):
        return f"the value is {_json_type(value)}, not an object"
    if "approved" not in value:
        return 'it has no "approved"'
    if not isinstance(value["approved"], bool):
        return f'"approved" is {_show(value["approved"])}, not true or false'
    arguments = value.get("arguments")
    if arguments is not None and not isinstance(arguments, dict):
        return f'"arguments" is {_show(arguments)}, not an object'
    if arguments is not None and not all(isinstance(k, str) for k in arguments):
        return '"arguments" has keys that are not strings'
    reason = value.get("reason")
    if reason is not None and not isinstance(reason, str):
        return f'"reason" is {_show(reason)}, not a string'
    return None


def _show(value: Any, limit: int = 200) -> str:
    try:
        text = json.dumps(value, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
