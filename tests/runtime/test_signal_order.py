"""Signals of one key and name are delivered in the order they were sent (by id), also when
some of them were put back (docs/runtime.md, "Durable time and signals", "Dead letters"):
real `ratchet run`, `ratchet signal` and `ratchet redrive` processes on a real state dir.

- A redrive admitted while the job runs puts back the signal its failed run had taken. A
  later signal of the same key and name, sent before that look, goes after it: the run of
  the key already waiting takes the put-back (older) one first, then the later one.
- `ratchet runs restart`: the restarted run takes the signal it had taken first, and one
  sent after that goes to its next wait (this held before the redrive fix too: the job reads
  the put-back signal at its start, in id order, before any run waits; kept as the guard of
  that path, with one worker and two).
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from support.waits_job import WaitsJob, until


class Job(WaitsJob):
    """A TwoSignals job (waits for "go" twice, outputs both values in the order it got them)."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, "TwoSignals")

    def send(self, value: int) -> None:
        self.cli("signal", "--state", str(self.state), "--key", "k", "go", "--value", str(value))

    def status(self) -> dict[str, Any]:
        return dict(self.cli("status", "--state", str(self.state), "--json"))

    def waiting(self) -> list[tuple[int, str]]:
        if not (self.state / "ratchet.db").exists():
            return []  # the job has not created its state yet
        return [(w["seq"], w["on"]) for w in self.status()["waiting"]]

    def got(self) -> dict[int, Any]:
        """Each run's values by its input seq (a failed run's error record has none)."""
        rows = self.lines(self.output)
        return {r["seq"]: r["output"]["got"] for r in rows if r["output"] is not None}


def stopped_between_writes(proc: subprocess.Popen[str], db: Path) -> None:
    """SIGSTOP the job at a moment it holds no write lock on `db` (stopped, it cannot take
    one), so other processes write to the state while it does nothing at all."""
    while True:
        proc.send_signal(signal.SIGSTOP)
        conn = sqlite3.connect(db, timeout=0, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:  # stopped inside a write: let it finish it
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.01)
        finally:
            conn.close()


def test_a_signal_put_back_by_a_redrive_goes_before_a_later_one_sent_in_the_same_look(
    tmp_path: Path,
) -> None:
    """Input 0 of k takes "go" 1 and fails (its dead letter keeps the signal); input 1 of k
    then waits for "go". With the job stopped, "go" 2 is sent and the dead letter's redrive
    asked for; the job's next look reads both. The waiting run must get 1 (put back, sent
    first), then 2; the redriven run the two sent after. Before the fix the later signal,
    read first, went to the waiting run at once, and the put-back one after it: [2, 1]."""
    job = Job(tmp_path)
    job.write({"key": "k", "break": 1}, {"key": "k"})  # fails after taking 1
    proc = job.start("--follow")
    try:
        until("input 0 waiting", lambda: job.waiting() == [(0, "signal go")], proc)
        job.send(1)
        until("input 1 waiting", lambda: job.waiting() == [(1, "signal go")], proc)
        (letter,) = job.cli("dead-letters", "--state", str(job.state), "--json")
        assert [g["value"] for g in letter["detail"]["signals"]] == [1], letter
        stopped_between_writes(proc, job.state / "ratchet.db")
        try:
            job.send(2)
            job.cli("redrive", "--state", str(job.state), "--key", "k")
        finally:
            proc.send_signal(signal.SIGCONT)
        until("input 1's run done", lambda: 1 in job.got(), proc)
        job.send(3)
        job.send(4)
        until("the redriven run done", lambda: len(job.got()) == 2, proc)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    got = job.got()
    assert got[1] == [1, 2], got  # in the order sent
    (redriven,) = [seq for seq in got if seq != 1]
    assert got[redriven] == [3, 4], got
    status = job.status()
    assert status["waiting"] == [] and status["pending_signals"] == [], status
    (letter,) = job.cli("dead-letters", "--state", str(job.state), "--json")
    assert [g["value"] for g in letter["detail"]["signals_put_back"]] == [1], letter


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_restarted_run_takes_its_signal_first_and_a_later_one_at_its_next_wait(
    tmp_path: Path, workers: str
) -> None:
    """k's run takes "go" 1 and waits for its second "go"; the job stops (a bounded job leaves
    it parked), "go" 2 is sent, and `ratchet runs restart` puts 1 back. The restarted run
    takes 1, then 2, at its two waits."""
    job = Job(tmp_path)
    job.write({"key": "k"})
    sharded = ("--workers", workers)

    def bounded() -> None:
        proc = job.start(*sharded)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err

    bounded()  # parked at its first wait
    job.send(1)
    bounded()  # took 1, parked at its second wait
    assert [w["on"] for w in job.status()["waiting"]] == ["signal go"]
    job.send(2)
    restarted = job.cli("runs", "restart", "--state", str(job.state), "--key", "k", "--json")
    assert restarted["signals_put_back"] == 1, restarted
    assert [p["id"] for p in job.status()["pending_signals"]] == [1, 2]
    bounded()
    assert job.got() == {0: [1, 2]}
    assert job.status()["pending_signals"] == []
