"""SIGKILL a real `ratchet run` around the connectors' edges, restart, check each claim:

- an output the JSONL sink cannot write is replaced by the same error record, exactly once,
  whether it was written before a kill or comes back from the outbox after one;
- a directory source over a log rotated by renaming, followed (`--follow`) and killed at
  random points, between files included, reads every line exactly once, in file order.
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

# The --workers 2 variants (about a minute on 2 busy cores) run under RATCHET_SHARDED_ALL=1 or
# RATCHET_SOAK=1; tests/kill/test_sharded.py covers the sharded engine in every `make test`.
SHARDED = pytest.mark.skipif(
    not (os.environ.get("RATCHET_SHARDED_ALL") or os.environ.get("RATCHET_SOAK")),
    reason="set RATCHET_SHARDED_ALL=1 to run the --workers 2 variants",
)

AGENT = f"{Path(__file__).with_name('io_agent.py')}:Relay"
RATCHET = [sys.executable, "-m", "ratchet.cli"]


def start(tmp: Path, inputs: Path, out: Path, state: Path, *extra: str) -> subprocess.Popen[bytes]:
    with open(tmp / "stderr.log", "ab") as err:
        return subprocess.Popen(
            [
                *RATCHET, "run", AGENT, "--input", str(inputs), "--output", str(out),
                "--state", str(state), "--checkpoint-interval", "20", *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )  # fmt: skip


def read(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(x) for x in out.read_text().splitlines() if x.endswith("}")]


def without_job(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(({k: v for k, v in r.items() if k != "job"} for r in recs), key=lambda r: r["id"])


@pytest.mark.parametrize(
    "workers", [1, pytest.param(2, marks=SHARDED)], ids=["1-worker", "2-workers"]
)
def test_unwritable_outputs_are_the_same_error_records_exactly_once_across_kills(
    tmp_path: Path, workers: int
) -> None:
    seed = 20260611
    rng = random.Random(seed)
    n = 400
    src = tmp_path / "in.jsonl"
    with src.open("w") as fh:
        for i in range(n):
            row = {"key": f"k{i % 6}", "i": i, "bad": i % 7 == 3, "sleep": 0.006}
            fh.write(json.dumps(row) + "\n")
    ref = tmp_path / "ref"
    ref.mkdir()
    proc = start(ref, src, ref / "o.jsonl", ref / "state")
    assert proc.wait(timeout=120) == 0, (ref / "stderr.log").read_text()
    expected = without_job(read(ref / "o.jsonl"))
    assert len(expected) == n and sum(r["output"] is None for r in expected) == len(
        [i for i in range(n) if i % 7 == 3]
    )

    out, state = tmp_path / "o.jsonl", tmp_path / "state"
    kills = 0
    for _ in range(100):
        proc = start(tmp_path, src, out, state, "--workers", str(workers))
        before = len(read(out))
        deadline = time.monotonic() + 60
        target = before + rng.randint(10, 40)
        while proc.poll() is None and len(read(out)) < target and time.monotonic() < deadline:
            time.sleep(0.005)
        if proc.poll() is None:
            time.sleep(rng.uniform(0, 0.03))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            continue
        assert proc.returncode == 0, f"seed {seed}: {(tmp_path / 'stderr.log').read_text()}"
        break
    else:
        raise AssertionError(f"seed {seed}: the job never finished")
    assert kills >= 5, f"seed {seed}: only {kills} kills"
    got = read(out)
    assert len({r["id"] for r in got}) == len(got), f"seed {seed}: an output was written twice"
    assert without_job(got) == expected, f"seed {seed}: outputs differ from a crash-free run"
    print(f"seed {seed}: {kills} SIGKILLs, {len(got)} outputs")


class Rotator:
    """Writes a log the way a rotating logger does: append to app.jsonl; rotate by renaming
    app.jsonl.k to app.jsonl.k+1, app.jsonl to app.jsonl.1, and starting a new app.jsonl."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.written = 0
        self.rotations = 0
        (logs / "app.jsonl").touch()

    def write(self, count: int) -> None:
        rows = "".join(
            json.dumps({"key": f"k{i % 4}", "i": i}) + "\n"
            for i in range(self.written, self.written + count)
        )
        with open(self.logs / "app.jsonl", "a") as fh:
            fh.write(rows)
        self.written += count

    def rotate(self) -> None:
        for k in range(self.rotations, 0, -1):
            os.rename(self.logs / f"app.jsonl.{k}", self.logs / f"app.jsonl.{k + 1}")
        os.rename(self.logs / "app.jsonl", self.logs / "app.jsonl.1")
        (self.logs / "app.jsonl").touch()
        self.rotations += 1


