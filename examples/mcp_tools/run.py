"""Run the MCP example: `python examples/mcp_tools/run.py [--provider openai] [--state DIR]`.

Starts nothing by hand: the agent starts server.py over stdio when its first model call
needs the tool list. Prints each reply, then the server's refund ledger (the idempotency
keys it received).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--provider", default="scripted", choices=["scripted", "openai"])
    parser.add_argument("--state", help="state directory (default: a fresh temporary one)")
    parser.add_argument("--input", default=str(HERE / "requests.jsonl"))
    args = parser.parse_args(argv)
    os.environ["MCP_TOOLS_PROVIDER"] = args.provider
    work = Path(args.state) if args.state else Path(tempfile.mkdtemp(prefix="mcp-tools-"))
    ledger = work / "orders-ledger.jsonl"
    os.environ["ORDERS_LEDGER"] = str(ledger)
    sys.path.insert(0, str(HERE))
    from agent import SupportAgent

    import ratchet

    outputs: list[dict[str, object]] = []
    try:
        ratchet.run(SupportAgent(), inputs=args.input, output=outputs.append, state_dir=work)
        for rec in sorted(outputs, key=lambda r: str(r["key"])):
            print(
                json.dumps({"customer": rec["key"], **(rec["output"] or {"error": rec["error"]})})
            )
        for line in ledger.read_text().splitlines() if ledger.exists() else []:
            row = json.loads(line)
            print(f"server ledger: {row['answer']} (idempotency key {row['key']})")
    finally:
        if not args.state:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
