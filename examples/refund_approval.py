"""A refund agent whose `refund` tool needs a person's approval before it runs.

The model (a scripted stand-in: no network, no key) looks the order up, then asks for a refund
of the order's total. `refund` is declared `@tool(requires_approval=True)`, so instead of
running it the agent writes an approval request to the output and the run waits, durably,
for the signal `approval:<call id>`. A person approves (optionally with changed arguments) or
rejects; the run continues: an approved refund runs once, a rejected one never runs and the
model is told why. See docs/chat.md, "Tools that need approval".

The whole flow in one process (a temporary state directory; three customers: one refund
approved, one approved for a smaller amount, one rejected):

    python examples/refund_approval.py

The same with the command line, the way an operator does it:

    printf '%s\\n' '{"key": "ann", "text": "My order A-1001 arrived broken."}' > requests.jsonl
    ratchet run examples/refund_approval.py:RefundAgent --input requests.jsonl \\
        --output out.jsonl --state refund-state
    # exits 0 with the run waiting; out.jsonl holds the request:
    # {"id": ..., "key": "ann", ..., "output": {"approval_request": {"call_id": "3f0c...",
    #   "signal": "approval:3f0c...", "tool": "refund",
    #   "arguments": {"order_id": "A-1001", "amount_cents": 4999}, ...}}}
    ratchet signal --state refund-state --key ann approval:3f0c... --value '{"approved": true}'
    ratchet run examples/refund_approval.py:RefundAgent --input requests.jsonl \\
        --output out.jsonl --state refund-state
    # the refund runs; out.jsonl gets the reply

`--value '{"approved": true, "arguments": {"order_id": "A-1001", "amount_cents": 2000}}'`
refunds a different amount; `--value '{"approved": false, "reason": "..."}'` declines. Set
REFUND_LOG=FILE to have the stand-in payment API append each refund it makes to FILE.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ratchet import InputEvent, OutputEvent, RunnerContext, action
from ratchet.agents.chat import (
    ChatAgent,
    ChatMessage,
    ChatModelSetup,
    ChatRequestEvent,
    ChatResponseEvent,
    MessageRole,
    ScriptedChatModel,
    ToolContext,
    chat_model_setup,
    tool,
)

ORDERS = {
    "A-1001": {"item": "kettle", "total_cents": 4999},
    "A-1002": {"item": "lamp", "total_cents": 8900},
    "A-1003": {"item": "mug", "total_cents": 1299},
}


def scripted_refund_model() -> ScriptedChatModel:
    """A deterministic stand-in for an LLM: look the order up, ask for a full refund, report.

    It answers from the conversation alone, so a replay after a crash gets the same replies.
    """

    def respond(messages: list[ChatMessage]) -> Any:
        text = next(m.content for m in messages if m.role == MessageRole.USER)
        order_id = next(w.strip(".,!?") for w in text.split() if w.startswith("A-"))
        results = {m.name: m.content for m in messages if m.role == MessageRole.TOOL}
        if "lookup_order" not in results:
            return ScriptedChatModel.tool_call("lookup_order", "call_lookup", order_id=order_id)
        if "refund" not in results:
            total = json.loads(results["lookup_order"])["total_cents"]
            return ScriptedChatModel.tool_call(
                "refund", "call_refund", order_id=order_id, amount_cents=total
            )
        outcome = results["refund"]  # the receipt (after a note if the amount was changed)
        try:
            receipt = json.loads(outcome.splitlines()[-1])
        except ValueError:  # REJECTED: ... or ERROR: ...
            return f"Sorry, we could not refund order {order_id}. ({outcome})"
        return f"We refunded {receipt['amount_cents'] / 100:.2f} EUR for order {order_id}."

    return ScriptedChatModel(respond=respond)


class RefundAgent(ChatAgent):
    """Answers refund requests; every refund waits for a person's approval."""

    @tool
    @staticmethod
    def lookup_order(order_id: str) -> dict[str, Any]:
        """Look up an order: its item and total.

        Args:
            order_id: The order id, like "A-1001".
        """
        return {"order_id": order_id, **ORDERS.get(order_id, {"item": "?", "total_cents": 0})}

    @tool(requires_approval=True)
    @staticmethod
    def refund(order_id: str, amount_cents: int, context: ToolContext) -> dict[str, Any]:
        """Refund (part of) an order to the customer's card. Needs a person's approval.

        Args:
            order_id: The order to refund.
            amount_cents: How much, in cents.
        """
        # A real payment API deduplicates on the idempotency key (docs/chat.md).
        receipt = {
            "order_id": order_id,
            "amount_cents": amount_cents,
            "refund_id": "re_" + context.idempotency_key[3:15],
        }
        log = os.environ.get("REFUND_LOG")
        if log:
            with open(log, "a") as fh:
                fh.write(json.dumps({"key": context.key, **receipt}) + "\n")
        return receipt

    @chat_model_setup
    @staticmethod
    def refunds() -> ChatModelSetup:
        return ChatModelSetup(scripted_refund_model(), tools=["lookup_order", "refund"])

    @action(InputEvent)
    @staticmethod
    def ask(event: InputEvent, ctx: RunnerContext) -> None:
        ctx.send_event(
            ChatRequestEvent(model="refunds", messages=[ChatMessage.user(event.input["text"])])
        )

    @action(ChatResponseEvent)
    @staticmethod
    def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        ctx.send_event(OutputEvent(output={"reply": event.response.content}))


