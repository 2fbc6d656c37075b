"""examples/mcp_tools runs as its README says, offline, with a real MCP server over stdio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "mcp_tools"


def test_mcp_tools_example_runs_offline(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "run.py"), "--state", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = done.stdout.splitlines()
    replies = [json.loads(line) for line in lines if line.startswith("{")]
    first = "Order A-1001 is shipped with DHL."
    assert replies[:3] == [
        {"customer": "ann", "reply": first, "remembered": []},
        # ann's second question: her first conversation, from long-term memory
        {
            "customer": "ann",
            "reply": first,
            "remembered": [f"Q: Where is my order A-1001? A: {first}"],
        },
        {
            "customer": "bob",
            "reply": "Order A-1002 is processing. I refunded 500 cents on A-1002.",
            "remembered": [],
        },
    ]
    assert replies[3]["customer"] == "cho"
    assert replies[3]["reply"].startswith("ERROR: tool 'orders_lookup_order' raised MCPToolError")
    assert "no order 'A-9999'" in replies[3]["reply"]
    [ledger] = [line for line in lines if line.startswith("server ledger:")]
    assert ledger.startswith("server ledger: refunded 500 cents on A-1002 (idempotency key rt-")
