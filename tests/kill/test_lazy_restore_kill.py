"""Lazy restore of keys across SIGKILL, with real processes (docs/runtime.md, "Recovery").

A restart reads only the keys that have inputs in flight or queued; every other key's memory
is read when its first input arrives. The claims, each checked after a SIGKILL and a restart
of a job whose state holds many idle keys:

- an idle key's memory comes back exactly (its next run sees its count);
- a run parked on a signal is resumed, and a signal sent while the job was down is
  delivered to it exactly once;
- a durable call whose answer was recorded before the kill is answered from the journal
  and not made again; each input's output is written exactly once.

Cases come from hypothesis (which keys wait, call, or just count; when the kill lands); a
failing case prints its seed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.jsonl import whole_lines

pytestmark = pytest.mark.kill

AGENT = f"{Path(__file__).with_name('lazy_agent.py')}:Tally"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
IDLE_KEYS = 300


class Job:
    def __init__(self, tmp: Path) -> None:
        self.input, self.output = tmp / "in.jsonl", tmp / "out.jsonl"
        self.state, self.log = tmp / "state", tmp / "calls.jsonl"
        self.env = dict(os.environ, LAZY_LOG=str(self.log))

    def write(self, rows: list[dict[str, Any]]) -> None:
        with self.input.open("a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)

    def start(self, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*RATCHET, "run", AGENT, "--input", str(self.input), "--output", str(self.output),
             "--state", str(self.state), "--checkpoint-interval", "50", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=self.env,
        )  # fmt: skip

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*RATCHET, *args], capture_output=True, text=True, env=self.env, timeout=60
        )

    def waiting(self) -> int:
        done = self.cli("status", "--state", str(self.state), "--json")
        return len(json.loads(done.stdout)["waiting"]) if done.returncode == 0 else -1

    def outputs(self) -> list[dict[str, Any]]:
        return [r["output"] for r in whole_lines(self.output)]


def finish(proc: subprocess.Popen[str], what: str) -> None:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}: {err[-3000:]}"


def plan(seed: int) -> tuple[list[dict[str, Any]], set[str], float]:
    """The inputs after the seeding run: some idle keys wait, some call, some just count."""
    rng = random.Random(seed)
    keys = rng.sample(range(IDLE_KEYS), 40)
    rows = []
    waiting: set[str] = set()
    for i, k in enumerate(keys):
        kind = rng.choice(["plain", "plain", "wait", "call", "wait+call"])
        row: dict[str, Any] = {"key": f"k{k}", "id": f"b{i}"}
        if "wait" in kind and len(waiting) < 4:
            row["wait"] = True
            waiting.add(row["key"])
        if "call" in kind:
            row["call"] = True
        rows.append(row)
    rows += [{"key": f"new{j}", "id": f"c{j}", "call": rng.random() < 0.3} for j in range(10)]
    return rows, waiting, rng.uniform(0.0, 0.4)


@pytest.mark.slow
@pytest.mark.timeout(600)
@settings(
    max_examples=int(os.environ.get("LAZY_KILL_EXAMPLES", "3")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(seed=st.integers(0, 2**32 - 1))
def test_lazy_restore_resumes_everything_after_sigkill(tmp_path_factory: Any, seed: int) -> None:
    job = Job(tmp_path_factory.mktemp("lazy"))
    hint = f"(seed {seed}; state in {job.state})"
    job.write([{"key": f"k{k}", "id": f"a{k}"} for k in range(IDLE_KEYS)])
    finish(job.start(), f"seeding {hint}")  # a state of 300 idle keys, each counted once
    rows, waiting, delay = plan(seed)
    job.write(rows)
    proc = job.start("--follow")
    deadline = time.monotonic() + 60
    while job.waiting() < len(waiting):  # every wait recorded in a checkpoint
        assert proc.poll() is None, f"exited early {hint}: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"waits never recorded {hint}"
        time.sleep(0.05)
    time.sleep(delay)  # somewhere among the calls in flight
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    killed = proc.pid

    for key in sorted(waiting):  # sent while the job is down: stored, delivered at restart
        sent = job.cli("signal", "--state", str(job.state), "--key", key, "go", "--value",
                       json.dumps({"v": f"go-{key}"}))  # fmt: skip
        assert sent.returncode == 0, f"{sent.stderr} {hint}"
    finish(job.start(), f"restart {hint}")

    outs = job.outputs()
    ids = [o["id"] for o in outs]
    assert sorted(ids) == sorted(
        {*(f"a{k}" for k in range(IDLE_KEYS)), *(r["id"] for r in rows)}
    ), f"each input's output exactly once {hint}"
    by_id = {o["id"]: o for o in outs}
    for r in rows:
        o = by_id[r["id"]]
        # An idle key's memory came back: its second input counts 2 (a new key's first, 1).
        assert o["n"] == (1 if r["key"].startswith("new") else 2), f"{o} {hint}"
        if r.get("wait"):
            assert o["signal"] == f"go-{r['key']}", f"{o} {hint}"
        if r.get("call"):
            calls = [e for e in whole_lines(job.log) if e["id"] == r["id"]]
            assert o["token"] in {e.get("token") for e in calls}, f"{o} {hint}"
            again = [e for e in calls if e["what"] == "begin" and e["pid"] != killed]
            assert len(again) <= 1, f"call of {r['id']} made {len(again)} times {hint}"
            if o["token"].endswith(f"@{killed}"):  # recorded before the kill: never made again
                assert not again, f"call of {r['id']} repeated after its answer {hint}"
    status = json.loads(job.cli("status", "--state", str(job.state), "--json").stdout)
    assert status["waiting"] == [] and status["pending_signals"] == [], f"{status} {hint}"
