"""examples/outage_demo.py runs as its docstring says: the provider goes down in the middle,
the stream pauses and resumes, no input becomes an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "outage_demo.py"


@pytest.mark.slow
def test_outage_demo_pauses_and_resumes_with_no_errors() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ratchet] paused: chat:openai:http://127.0.0.1:" in proc.stdout
    assert "[ratchet] resumed: chat:openai:" in proc.stdout
    assert "120 questions, 120 outputs, 0 error outputs" in proc.stdout
    assert proc.stdout.rstrip().endswith(
        "the stream paused during the outage and resumed after it, with no error outputs"
    )