def wait_for(out: Path, count: int, proc: subprocess.Popen[bytes], tmp: Path) -> None:
    deadline = time.monotonic() + 60
    while len(read(out)) < count:
        assert proc.poll() is None, (tmp / "stderr.log").read_text()
        assert time.monotonic() < deadline, f"{len(read(out))} of {count} outputs"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("kill", "workers"),
    [(False, 1), (True, 1), pytest.param(True, 2, marks=SHARDED)],
    ids=["no-kills", "sigkills", "sigkills-2-workers"],
)
def test_a_followed_rotating_log_is_read_once_in_order(
    tmp_path: Path, kill: bool, workers: int
) -> None:
    seed = 77
    rng = random.Random(seed)
    logs = tmp_path / "logs"
    logs.mkdir()
    log = Rotator(logs)
    out, state = tmp_path / "o.jsonl", tmp_path / "state"
    proc = start(tmp_path, logs, out, state, "--follow", "--workers", str(workers))
    kills = 0
    for _ in range(8):
        log.write(rng.randint(5, 40))
        if rng.random() < 0.5:
            log.write(rng.randint(1, 5))
        log.rotate()  # sometimes before the reader reached the end of the old file
        log.write(rng.randint(0, 10))
        if kill:
            # Kill once the reader is somewhere in the last few files: mid-file, at the end
            # of one, or between two.
            wait_for(out, rng.randint(max(0, log.written - 40), log.written), proc, tmp_path)
            time.sleep(rng.uniform(0, 0.02))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            if rng.random() < 0.5:  # rotate while nobody reads, too
                log.write(rng.randint(1, 10))
                log.rotate()
            proc = start(tmp_path, logs, out, state, "--follow", "--workers", str(workers))
    log.write(7)
    wait_for(out, log.written, proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, (tmp_path / "stderr.log").read_text()
    got = read(out)
    assert len(got) == log.written and len({r["id"] for r in got}) == len(got), f"seed {seed}"
    # The engine numbers inputs in the order it read them: file order, line order.
    assert [r["output"]["i"] for r in sorted(got, key=lambda r: r["seq"])] == list(
        range(log.written)
    ), f"seed {seed}"
    assert log.rotations >= 8 and kills == (8 if kill else 0)
    print(f"seed {seed}: {log.written} lines, {log.rotations} rotations, {kills} SIGKILLs")


@pytest.mark.parametrize("workers", [1, 2], ids=["1-worker", "2-workers"])
def test_outputs_written_before_a_kill_are_not_counted_again_after_it(
    tmp_path: Path, workers: int
) -> None:
    """A job SIGKILLed after its sink wrote a checkpoint's outputs but before the next
    checkpoint dropped them from the outbox restores them as unreleased; the sink skips the
    ids its file holds, and the summary (and /metrics' ratchet_outputs_total, made from the
    same count) counted them again: 20 lines in the file, 20 + the re-released counted."""
    n = 20
    src, out, state = tmp_path / "in.jsonl", tmp_path / "o.jsonl", tmp_path / "state"
    src.write_text("".join(json.dumps({"key": f"k{i % 4}", "i": i}) + "\n" for i in range(n)))
    # A long interval: the outputs are written after one checkpoint and stay in the outbox
    # until the next, 4 s later; the kill falls in between.
    proc = start(tmp_path, src, out, state, "--follow", "--workers", str(workers),
                 "--checkpoint-interval", "4000")  # fmt: skip
    deadline = time.monotonic() + 60
    while proc.poll() is None and not read(out) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, (tmp_path / "stderr.log").read_text()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written_before = len(read(out))
    kept = subprocess.run(
        [*RATCHET, "status", "--state", str(state), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # The case this test is about: outputs in the file whose outbox rows were restored.
    assert 0 < written_before <= json.loads(kept.stdout)["unreleased_outputs"], kept.stdout
    again = subprocess.run(
        [*RATCHET, "run", AGENT, "--input", str(src), "--output", str(out), "--state",
         str(state), "--workers", str(workers), "--checkpoint-interval", "20", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    got = read(out)
    assert len(got) == n and len({r["id"] for r in got}) == n
    counted = json.loads(again.stdout)["outputs"]
    assert counted == n - written_before, (counted, written_before)
    assert written_before + counted == len(got)