REQUESTS = [
    {"key": "ann", "text": "My order A-1001 arrived broken."},
    {"key": "bob", "text": "The lamp from A-1002 flickers, please refund."},
    {"key": "cho", "text": "I changed my mind about A-1003."},
]

# What the reviewer decides for each customer (in a real deployment: a person, through
# `ratchet signal`, the REST endpoint or `ratchet.send_signal`).
DECISIONS: dict[str, dict[str, Any]] = {
    "ann": {"approved": True},
    "bob": {
        "approved": True,
        "arguments": {"order_id": "A-1002", "amount_cents": 4450},
        "reason": "half: the lamp still works",
    },
    "cho": {"approved": False, "reason": "change of mind is not covered after 30 days"},
}


def _outputs(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> int:
    import ratchet

    workdir = Path(tempfile.mkdtemp(prefix="refund-approval-"))
    state = workdir / "state"
    inputs = workdir / "requests.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    out = workdir / "out.jsonl"
    try:
        # 1. Runs until every run waits for its approval; the requests are in the output.
        ratchet.run(RefundAgent(), inputs=inputs, output=out, state_dir=state)
        requests = [o for o in _outputs(out) if "approval_request" in (o["output"] or {})]
        requests.sort(key=lambda rec: rec["seq"])  # keys run concurrently: show input order
        for rec in requests:
            req = rec["output"]["approval_request"]
            print(f"{rec['key']}: approve {req['tool']}({json.dumps(req['arguments'])})?")
            print(f"    signal {req['signal']}")
        # 2. The reviewer decides; the state keeps the decisions until the runs take them.
        for rec in requests:
            decision = DECISIONS[rec["key"]]
            signal = rec["output"]["approval_request"]["signal"]
            ratchet.send_signal(state, rec["key"], signal, decision)
            print(f"{rec['key']}: sent {json.dumps(decision)}")
        # 3. The same job again: the waiting runs take their decisions and finish.
        ratchet.run(RefundAgent(), inputs=inputs, output=out, state_dir=state)
        replies = sorted(
            (rec["seq"], rec["key"], rec["output"]["reply"])
            for rec in _outputs(out)
            if rec["output"] and "reply" in rec["output"]
        )
        for _seq, key, reply in replies:
            print(f"{key}: {reply}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
