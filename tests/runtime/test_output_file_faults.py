"""The JSON Lines output file in the ordinary life of a job: a disk that fills and frees again
while the job runs, and a file moved away or deleted under a running job (log rotation).

A write that failed part way left whole lines and part of one in the file; the release's retry
then wrote the whole batch again after it: hundreds of ids twice and a broken line, in a run
that exited 0 (found with a small tmpfs filled and grown again). Here the disk limit is the
process's file size limit (RLIMIT_FSIZE, which Python's SIGXFSZ handling turns into failed
writes), lifted with `prlimit` while the job runs.

A moved or deleted output file was written on unseen (the open descriptor): every later output
was lost, exit 0, nothing said. The sink now follows the path to a new file, and says so.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

RATCHET = [sys.executable, "-m", "ratchet.cli"]
AGENT_SRC = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Pad(Agent):
    @action(InputEvent, inline=True)
    def pad(self, event, ctx):
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(OutputEvent(output={"i": event.input["i"], "n": n, "pad": event.input["pad"]}))
"""
KEYS = 20
BOUND = 120.0


def inputs(lo: int, hi: int, pad: int = 200) -> str:
    return "".join(
        json.dumps({"key": f"k{i % KEYS}", "i": i, "pad": "x" * pad}) + "\n" for i in range(lo, hi)
    )


def lines_of(*paths: Path) -> list[dict[str, Any]]:
    """Every line of the files, each of which must be whole JSON."""
    out = []
    for p in paths:
        for n, line in enumerate(p.read_text().splitlines(), 1):
            try:
                out.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"{p}:{n} is not a whole JSON line: {line[:120]!r}") from None
    return out


def assert_each_once(outputs: list[dict[str, Any]], n: int) -> None:
    twice = [i for i, c in Counter(o["id"] for o in outputs).items() if c > 1]
    assert not twice, f"{len(twice)} id(s) written twice, e.g. {twice[:3]}"
    assert sorted(o["output"]["i"] for o in outputs) == list(range(n))
    for key in {o["output"]["i"] % KEYS for o in outputs}:
        counts = sorted(o["output"]["n"] for o in outputs if o["output"]["i"] % KEYS == key)
        assert counts == list(range(1, len(counts) + 1)), key


def wait_for(proc: subprocess.Popen[bytes], log: Path, text: str) -> None:
    deadline = time.monotonic() + BOUND
    while text not in log.read_text():
        assert proc.poll() is None, f"the job ended ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} in:\n{log.read_text()[-3000:]}"
        time.sleep(0.02)


@pytest.mark.slow  # 22 MB of output through a real job
def test_a_disk_that_fills_and_frees_mid_run_leaves_every_output_once_and_whole(
    tmp_path: Path,
) -> None:
    # About 22 MB of output lines against an 8 MB limit on every file the job writes: the
    # state's files stay under it (its write-ahead log, which also holds each checkpoint's
    # outputs until they are released, is copied into the database at 4 MiB), so the output
    # file reaches it first.
    n = 20_000
    (tmp_path / "agent.py").write_text(AGENT_SRC)
    (tmp_path / "in.jsonl").write_text(inputs(0, n, pad=1000))
    limit = 8_000_000

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    log = tmp_path / "job.log"
    out = tmp_path / "out.jsonl"
    argv = [*RATCHET, "run", f"{tmp_path / 'agent.py'}:Pad", "--input", str(tmp_path / "in.jsonl"),
            "--output", str(out), "--state", str(tmp_path / "state"),
            "--checkpoint-interval", "20"]  # fmt: skip
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=fh, preexec_fn=limited)
    try:
        wait_for(proc, log, "sink write failed")  # the output reached the limit
        size = out.stat().st_size
        assert size <= limit, size
        time.sleep(0.3)  # more releases fail meanwhile, each retried
        inf = resource.RLIM_INFINITY
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (inf, inf))  # space again
        code = proc.wait(timeout=BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert_each_once(lines_of(out), n)


@pytest.mark.parametrize("how", ["moved", "deleted"])
def test_an_output_file_rotated_under_a_running_job_is_followed_by_a_new_one(
    tmp_path: Path, how: str
) -> None:
    (tmp_path / "agent.py").write_text(AGENT_SRC)
    src = tmp_path / "in.jsonl"
    src.write_text(inputs(0, 50))
    log = tmp_path / "job.log"
    out = tmp_path / "out.jsonl"
    argv = [*RATCHET, "run", f"{tmp_path / 'agent.py'}:Pad", "--input", str(src), "--output",
            str(out), "--state", str(tmp_path / "state"), "--follow"]  # fmt: skip
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=fh)
    try:
        deadline = time.monotonic() + BOUND
        while not out.exists() or len(out.read_text().splitlines()) < 50:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        rotated = tmp_path / "out.jsonl.1"
        if how == "moved":
            out.rename(rotated)
        else:
            out.unlink()
        with src.open("a") as fh:
            fh.write(inputs(50, 120))
        deadline = time.monotonic() + BOUND
        while not out.exists() or len(out.read_text().splitlines()) < 70:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no new output file:\n{log.read_text()}"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 0, text
    kind = "deleted or moved away"
    assert f"--output {out} was {kind} while the job ran; writing on in a new file there" in text
    later = lines_of(out)
    assert sorted(o["output"]["i"] for o in later) == list(range(50, 120))
    if how == "moved":
        assert_each_once(lines_of(rotated) + later, 120)
    # The next run reads the new file as its own: nothing written twice.
    again = subprocess.run([a for a in argv if a != "--follow"], capture_output=True, timeout=BOUND)
    assert again.returncode == 0, again.stderr
    assert sorted(o["output"]["i"] for o in lines_of(out)) == list(range(50, 120))
    assert os.path.getsize(out) > 0
