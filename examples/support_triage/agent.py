"""A support-ticket triage agent: two tools (order lookup, refund), per-customer memory.

Runs with a scripted model by default (no network); `run.py --provider openai` (with
OPENAI_API_KEY set) uses a real model. See README.md beside this file.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import BaseModel

from ratchet import InputEvent, OutputEvent, RunnerContext, action, register_type
from ratchet.agents.chat import (
    ChatAgent,
    ChatMessage,
    ChatModel,
    ChatModelSetup,
    ChatRequestEvent,
    ChatResponseEvent,
    MessageRole,
    Prompt,
    ScriptedChatModel,
    ToolContext,
    chat_model_setup,
    prompt,
    tool,
)

ORDERS = {
    "A-1001": {"status": "delivered", "total_cents": 4999, "item": "kettle"},
    "A-1002": {"status": "in transit", "total_cents": 1299, "item": "mug"},
    "A-1003": {"status": "delivered", "total_cents": 8900, "item": "lamp"},
}
REFUND_LOG = os.environ.get("TRIAGE_REFUND_LOG")  # where the fake payment API writes


class Triage(BaseModel):
    category: Literal["shipping", "refund", "other"]
    urgent: bool
    reply: str


register_type(Triage, "support_triage.Triage")


def scripted_support_model() -> ScriptedChatModel:
    """A deterministic stand-in for an LLM: looks up the order, refunds damaged goods."""

    def respond(messages: list[ChatMessage]) -> Any:
        ticket = next(m.content for m in messages if m.role == MessageRole.USER)
        order = next((w.strip(".,!?") for w in ticket.split() if w.startswith("A-")), None)
        done = [m.name for m in messages if m.role == MessageRole.TOOL]
        damaged = "broken" in ticket or "damaged" in ticket
        if order and "lookup_order" not in done:
            return ScriptedChatModel.tool_call("lookup_order", "call_lookup", order_id=order)
        if order and damaged and "refund" not in done:
            total = json.loads(next(m.content for m in messages if m.name == "lookup_order"))
            return ScriptedChatModel.tool_call(
                "refund", "call_refund", order_id=order, amount_cents=total["total_cents"]
            )
        if damaged:
            return Triage(category="refund", urgent=True, reply=f"We refunded order {order}.")
        if order:
            return Triage(category="shipping", urgent=False, reply=f"Order {order} is on its way.")
        return Triage(category="other", urgent=False, reply="A human will get back to you.")

    return ScriptedChatModel(respond=respond)


def make_model(provider: str = "scripted") -> ChatModel:
    if provider == "openai":
        from ratchet.agents.chat import OpenAIChatModel

        return OpenAIChatModel(os.environ.get("TRIAGE_MODEL", "gpt-4o-mini"))
    if provider == "anthropic":
        from ratchet.agents.chat import AnthropicChatModel

        return AnthropicChatModel(os.environ.get("TRIAGE_MODEL", "claude-sonnet-4-5"))
    if provider == "ollama":
        from ratchet.agents.chat import OllamaChatModel

        return OllamaChatModel(os.environ.get("TRIAGE_MODEL", "qwen3:8b"))
    return scripted_support_model()


class TriageAgent(ChatAgent):
    """Triage one ticket per input: {"key": customer, "ticket": text}."""

    provider = os.environ.get("TRIAGE_PROVIDER", "scripted")

    @tool
    @staticmethod
    def lookup_order(order_id: str) -> dict[str, Any]:
        """Look up an order's status, item and total.

        Args:
            order_id: The order id, like "A-1001".
        """
        if order_id not in ORDERS:
            raise KeyError(f"no order {order_id}")
        return {"order_id": order_id, **ORDERS[order_id]}

    @tool
    @staticmethod
    def refund(order_id: str, amount_cents: int, context: ToolContext) -> dict[str, Any]:
        """Refund an order (a side effect: pass the idempotency key to the payment API).

        Args:
            order_id: The order to refund.
            amount_cents: The amount to refund, in cents.
        """
        if REFUND_LOG:
            with open(REFUND_LOG, "a") as f:
                f.write(json.dumps({"key": context.idempotency_key, "order": order_id}) + "\n")
        return {"refunded_cents": amount_cents, "refund_id": context.idempotency_key[:12]}

    @prompt
    @staticmethod
    def triage_prompt() -> Prompt:
        return Prompt.from_messages(
            [
                ChatMessage.system(
                    "You triage support tickets for Acme. Use the tools to check orders; refund "
                    "damaged goods. This customer has filed {previous} earlier ticket(s)."
                )
            ]
        )

    @chat_model_setup
    @staticmethod
    def triage_model() -> ChatModelSetup:
        return ChatModelSetup(
            make_model(TriageAgent.provider),
            prompt="triage_prompt",
            tools=["lookup_order", "refund"],
            output_schema=Triage,
        )

    @action(InputEvent)
    @staticmethod
    def on_ticket(event: InputEvent, ctx: RunnerContext) -> None:
        previous = ctx.short_term_memory.get("tickets", 0)
        ctx.short_term_memory.set("tickets", previous + 1)
        ctx.send_event(
            ChatRequestEvent(
                model="triage_model",
                messages=[ChatMessage.user(event.input["ticket"])],
                prompt_args={"previous": previous},
            )
        )

    @action(ChatResponseEvent)
    @staticmethod
    def on_triaged(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        triage = event.structured
        assert isinstance(triage, Triage)
        if triage.category == "refund":
            ctx.short_term_memory.set("refunds", ctx.short_term_memory.get("refunds", 0) + 1)
        ctx.send_event(
            OutputEvent(
                output={
                    **triage.model_dump(),
                    "customer_tickets": ctx.short_term_memory.get("tickets"),
                    "customer_refunds": ctx.short_term_memory.get("refunds", 0),
                    "tokens": event.usage.total_tokens,
                }
            )
        )
