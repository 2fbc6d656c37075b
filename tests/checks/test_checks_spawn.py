"""`ratchet.checks._spawn`: the `git ls-files` runner that does without `subprocess`."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from checks_helpers import Workspace

from ratchet.checks import checkpoints
from ratchet.checks._spawn import Child, output_of


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_output_of_returns_the_exit_code_and_stdout_only() -> None:
    code = "import sys; sys.stdout.write('out' * 30000); sys.stderr.write('err'); sys.exit(3)"
    before = _open_fds()
    returncode, stdout = output_of([sys.executable, "-c", code])
    assert returncode == 3
    assert stdout == b"out" * 30000  # more than a pipe holds: read while it runs
    assert _open_fds() == before


def test_the_child_reads_nothing_and_gets_sigpipe_at_its_default() -> None:
    assert output_of(["cat"]) == (0, b"")  # stdin is /dev/null, not ours
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN  # Python ignores it...
    returncode, status = output_of(["grep", "SigIgn", "/proc/self/status"])
    ignored = int(status.split()[1], 16)
    assert returncode == 0
    assert not ignored & (1 << (signal.SIGPIPE - 1))  # ...its child does not


def test_a_missing_program_raises_and_leaks_no_descriptor() -> None:
    before = _open_fds()
    with pytest.raises(FileNotFoundError):
        output_of(["ratchet-no-such-program-17"])
    assert _open_fds() == before


def test_stop_kills_and_reaps_a_child_still_running() -> None:
    child = Child([sys.executable, "-c", "import time; time.sleep(60)"])
    child.stop()
    assert child.returncode == -signal.SIGKILL
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)  # reaped: no zombie left
    child.stop()  # twice is harmless


def test_stop_after_output_changes_nothing() -> None:
    child = Child([sys.executable, "-c", "print('done')"])
    assert child.output() == (0, b"done\n")
    child.stop()
    assert child.returncode == 0


def test_a_listing_that_cannot_start_stops_those_already_started(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Child] = []

    def start(root: Path) -> Child:
        if started:
            raise OSError("no more processes")
        child = Child([sys.executable, "-c", "import time; time.sleep(60)"])
        started.append(child)
        return child

    monkeypatch.setattr(checkpoints, "_start_listing", start)
    ws = two_repos
    prober = checkpoints.Checkpoints(
        ws.root, {"app": ws.root / "app", "lib": ws.root / "lib"}, ws.state_dir
    )
    with pytest.raises(OSError, match="no more processes"):
        prober.source_identity()
    assert [c.returncode for c in started] == [-signal.SIGKILL]  # killed and reaped
