"""`ratchet status` of a state whose runs wait until past what the platform's clock can show
(`ctx.sleep(1e300)`, a signal timeout of sys.maxsize) says how far off the deadline is: it
printed a traceback (OverflowError: timestamp out of range for platform time_t). A real
`ratchet run --follow` and real `ratchet status` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

RATCHET = [sys.executable, "-m", "ratchet.cli"]
AGENT = """
import sys
from ratchet import Agent, InputEvent, action

class Far(Agent):
    @action(InputEvent)
    async def wait(self, event, ctx):
        if event.input["how"] == "sleep":
            await ctx.sleep(1e300)
        else:
            await ctx.wait_for_signal("go", timeout=sys.maxsize)
"""


def status(state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RATCHET, "status", "--state", str(state), *extra],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip


def test_a_deadline_past_the_platforms_clock_is_shown_as_far_off(tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "in.jsonl").write_text('{"key": "s", "how": "sleep"}\n{"key": "w", "how": "w"}\n')
    state = tmp_path / "st"
    job = subprocess.Popen(
        [*RATCHET, "run", f"{tmp_path / 'agent.py'}:Far", "--input", str(tmp_path / "in.jsonl"),
         "--output", str(tmp_path / "out.jsonl"), "--state", str(state), "--follow",
         "--checkpoint-interval", "0.05"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            got = status(state, "--json") if (state / "ratchet.db").exists() else None
            if got is not None and got.returncode == 0:
                waiting = json.loads(got.stdout)["waiting"]
                if len(waiting) == 2:
                    break
            assert job.poll() is None, job.communicate()[1]
            assert time.monotonic() < deadline, "timed out waiting for the two waits"
            time.sleep(0.05)
        shown = status(state)
        assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
        lines = [x for x in shown.stdout.splitlines() if "input 0: sleep" in x or "signal go" in x]
        assert len(lines) == 2, shown.stdout
        assert all("until far in the future (in " in x and " years)" in x for x in lines), lines
    finally:
        job.terminate()
        job.communicate(timeout=30)
