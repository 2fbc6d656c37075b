"""One job at a time writes an output file: a real `ratchet run` holds a lock on its JSONL
output while it runs, a second job into the same file is refused (exit 2, naming the process
that writes it) instead of writing beside it, and a SIGKILL of the first ends its hold."""

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

import ratchet
from ratchet import Agent, InputEvent, OutputEvent, action
from ratchet.runtime._io import IterableSource

pytestmark = pytest.mark.kill

AGENT = f"{Path(__file__).with_name('io_agent.py')}:Relay"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
N = 120


def command(inputs: Path, out: Path, state: Path, workers: int, *extra: str) -> list[str]:
    return [
        *RATCHET, "run", AGENT, "--input", str(inputs), "--output", str(out),
        "--state", str(state), "--workers", str(workers), "--checkpoint-interval", "0.05",
        *extra,
    ]  # fmt: skip


def lines(out: Path) -> list[dict[str, Any]]:
    """The whole lines of `out` (one being appended may be read half written)."""
    if not out.exists():
        return []
    text = out.read_text()
    return [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_second_job_is_refused_while_the_first_writes(tmp_path: Path, workers: int) -> None:
    inputs, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inputs.write_text(
        "".join(json.dumps({"key": f"k{i % 2}", "i": i, "sleep": 0.03}) + "\n" for i in range(N))
    )
    with open(tmp_path / "a.log", "ab") as err:
        # --follow: it ends only when killed, however slowly the second one starts.
        first = subprocess.Popen(
            command(inputs, out, tmp_path / "a", workers, "--follow"),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 60
        while not lines(out) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert first.poll() is None, "the first job ended"
        second = subprocess.run(
            command(inputs, out, tmp_path / "b", workers, "--append-output"),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert first.poll() is None, "the first job ended"
        assert second.returncode == 2, second.stderr
        assert "is being written by another running job" in second.stderr, second.stderr
        assert f"(process {first.pid})" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        assert {r["job"] for r in lines(out)} == {lines(out)[0]["job"]}, "the second wrote"
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    # The kill ended the first job's hold: it resumes into the same file (to the end of its
    # input, without --follow), then the second runs.
    for state, extra in (("a", ()), ("b", ("--append-output",))):
        done = subprocess.run(
            command(inputs, out, tmp_path / state, workers, *extra),
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    per_job: dict[str, list[int]] = {}
    for rec in lines(out):
        per_job.setdefault(rec["job"], []).append(rec["output"]["i"])
    assert len(per_job) == 2
    for job, got in per_job.items():
        assert sorted(got) == list(range(N)), f"job {job}: each input's output once"


def test_the_holder_is_found_by_inode_and_confirmed_by_its_open_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc/locks prints the file system's device; on btrfs `stat` gives another one (a
    subvolume's), and another file system's file can have the same inode number. The holder
    is the process whose open file is the same file."""
    from ratchet.runtime import _io

    held = tmp_path / "out.jsonl"
    with open(held, "ab") as mine, open(tmp_path / "other", "ab") as other_file:
        ino = os.fstat(mine.fileno()).st_ino
        other_ino = os.fstat(other_file.fileno()).st_ino
        locks = tmp_path / "locks"
        locks.write_text(
            f"1: FLOCK  ADVISORY  WRITE 1 00:99:{other_ino} 0 EOF\n"
            f"1: FLOCK  ADVISORY  WRITE 1 00:98:{ino} 0 EOF\n"  # same inode, another file system
            f"2: FLOCK  ADVISORY  WRITE {os.getpid()} 00:2f:{ino} 0 EOF\n"
            f"2: -> FLOCK  ADVISORY  WRITE 77 00:2f:{ino} 0 EOF\n"
        )
        monkeypatch.setattr(_io, "_PROC_LOCKS", str(locks))
        with open(held, "ab") as probe:
            assert _io._flock_holder(probe.fileno()) == os.getpid()


class _Echo(Agent):
    @action(InputEvent)
    def go(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output=event.input))


class _CloseFails(IterableSource):
    def close(self) -> None:
        raise RuntimeError("the source's close failed")


def test_the_hold_ends_with_the_job_in_process(tmp_path: Path) -> None:
    """In one process (the Python API): a job whose source fails to close, and a `Job` built
    and closed without running, leave the output file to the next job."""
    out = tmp_path / "out.jsonl"
    with pytest.raises(RuntimeError, match="close failed"):
        ratchet.run(
            _Echo(), inputs=_CloseFails([{"key": "a"}]), output=out, state_dir=tmp_path / "a"
        )
    job = ratchet.Job(_Echo(), inputs=[{"key": "b"}], output=out, state_dir=tmp_path / "b",
                      append_output=True)  # fmt: skip
    job.close()
    ratchet.run(_Echo(), inputs=[{"key": "b"}], output=out, state_dir=tmp_path / "b",
                append_output=True)  # fmt: skip
    assert sorted(r["key"] for r in lines(out)) == ["a", "b"]
