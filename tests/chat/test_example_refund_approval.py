"""examples/refund_approval.py runs as its docstring says: in one process, and with the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "refund_approval.py"


def test_refund_approval_script() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60, check=True
    )
    replies = [line for line in proc.stdout.splitlines() if not line.startswith(" ")]
    assert replies[-3:] == [
        "ann: We refunded 49.99 EUR for order A-1001.",
        "bob: We refunded 44.50 EUR for order A-1002.",
        "cho: Sorry, we could not refund order A-1003. (REJECTED: a reviewer did not approve "
        "this call of tool 'refund'; it did not run. Reason: change of mind is not covered "
        "after 30 days)",
    ]
    assert "ann: approve refund(" in proc.stdout


def _cli(*args: str, env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def _outputs(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_refund_approval_through_the_cli(tmp_path: Path) -> None:
    env = {**os.environ, "REFUND_LOG": str(tmp_path / "refunds.jsonl")}
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        json.dumps({"key": "ann", "text": "My order A-1001 arrived broken."})
        + "\n"
        + json.dumps({"key": "bob", "text": "Refund A-1002 please."})
        + "\n"
    )
    run = [
        "run", f"{EXAMPLE}:RefundAgent",
        "--input", str(requests),
        "--output", str(tmp_path / "out.jsonl"),
        "--state", str(tmp_path / "state"),
    ]  # fmt: skip
    _cli(*run, env=env)  # exits 0 with both runs waiting
    asked = {o["key"]: o["output"]["approval_request"] for o in _outputs(tmp_path / "out.jsonl")}
    assert sorted(asked) == ["ann", "bob"]
    assert asked["ann"]["arguments"] == {"order_id": "A-1001", "amount_cents": 4999}
    assert not (tmp_path / "refunds.jsonl").exists()
    state = str(tmp_path / "state")
    _cli("signal", "--state", state, "--key", "ann", asked["ann"]["signal"],
         "--value", '{"approved": true}', env=env)  # fmt: skip
    _cli("signal", "--state", state, "--key", "bob", asked["bob"]["signal"],
         "--value", '{"approved": false, "reason": "no"}', env=env)  # fmt: skip
    _cli(*run, env=env)
    outs = _outputs(tmp_path / "out.jsonl")
    assert len(outs) == 4
    replies = {o["key"]: o["output"]["reply"] for o in outs if "reply" in o["output"]}
    assert replies["ann"] == "We refunded 49.99 EUR for order A-1001."
    assert replies["bob"].startswith("Sorry, we could not refund order A-1002. (REJECTED")
    refunds = _outputs(tmp_path / "refunds.jsonl")
    assert [(r["key"], r["order_id"], r["amount_cents"]) for r in refunds] == [
        ("ann", "A-1001", 4999)
    ]
