"""Reading a state directory this user cannot write to (docs/api.md, "Safe while the job
runs"), with real `ratchet` processes:

- a cleanly stopped job's state (no `ratchet.db-wal` / `-shm`: SQLite would have to create
  them to read a WAL database) is refused by every reading command, by `ratchet signal` and
  by `ratchet.open_state`, in one line naming the directory and the fixes, exit 2; nothing
  is created there; a writable copy, as the line says, reads;
- a state whose job was SIGKILLed (both files left beside the database) reads as it is.

Tests run as root, who writes any file whatever its mode: the reading commands then run
under `setpriv` without CAP_DAC_OVERRIDE (and CAP_DAC_READ_SEARCH), so the modes apply to
them as to any other user.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

AGENT = f"{Path(__file__).parent.parent / 'kill' / 'waits_agent.py'}:Lingers"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
NO_OVERRIDE = "-dac_override,-dac_read_search"


def as_reader(argv: list[str]) -> list[str]:
    """`argv` run so that file modes apply to it (root: without the capabilities to bypass
    them)."""
    if os.geteuid() != 0:
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: file modes cannot apply to a command")
    return [setpriv, f"--bounding-set={NO_OVERRIDE}", f"--inh-caps={NO_OVERRIDE}", "--", *argv]


def read(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(as_reader([*RATCHET, *args]), capture_output=True, text=True, timeout=60)


def job(tmp: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*RATCHET, "run", AGENT, "--input", str(tmp / "in.jsonl"), "--output",
         str(tmp / "out.jsonl"), "--state", str(tmp / "state"), "--checkpoint-interval", "50",
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, WAITS_LOG=str(tmp / "log.jsonl")),
    )  # fmt: skip


@pytest.fixture
def read_only() -> Iterator[Callable[[Path], Path]]:
    """A function that makes a directory read-only (0555, its files 0444) for the readers,
    and gives the modes back at the end (so that the test's files can be removed)."""
    made: list[Path] = []

    def make(d: Path) -> Path:
        for f in d.iterdir():
            f.chmod(0o444)
        d.chmod(0o555)
        made.append(d)
        probe = subprocess.run(
            as_reader([sys.executable, "-c", f"open({str(d / 'probe')!r}, 'w')"]),
            capture_output=True, text=True,
        )  # fmt: skip
        if probe.returncode == 0:
            (d / "probe").unlink()
            pytest.skip(f"{d} stays writable for a child process here (setpriv had no effect)")
        return d

    yield make
    for d in made:
        d.chmod(0o755)
        for f in d.iterdir():
            f.chmod(0o644)


def test_a_stopped_state_in_a_directory_the_reader_cannot_write_is_one_clear_line(
    tmp_path: Path, read_only: Callable[[Path], Path]
) -> None:
    (tmp_path / "in.jsonl").write_text('{"key": "k"}\n')
    done = job(tmp_path)
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    state = tmp_path / "state"
    # Stopped cleanly: SQLite removed the WAL's files; reading would have to create them.
    before = sorted(p.name for p in state.iterdir())
    assert "ratchet.db-wal" not in before and "ratchet.db-shm" not in before, before
    read_only(state)
    db = state / "ratchet.db"
    for words in (["status"], ["inspect"], ["trace", "--key", "k"], ["runs", "list"],
                  ["dead-letters"]):  # fmt: skip
        refused = read(*words, "--state", str(state))
        assert refused.returncode == 2, (words, refused.stderr)
        assert refused.stdout == "" and "Traceback" not in refused.stderr, refused.stderr
        (line,) = refused.stderr.splitlines()
        assert line.startswith(f"ratchet: error: {db} cannot be opened: "), line
        assert "in WAL mode, and SQLite needs ratchet.db-wal and ratchet.db-shm" in line, line
        assert f"it cannot create because this process cannot write to {state};" in line, line
        assert "make that directory writable for this user" in line, line
        assert "read a writable copy: cp -r DIR COPY && chmod -R u+w COPY, then --state" in line
    # A command that writes (a signal) needs the directory writable anyway: the same line.
    sent = read("signal", "--state", str(state), "--key", "k", "go")
    assert sent.returncode == 2 and sent.stdout == "", sent
    (line,) = sent.stderr.splitlines()
    assert line.startswith(f"ratchet: error: {db} cannot be opened: "), line
    api = subprocess.run(
        as_reader([sys.executable, "-c",
                   f"import ratchet\ntry:\n ratchet.open_state({str(state)!r})\n"
                   f"except ratchet.StateError as e:\n print(e)"]),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert api.returncode == 0 and api.stdout.startswith(f"{db} cannot be opened: "), api
    assert sorted(p.name for p in state.iterdir()) == before  # nothing was created there
    # The fix the line gives: a writable copy reads.
    copy = tmp_path / "copy"
    shutil.copytree(state, copy)
    subprocess.run(["chmod", "-R", "u+w", str(copy)], check=True)
    status = read("status", "--state", str(copy), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["keys"] == 1, status.stdout


def test_a_killed_jobs_state_reads_from_a_directory_the_reader_cannot_write(
    tmp_path: Path, read_only: Callable[[Path], Path]
) -> None:
    """SIGKILL leaves `ratchet.db-wal` and `-shm` beside the database: SQLite reads a WAL
    database read-only through them (3.22+), so no refusal, and what was committed shows."""
    (tmp_path / "in.jsonl").write_text('{"key": "k"}\n')
    running = job(tmp_path, "--follow")
    out_file = tmp_path / "out.jsonl"
    deadline = time.monotonic() + 60
    while not (out_file.exists() and out_file.read_text().endswith("\n")):
        assert running.poll() is None, running.communicate()[1]
        assert time.monotonic() < deadline, "timed out waiting for the output"
        time.sleep(0.02)
    running.send_signal(signal.SIGKILL)
    running.communicate(timeout=30)
    state = tmp_path / "state"
    assert {"ratchet.db-wal", "ratchet.db-shm"} <= {p.name for p in state.iterdir()}
    read_only(state)
    status = read("status", "--state", str(state), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["keys"] == 1, status.stdout
