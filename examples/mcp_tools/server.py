"""A small MCP server for the example: an order book with two tools and a prompt, written
with the official `mcp` SDK. The agent starts it over stdio; you can also serve it over HTTP:

    python examples/mcp_tools/server.py --http 8000    # then MCP_URL=http://127.0.0.1:8000/mcp

`refund` shows what a server does with the idempotency key ratchet sends in each call's
`_meta`: it keeps the keys it has acted on (in $ORDERS_LEDGER, a JSON-lines file) and answers
a repeated key with the first answer instead of refunding twice.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

ORDERS = {
    "A-1001": {"status": "shipped", "carrier": "DHL", "total_cents": 4999},
    "A-1002": {"status": "processing", "carrier": None, "total_cents": 1250},
}
LEDGER = Path(os.environ.get("ORDERS_LEDGER", "orders-ledger.jsonl"))
KEY = "ratchet/idempotency_key"

app = MCPServer("orders", log_level="WARNING")


def _ledger() -> dict[str, dict[str, object]]:
    if not LEDGER.exists():
        return {}
    rows = (json.loads(line) for line in LEDGER.read_text().splitlines())
    return {row["key"]: row for row in rows}


@app.tool()
def lookup_order(order_id: str) -> dict[str, object]:
    """Look up an order's status and carrier.

    Args:
        order_id: The order id, like "A-1001".
    """
    if order_id not in ORDERS:
        raise ToolError(f"no order {order_id!r}")
    return {"order_id": order_id, **ORDERS[order_id]}


@app.tool()
def refund(order_id: str, amount_cents: int, ctx: Context) -> str:
    """Refund (part of) an order.

    Args:
        order_id: The order to refund.
        amount_cents: How much, in cents.
    """
    key = (ctx.request_context.meta or {}).get(KEY) or "no-key"
    seen = _ledger().get(key)
    if seen is not None:  # the same call again (after a crash): do not refund twice
        return str(seen["answer"])
    if order_id not in ORDERS:
        raise ToolError(f"no order {order_id!r}")
    answer = f"refunded {amount_cents} cents on {order_id}"
    with LEDGER.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"key": key, "order_id": order_id, "answer": answer}) + "\n")
    return answer


@app.prompt()
def support_instructions(shop: str) -> str:
    """The instructions of the support desk."""
    return (
        f"You are the support desk of {shop}. Look orders up before you answer; refund only "
        f"orders that exist."
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http"]:
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
