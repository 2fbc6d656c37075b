"""One job at a time writes an output file: a real `ratchet run` holds a lock on its JSONL
output while it runs, a second job into the same file is refused (exit 2, naming the process
that writes it) instead of writing beside it, and a SIGKILL of the first ends its hold."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.kill

AGENT = f"{Path(__file__).with_name('io_agent.py')}:Relay"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
N = 300


def command(inputs: Path, out: Path, state: Path, workers: int, *extra: str) -> list[str]:
    return [
        *RATCHET, "run", AGENT, "--input", str(inputs), "--output", str(out),
        "--state", str(state), "--workers", str(workers), "--checkpoint-interval", "0.05",
        *extra,
    ]  # fmt: skip


def lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


@pytest.mark.parametrize("workers", [1, 2])
def test_a_second_job_is_refused_while_the_first_writes(tmp_path: Path, workers: int) -> None:
    inputs, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inputs.write_text(
        "".join(json.dumps({"key": f"k{i % 2}", "i": i, "sleep": 0.03}) + "\n" for i in range(N))
    )
    with open(tmp_path / "a.log", "ab") as err:
        first = subprocess.Popen(
            command(inputs, out, tmp_path / "a", workers), stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        deadline = time.monotonic() + 60
        while not lines(out) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert first.poll() is None, "the first job ended before the second could start"
        second = subprocess.run(
            command(inputs, out, tmp_path / "b", workers, "--append-output"),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert first.poll() is None, "the first job ended while the second was refused"
        assert second.returncode == 2, second.stderr
        assert "is being written by another running job" in second.stderr, second.stderr
        assert f"(process {first.pid})" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        assert {r["job"] for r in lines(out)} == {lines(out)[0]["job"]}, "the second wrote"
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    # The kill ended the first job's hold: it resumes into the same file, then the second runs.
    for state, extra in (("a", ()), ("b", ("--append-output",))):
        done = subprocess.run(
            command(inputs, out, tmp_path / state, workers, *extra),
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    per_job: dict[str, list[int]] = {}
    for rec in lines(out):
        per_job.setdefault(rec["job"], []).append(rec["output"]["i"])
    assert len(per_job) == 2
    for job, got in per_job.items():
        assert sorted(got) == list(range(N)), f"job {job}: each input's output once"
