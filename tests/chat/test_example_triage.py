"""The support_triage example runs as documented, with the scripted model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "support_triage"


def test_triage_example_through_the_cli(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TRIAGE_PROVIDER": "scripted",
        "TRIAGE_REFUND_LOG": str(tmp_path / "refunds"),
    }
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", f"{EXAMPLE / 'agent.py'}:TriageAgent",
        "--input", str(EXAMPLE / "tickets.jsonl"),
        "--output", str(tmp_path / "out.jsonl"),
        "--state", str(tmp_path / "state"),
    ]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=60)
    outs = sorted(
        (json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()),
        key=lambda r: r["seq"],
    )
    assert [(o["key"], o["output"]["category"]) for o in outs] == [
        ("ann", "shipping"),
        ("bob", "refund"),
        ("ann", "refund"),
        ("cho", "other"),
    ]
    assert outs[2]["output"]["customer_tickets"] == 2  # per-customer memory across runs
    refunds = [json.loads(line) for line in (tmp_path / "refunds").read_text().splitlines()]
    assert sorted(r["order"] for r in refunds) == ["A-1001", "A-1003"]
    assert len({r["key"] for r in refunds}) == 2


def test_triage_run_script() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE / "run.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["customer"] for line in lines] == ["ann", "bob", "ann", "cho"]
