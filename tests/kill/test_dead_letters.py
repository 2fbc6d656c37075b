"""Dead letters, redrive and exit codes, with real `ratchet` processes (docs/runtime.md,
"Dead letters"): a poison input is dead-lettered, the agent fixed, the input redriven exactly
once across a SIGKILL; bad lines kept with their position; --max-errors; exit 4; REST redrive."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.kill

AGENT = f"{Path(__file__).with_name('deadletter_agent.py')}:Payments"
RATCHET = [sys.executable, "-m", "ratchet.cli"]


class Job:
    def __init__(self, tmp: Path) -> None:
        self.input, self.output, self.state = tmp / "in.jsonl", tmp / "out.jsonl", tmp / "state"
        self.flag, self.charges = tmp / "fixed", tmp / "charges.txt"
        self.env = dict(os.environ, FIXED_FLAG=str(self.flag), CHARGES=str(self.charges))

    def write(self, *lines: str) -> None:
        with self.input.open("a") as fh:
            fh.write("".join(line + "\n" for line in lines))

    def start(self, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*RATCHET, "run", AGENT, "--input", str(self.input), "--output", str(self.output),
             "--state", str(self.state), "--checkpoint-interval", "20", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
        )  # fmt: skip

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*RATCHET, *args], capture_output=True, text=True, env=self.env, timeout=60
        )

    def outputs(self) -> list[dict[str, Any]]:
        if not self.output.exists():
            return []
        return [json.loads(x) for x in self.output.read_text().splitlines() if x.endswith("}")]

    def letters(self) -> list[dict[str, Any]]:
        done = self.cli("dead-letters", "--state", str(self.state), "--json")
        assert done.returncode == 0, done.stderr
        return list(json.loads(done.stdout))

    def charged(self) -> list[int]:
        return [int(x) for x in self.charges.read_text().split()] if self.charges.exists() else []


def rows(n: int, poison: set[int]) -> list[str]:
    return [
        json.dumps({"key": f"k{i % 5}", "n": i, **({"poison": True} if i in poison else {})})
        for i in range(n)
    ]


def test_a_poison_input_is_dead_lettered_then_redriven_once_across_a_kill(tmp_path: Path) -> None:
    seed = 1202
    rng = random.Random(seed)
    job = Job(tmp_path)
    job.write(*rows(60, poison={17}))
    first = job.start("--json")
    out, err = first.communicate(timeout=120)
    assert first.returncode == 4, err
    assert "1 run(s) ended in error" in err and "ratchet dead-letters" in err
    summary = json.loads(out)
    assert summary["runs_failed"] == 1 and summary["dead_letters"] == 1
    (letter,) = job.letters()
    assert letter["kind"] == "failed-run" and letter["key"] == "k2" and letter["seq"] == 17
    assert "cannot pay 17" in letter["reason"]
    assert letter["detail"]["trace"] == ["r>pay"]
    assert letter["detail"]["errors"][0]["type"] == "builtins.ValueError"
    assert sorted(job.charged()) == [i for i in range(60) if i != 17]

    job.flag.touch()  # the fix is deployed
    # An id past SQLite's integers is a usage error (it was an OverflowError traceback).
    huge = job.cli("redrive", "--state", str(job.state), "--id", str(2**64))
    assert huge.returncode == 2 and "is not a dead letter id (0 to 2**63 - 1)" in huge.stderr
    assert "Traceback" not in huge.stderr, huge.stderr
    done = job.cli("redrive", "--state", str(job.state), "--id", str(letter["id"]))
    assert done.returncode == 0 and "1 dead letter(s) marked" in done.stdout, done.stderr
    # Kill the job at a seeded moment around the redrive's admission, then finish.
    proc = job.start("--follow")
    time.sleep(rng.uniform(0.0, 0.6))
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    finish = job.start()
    _, err = finish.communicate(timeout=120)
    assert finish.returncode == 0, f"seed {seed}: {err}"
    redone = [o for o in job.outputs() if o["output"] == {"paid": 17}]
    assert len(redone) == 1, f"seed {seed}: {redone}"
    # A durable call: repeated only if the kill fell between its return and its record.
    assert job.charged().count(17) >= 1, f"seed {seed}"
    (letter,) = job.letters()
    assert letter["redriven_as"] == redone[0]["seq"]
    again = job.cli("redrive", "--state", str(job.state), "--all", "--json")
    assert json.loads(again.stdout)["marked"] == 0  # redriven once, never again


def test_bad_lines_are_kept_with_their_position_and_the_stream_goes_on(tmp_path: Path) -> None:
    job = Job(tmp_path)
    good = rows(4, poison=set())
    job.write(good[0], "{not json", good[1], '{"n": 9}', good[2], good[3])
    proc = job.start("--on-bad-input", "dead-letter", "--json")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert json.loads(out)["dead_letters"] == 2
    assert sorted(o["output"]["paid"] for o in job.outputs()) == [0, 1, 2, 3]
    letters = job.letters()
    assert [d["kind"] for d in letters] == ["bad-input", "bad-input"]
    assert "in.jsonl:2: invalid JSON" in letters[0]["reason"]
    assert "missing key field 'key'" in letters[1]["reason"]
    assert letters[0]["detail"]["line"] == 2
    listed = job.cli("dead-letters", "--state", str(job.state))
    assert listed.returncode == 0 and "bad-input" in listed.stdout


def test_max_errors_stops_a_stream_and_allow_errors_exits_0(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.write(*rows(30, poison={3, 6, 9, 12}))
    proc = job.start("--follow", "--max-errors", "2", "--json")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err
    summary = json.loads(out)
    assert summary["stopped_by"] == "more than 2 run(s) ended in error"
    # Runs already in flight when the third failure stopped the job may fail too, and count.
    failed = summary["runs_failed"]
    assert failed >= 3
    status = json.loads(job.cli("status", "--state", str(job.state), "--json").stdout)
    assert status["runs_failed"] == failed and status["dead_letters"] == failed
    proc = job.start("--allow-errors")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert len(job.letters()) == 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_redrive_through_rest_on_a_supervised_job(tmp_path: Path) -> None:
    pytest.importorskip("fastapi", reason="the REST API needs ratchet[server] (fastapi, uvicorn)")
    job = Job(tmp_path)
    job.write(*rows(10, poison={4}))
    port = free_port()
    sup = job.start("--follow", "--supervise", "--rest-port", str(port), "--allow-errors")
    try:
        deadline = time.monotonic() + 60
        while len(job.letters() if (job.state / "ratchet.db").exists() else []) < 1:
            assert time.monotonic() < deadline and sup.poll() is None
            time.sleep(0.05)
        job.flag.touch()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request(
            "POST", "/v1/dead-letters/redrive", body=json.dumps({"key": "k4"}),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        resp = conn.getresponse()
        body = json.loads(resp.read())
        conn.close()
        assert resp.status == 202 and body["marked"] == 1, body
        while not any(o["output"] == {"paid": 4} for o in job.outputs()):
            assert time.monotonic() < deadline and sup.poll() is None
            time.sleep(0.05)
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.communicate(timeout=60)
    assert job.charged().count(4) == 1
