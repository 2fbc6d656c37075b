"""Issue 17: a stage waits (up to --lock-timeout) for a resource another process holds,
instead of failing at once."""

from __future__ import annotations

import subprocess
import sys
import time

from checks_helpers import Workspace, by_id, check

from ratchet.checks.common import state_root

_HOLDER = """
import pathlib, sys, time
from ratchet.checks.common import resource_lock
from ratchet.checks.runner import read_receipt
locks, runs, ready, mode = sys.argv[1:5]
deadline = time.monotonic() + 60
with resource_lock(locks, "db"):
    pathlib.Path(ready).touch()
    while time.monotonic() < deadline:
        if mode == "until-waited":
            for receipt in pathlib.Path(runs).glob("*/receipt.json"):
                try:  # receipt.json and its journal, folded
                    state = pathlib.Path(runs).parent
                    stages = read_receipt(state, state, receipt.parent.name)["stages"]
                except (OSError, ValueError, KeyError):
                    continue
                if any(s.get("waiting_for_resource") == "db" for s in stages):
                    sys.exit(0)  # the kernel releases the lock with the process
        elif not pathlib.Path(ready).exists():
            sys.exit(0)
        time.sleep(0.02)
"""


def _hold(ws: Workspace, mode: str) -> subprocess.Popen[bytes]:
    ready = ws.control / "holding"
    locks = state_root(ws.root) / "resource-locks"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(locks), str(ws.state_dir / "runs"), str(ready), mode]
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline, "the holder never took the lock"
        assert proc.poll() is None, "the holder died"
        time.sleep(0.02)
    return proc


def test_a_stage_waits_for_a_resource_another_process_holds(two_repos: Workspace) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"], resources=["db"])])
    holder = _hold(ws, "until-waited")
    try:
        result = ws.run()  # the old runner failed the stage: "resource 'db' is busy"
    finally:
        holder.wait(timeout=60)
    rec = by_id(result)["a"]
    assert result["status"] == "passed", rec["error"]
    assert rec["waiting_for_resource"] is None  # it waited, then got the lock
    assert holder.returncode == 0


def test_a_stage_gives_up_after_the_lock_timeout(two_repos: Workspace) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"], resources=["db"])])
    holder = _hold(ws, "until-told")
    try:
        result = ws.run(lock_timeout=0.2)
    finally:
        (ws.control / "holding").unlink()
        holder.wait(timeout=60)
    rec = by_id(result)["a"]
    assert result["status"] == "failed"
    assert "resource 'db' is busy (held by another process" in rec["error"]
    assert "gave up after waiting 0.2 s (raise it with --lock-timeout SECONDS)" in rec["error"]
