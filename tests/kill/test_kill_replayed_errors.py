"""A durable call raised, then `ratchet run` was SIGKILLed: after the restart the recorded
exception is raised again with a type the action's `except` clauses treat as they did live, so
the recovered job's outputs and memory equal a crash-free run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.kill

AGENT = f"{Path(__file__).with_name('replayed_errors_agent.py')}:ErrorsAgent"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
KINDS = ["unregistered", "registered", "builtin", "uncaught", "ok"]


def start(work: Path, *, hold: bool) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RATCHET_TEST_EXEC_LOG=str(work / "exec.log"))
    env.pop("RATCHET_TEST_HOLD", None)
    if hold:
        env["RATCHET_TEST_HOLD"] = "1"
    with open(work / "stderr.log", "ab") as err:
        return subprocess.Popen(
            [
                *RATCHET,
                "run",
                AGENT,
                "--input",
                str(work / "in.jsonl"),
                "--output",
                str(work / "out.jsonl"),
                "--state",
                str(work / "state"),
                "--checkpoint-interval",
                "20",
                "--allow-errors",  # some of its runs end in error on purpose
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def log(work: Path) -> list[list[str]]:
    path = work / "exec.log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def finish(proc: subprocess.Popen[bytes], work: Path) -> None:
    assert proc.wait(timeout=120) == 0, (work / "stderr.log").read_text()


def outputs(work: Path) -> list[dict[str, Any]]:
    """The output records, by id, without the job id (each state directory is its own job)."""
    lines = (work / "out.jsonl").read_text().splitlines()
    records = [{k: v for k, v in json.loads(line).items() if k != "job"} for line in lines]
    return sorted(records, key=lambda o: o["id"])


def memory(work: Path) -> Any:
    out = subprocess.run(
        [*RATCHET, "inspect", "--state", str(work / "state"), "--json"],
        check=True,
        capture_output=True,
    )
    return json.loads(out.stdout)


def prepare(work: Path) -> None:
    work.mkdir()
    with (work / "in.jsonl").open("w") as fh:
        for i, kind in enumerate(KINDS):
            fh.write(json.dumps({"key": kind, "kind": kind, "n": i + 3}) + "\n")


def test_a_recorded_exception_takes_the_same_except_branch_after_a_sigkill(
    tmp_path: Path,
) -> None:
    reference = tmp_path / "reference"
    prepare(reference)
    finish(start(reference, hold=False), reference)

    crashed = tmp_path / "crashed"
    prepare(crashed)
    proc = start(crashed, hold=True)
    deadline = time.monotonic() + 60
    # Every action holds only after its call's outcome was written through to the state.
    while sum(p[1] == "held" for p in log(crashed)) < len(KINDS):
        assert proc.poll() is None, (crashed / "stderr.log").read_text()
        assert time.monotonic() < deadline, f"actions never all held: {log(crashed)}"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (crashed / "out.jsonl").exists() or not outputs(crashed)
    calls_before = [p for p in log(crashed) if p[1] == "call"]
    assert sorted(p[2] for p in calls_before) == sorted(KINDS)

    finish(start(crashed, hold=False), crashed)
    assert [p for p in log(crashed) if p[1] == "call"] == calls_before  # none called again

    expected = outputs(reference)
    by_key = {o["key"]: o for o in expected}
    assert by_key["unregistered"]["output"] == {
        "path": "fallback after RateLimited: rate limited on 3",
        "value": -1,
    }
    assert by_key["registered"]["output"] == {
        "path": "fallback after Throttled: throttled, retry after 4s (retry_after=4)",
        "value": -1,
    }
    assert by_key["builtin"]["output"] == {
        "path": "lookup fallback after KeyError: 'missing 5'",
        "value": -2,
    }
    assert by_key["uncaught"]["error"] == {
        "action": "go",
        "type": "ratchet_user_replayed_errors_agent.Unexpected",
        "message": "unexpected failure 6",
        "event_type": "ratchet.InputEvent",
    }
    assert by_key["ok"]["output"] == {"path": "primary", "value": 14}

    assert outputs(crashed) == expected
    assert memory(crashed) == memory(reference)
