"""A job of an agent of tests/kill/waits_agent.py, run the way a user runs it: real `ratchet
run` processes and CLI commands on a real state directory (the durable-wait and signal tests
share it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

AGENTS = Path(__file__).parent.parent / "kill" / "waits_agent.py"
RATCHET = [sys.executable, "-m", "ratchet.cli"]


class WaitsJob:
    def __init__(self, tmp: Path, agent: str) -> None:
        self.tmp = tmp
        self.agent = f"{AGENTS}:{agent}"
        self.input = tmp / "in.jsonl"
        self.output = tmp / "out.jsonl"
        self.state = tmp / "state"
        self.log = tmp / "log.jsonl"  # what the agent writes of its waits (WAITS_LOG)
        self.env = dict(os.environ, WAITS_LOG=str(self.log))

    def write(self, *rows: dict[str, Any]) -> None:
        with self.input.open("a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")

    def args(self, *extra: str) -> list[str]:
        return [*RATCHET, "run", self.agent, "--input", str(self.input), "--output",
                str(self.output), "--state", str(self.state), "--checkpoint-interval", "50",
                *extra]  # fmt: skip

    def start(self, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.args(*extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=self.env,
        )  # fmt: skip

    def run_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A ratchet command, whatever its exit code."""
        return subprocess.run(
            [*RATCHET, *args], capture_output=True, text=True, env=self.env, timeout=60
        )

    def cli(self, *args: str) -> Any:
        """A ratchet command that must succeed: its JSON (with --json) or its stdout."""
        done = self.run_cli(*args)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout) if "--json" in args else done.stdout

    @staticmethod
    def lines(path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]

    def outputs(self) -> list[Any]:
        return [r["output"] for r in self.lines(self.output)]


def until(what: str, check: Callable[[], Any], proc: subprocess.Popen[str]) -> Any:
    """`check()`'s first true value, polled; fails if the job exits first or after 60 s."""
    deadline = time.monotonic() + 60
    while not (value := check()):
        if proc.poll() is not None:
            raise AssertionError(f"the job exited before {what}: {proc.communicate()[1]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value
