"""The agent of the tool-approval tests, in process and in a `ratchet run` subprocess.

`refund` requires approval, `lookup_order` does not. Every refund that starts writes
`$APPROVAL_MARKS/refund_start_<n>` (its arguments and idempotency key as JSON) and every one
that returns `refund_done_<n>`, so a test counts executions across processes. With
`APPROVAL_HOLD_REFUND=1` the first refund holds for a minute (the test kills it there).

The scripted model picks its tool calls by the input's `script` (see SCRIPTS); once tool
results are in, it replies "done". The output holds the reply and every tool message the
model received, with its extras.
"""

from __future__ import annotations

import json
import os
import time
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
    ToolCall,
    ToolContext,
    chat_model_setup,
    tool,
)

call = ScriptedChatModel.tool_call

SCRIPTS: dict[str, list[ToolCall]] = {
    # one call that needs approval, beside one that does not
    "mixed": [
        call("lookup_order", "c1", order_id="A-1"),
        call("refund", "c2", order_id="A-1", amount_cents=5000),
    ],
    # two calls that need approval
    "two": [
        call("refund", "c1", order_id="A-1", amount_cents=100),
        call("refund", "c2", order_id="A-2", amount_cents=200),
    ],
    # arguments that do not validate: nobody is asked
    "invalid": [call("refund", "c1", order_id="A-1", amount_cents="lots")],
}


def _marks() -> Path:
    return Path(os.environ["APPROVAL_MARKS"])


def respond(messages: list[ChatMessage]) -> Any:
    if any(m.role == MessageRole.TOOL for m in messages):
        return "done"
    script = json.loads(next(m.content for m in messages if m.role == MessageRole.USER))
    return SCRIPTS[script]


class ApprovalAgent(ChatAgent):
    @tool
    @staticmethod
    def lookup_order(order_id: str) -> dict[str, Any]:
        """Look up an order.

        Args:
            order_id: The order's id.
        """
        return {"order_id": order_id, "total_cents": 5000}

    @tool(requires_approval=True)
    @staticmethod
    def refund(order_id: str, amount_cents: int, context: ToolContext) -> dict[str, Any]:
        """Refund an order.

        Args:
            order_id: The order to refund.
            amount_cents: How much, in cents.
        """
        marks = _marks()
        n = len(list(marks.glob("refund_start_*"))) + 1
        record = {
            "order_id": order_id,
            "amount_cents": amount_cents,
            "idempotency_key": context.idempotency_key,
        }
        (marks / f"refund_start_{n}").write_text(json.dumps(record))
        if os.environ.get("APPROVAL_HOLD_REFUND") == "1" and n == 1:
            time.sleep(60)  # the test kills the process here
        (marks / f"refund_done_{n}").write_text(json.dumps(record))
        return {"refunded": amount_cents, "order_id": order_id}

    @chat_model_setup
    @staticmethod
    def desk() -> ChatModelSetup:
        return ChatModelSetup(ScriptedChatModel(respond=respond), tools=["lookup_order", "refund"])

    @action(InputEvent)
    @staticmethod
    def ask(event: InputEvent, ctx: RunnerContext) -> None:
        text = json.dumps(event.input["script"])
        ctx.send_event(ChatRequestEvent(model="desk", messages=[ChatMessage.user(text)]))

    @action(ChatResponseEvent)
    @staticmethod
    def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        tools = [
            {"name": m.name, "content": m.content, "extras": m.extras}
            for m in event.messages
            if m.role == MessageRole.TOOL
        ]
        ctx.send_event(OutputEvent(output={"reply": event.response.content, "tools": tools}))
