"""An order-processing agent: per-customer memory, a durable (paid-for) scoring call, outputs.

Run it yourself:

    ratchet run examples/orders_agent.py:OrderAgent --input orders.jsonl \
        --output decisions.jsonl --state .ratchet-state --key customer
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

from ratchet import Agent, Event, InputEvent, OutputEvent, RunnerContext, action


class Scored(Event):
    """An order with its risk score attached."""

    event_name = "orders.Scored"
    order_id: int
    amount: int
    score: float


_CALL_LOG = os.environ.get("ORDERS_CALL_LOG")


def risk_score(customer: str, amount: int, orders_so_far: int) -> float:
    """Stands in for a slow, billed model call; durable_execute records its answer."""
    if _CALL_LOG:  # the demo counts real (paid) calls outside ratchet's state
        with open(_CALL_LOG, "a") as fh:
            fh.write(f"{customer} {orders_so_far}\n")
    digest = hashlib.sha256(f"{customer}:{amount}:{orders_so_far}".encode()).digest()
    return round(digest[0] / 255 * (1.5 if orders_so_far < 2 else 0.7), 3)


class OrderAgent(Agent):
    """Keeps each customer's history and decides on every order."""

    @action(InputEvent)
    async def score(self, event: InputEvent, ctx: RunnerContext) -> None:
        order = event.input
        history = ctx.short_term_memory
        orders = history.get("orders", 0)
        await asyncio.sleep(0.005)  # network latency of the model call
        score = await ctx.durable_execute_async(
            risk_score, order["customer"], order["amount"], orders
        )
        history.set("orders", orders + 1)
        history.set("spent", history.get("spent", 0) + order["amount"])
        # A raw bytes value: it comes back as bytes after any crash.
        history.set("last_order_digest", hashlib.sha256(str(order["id"]).encode()).digest()[:8])
        ctx.send_event(Scored(order_id=order["id"], amount=order["amount"], score=score))

    @action(Scored)
    async def decide(self, event: Scored, ctx: RunnerContext) -> None:
        await asyncio.sleep(0.02)  # e.g. notifying a downstream system
        decision = "review" if event.score > 0.9 else "approve"
        if decision == "review":
            ctx.short_term_memory.set("reviews", ctx.short_term_memory.get("reviews", 0) + 1)
        ctx.send_event(
            OutputEvent(
                output={"order": event.order_id, "decision": decision, "score": event.score}
            )
        )


def expected_memory(orders: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What the committed memory must be after all orders: computed without ratchet."""
    out: dict[str, dict[str, Any]] = {}
    for order in orders:
        m = out.setdefault(order["customer"], {"orders": 0, "spent": 0})
        score = risk_score(order["customer"], order["amount"], m["orders"])
        m["orders"] += 1
        m["spent"] += order["amount"]
        m["last_order_digest"] = hashlib.sha256(str(order["id"]).encode()).digest()[:8]
        if score > 0.9:
            m["reviews"] = m.get("reviews", 0) + 1
    return out
