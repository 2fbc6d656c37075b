"""Run the triage example: `python examples/support_triage/run.py [--provider openai]`.

The default scripted model needs no network. `--provider openai|anthropic|ollama` uses a real
model (set OPENAI_API_KEY / ANTHROPIC_API_KEY; TRIAGE_MODEL picks the model name).
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
    parser.add_argument(
        "--provider", default="scripted", choices=["scripted", "openai", "anthropic", "ollama"]
    )
    parser.add_argument("--state", help="state directory (default: a fresh temporary one)")
    parser.add_argument("--input", default=str(HERE / "tickets.jsonl"))
    args = parser.parse_args(argv)
    os.environ["TRIAGE_PROVIDER"] = args.provider
    sys.path.insert(0, str(HERE))
    from agent import TriageAgent  # reads TRIAGE_PROVIDER

    import ratchet

    state = Path(args.state) if args.state else Path(tempfile.mkdtemp(prefix="triage-"))
    outputs: list[dict[str, object]] = []
    try:
        result = ratchet.run(
            TriageAgent(), inputs=args.input, output=outputs.append, state_dir=state
        )
    finally:
        if not args.state:
            shutil.rmtree(state, ignore_errors=True)
    for rec in sorted(outputs, key=lambda r: r["seq"]):  # type: ignore[arg-type, return-value]
        print(
            json.dumps({"customer": rec["key"], **(rec["output"] or {"error": rec.get("error")})})
        )
    print(
        f"{result.inputs} tickets, {result.outputs} outputs, provider {args.provider}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
