"""An output sent with `delay=` or `at=` (a reminder, a follow-up) goes out when it falls due,
once, across SIGKILLs at any moment (docs/runtime.md, "Durable time and signals").

It was silently dropped: a delayed event is delivered to the run's listeners when it falls
due, and nothing listens to outputs; the job exited 0, the trace called the run "ok", and the
reminder never went out. Real `ratchet run` processes, real time; the kill moments are drawn
from a seed that a failure prints (`RATCHET_TEST_SEED=...` replays it).
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

pytestmark = pytest.mark.kill

RATCHET = [sys.executable, "-m", "ratchet.cli"]
AGENT_SRC = """
import datetime
from ratchet import Agent, InputEvent, OutputEvent, action

class Remind(Agent):
    @action(InputEvent)
    def start(self, event, ctx):
        i = event.input["i"]
        ctx.send_event(OutputEvent(output={"later": i}), delay=event.input["delay"])
        soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=0.3)
        ctx.send_event(OutputEvent(output={"at": i}), at=soon)
        ctx.send_event(OutputEvent(output={"now": i}))
"""


def setup(tmp: Path, delays: list[float]) -> list[str]:
    (tmp / "agent.py").write_text(AGENT_SRC)
    (tmp / "in.jsonl").write_text(
        "".join(
            json.dumps({"key": f"k{i % 3}", "i": i, "delay": d}) + "\n"
            for i, d in enumerate(delays)
        )
    )
    return [*RATCHET, "run", f"{tmp / 'agent.py'}:Remind", "--input", str(tmp / "in.jsonl"),
            "--output", str(tmp / "out.jsonl"), "--state", str(tmp / "state")]  # fmt: skip


def outputs(tmp: Path) -> list[dict[str, Any]]:
    out = tmp / "out.jsonl"
    return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


def assert_each_once(tmp: Path, n: int) -> None:
    got = outputs(tmp)
    ids = [o["id"] for o in got]
    assert len(ids) == len(set(ids)), f"ids written twice: {sorted(ids)}"
    for kind in ("now", "at", "later"):
        assert sorted(o["output"][kind] for o in got if kind in o["output"]) == list(range(n)), (
            kind,
            got,
        )
    assert len(got) == 3 * n


def test_a_delayed_output_goes_out_when_it_falls_due(tmp_path: Path) -> None:
    argv = setup(tmp_path, [0.5, 0.2])
    t = time.monotonic()
    done = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["outputs"] == 6
    assert_each_once(tmp_path, 2)
    # Its id names the task that sent it and the event's index, as any output's does.
    later = next(o for o in outputs(tmp_path) if o["output"].get("later") == 0)
    assert later["id"] == "k0:0:r>start:0", later
    assert took >= 0.5  # the job waited for it (not a timing assertion on speed)


@pytest.mark.slow  # up to four kills and a last run, each waiting out real delays
def test_delayed_outputs_go_out_once_across_sigkills(tmp_path: Path) -> None:
    seed = int(os.environ.get("RATCHET_TEST_SEED") or random.randrange(1 << 32))
    rng = random.Random(seed)
    n = 6
    argv = setup(tmp_path, [round(rng.uniform(0.2, 1.5), 2) for _ in range(n)])
    kills = 0
    for _ in range(4):
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.15, 1.2))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        kills += 1
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"seed {seed}: {done.stderr}"
    try:
        assert_each_once(tmp_path, n)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed} ({kills} kills): {exc}") from None
