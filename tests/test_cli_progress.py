"""On a terminal `ratchet run` shows a progress line and ends with a "done:" line, with one
worker and with --workers N (which printed nothing at all)."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

AGENT = f"{Path(__file__).parent / 'kill' / 'kill_agent.py'}:KillAgent"


def _run_on_a_terminal(tmp_path: Path, workers: int) -> str:
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"key": f"k{i % 5}", "value": i}) + "\n" for i in range(40))
    )
    controller, terminal = pty.openpty()
    argv = [sys.executable, "-m", "ratchet.cli", "run", AGENT, "--input",
            str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"), "--state",
            str(tmp_path / "st"), "--workers", str(workers), "--checkpoint-interval", "0.05"]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=terminal)  # fmt: skip
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert proc.wait(timeout=120) == 0
    text = b"".join(chunks).decode(errors="replace")
    return " ".join(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).split())  # no colours, wraps


@pytest.mark.parametrize("workers", [1, 2])
def test_a_terminal_gets_a_progress_line_and_a_done_line(tmp_path: Path, workers: int) -> None:
    shown = _run_on_a_terminal(tmp_path, workers)
    assert "inputs 40" in shown and "done 40" in shown, shown[-2000:]
    if workers > 1:
        assert f"({workers} workers)" in shown
    assert "done: 40 runs, 40 outputs" in shown, shown[-2000:]
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 40


def test_the_json_summary_carries_the_processs_counters(tmp_path: Path) -> None:
    # ctx.metrics and ratchet's own counters (durable calls made, replayed) reached only a
    # supervised job's /metrics: an unsupervised run could not show them.
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"key": f"k{i % 3}", "value": i}) + "\n" for i in range(6))
    )
    done = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "run", AGENT, "--input", str(tmp_path / "in.jsonl"),
         "--output", str(tmp_path / "o.jsonl"), "--state", str(tmp_path / "st"), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    metrics = json.loads(done.stdout)["metrics"]
    assert metrics.get("durable_calls.made") == 6, metrics
