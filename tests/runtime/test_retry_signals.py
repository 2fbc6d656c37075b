"""A retried action's failed attempt gives back the signals it took (docs/runtime.md,
"Retries, dead letters and exit codes"): real `ratchet run` and `ratchet signal` processes
on a real state dir, with the agent `RetriedWait` of tests/kill/waits_agent.py (waits for
"go", fails its first attempt, and its second waits for "go" again and outputs the value).

- One signal sent is enough: the retried attempt gets the one the failed attempt took, and
  nothing stays pending or waiting. Before the fix the second attempt waited for a new one
  for ever (the job hung, the value sent lost).
- Put back in its place: with "go" 1 and 2 sent before the run waits, the retried attempt
  gets 1 again (sent first), and 2 stays pending under its own id. Before the fix it got 2.

The same across a SIGKILL during the backoff: tests/kill/test_waits_kill.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from support.waits_job import WaitsJob, until


class Job(WaitsJob):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, "RetriedWait")
        self.write({"key": "k"})

    def run(self) -> str:
        """A bounded run: it ends when no run is left, or every one left waits for a signal."""
        done = subprocess.run(
            self.args(), capture_output=True, text=True, env=self.env, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return done.stderr

    def send(self, value: int) -> None:
        self.cli("signal", "--state", str(self.state), "--key", "k", "go", "--value", str(value))

    def status(self) -> dict[str, Any]:
        return dict(self.cli("status", "--state", str(self.state), "--json"))

    def waiting(self) -> list[str]:
        if not (self.state / "ratchet.db").exists():
            return []  # the job has not created its state yet
        return [w["on"] for w in self.status()["waiting"]]

    def got(self) -> list[Any]:
        """The values each attempt's wait returned, in order."""
        return [r["value"] for r in self.lines(self.log) if r["what"] == "got"]


def test_one_signal_is_enough_for_an_action_that_failed_after_taking_it(tmp_path: Path) -> None:
    job = Job(tmp_path)
    proc = subprocess.Popen(
        job.args("--follow"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=job.env,
    )  # fmt: skip
    try:
        until("the run waiting", lambda: job.waiting() == ["signal go"], proc)
        job.send(7)
        until("the output", job.outputs, proc)
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=60)
    assert "trying again" in err, err  # the first attempt failed and was retried
    assert job.outputs() == [{"key": "k", "got": 7}]
    assert job.got() == [7, 7]  # each attempt got the one signal sent
    status = job.status()
    assert status["waiting"] == [] and status["pending_signals"] == [], status


def test_the_signal_a_failed_attempt_took_goes_back_in_its_place(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.run()  # the run waits for "go": a bounded job leaves it parked and ends
    assert job.waiting() == ["signal go"]
    job.send(1)
    job.send(2)
    (first, second) = job.status()["pending_signals"]
    err = job.run()
    assert "trying again" in err, err
    assert job.got() == [1, 1], job.got()  # the retried attempt took 1 again, not 2
    assert job.outputs() == [{"key": "k", "got": 1}]
    status = job.status()
    assert status["waiting"] == [] and status["pending_signals"] == [second], status
    assert first["id"] < second["id"]
