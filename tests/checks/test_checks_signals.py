"""Issue 17, case 8: real signals to a real `python -m ratchet.checks run`.

SIGTERM and SIGHUP stop a run as Ctrl-C does (stage groups killed, receipt `interrupted`);
a SIGKILLed run's stage dies with it (parent-death signal), and what the stage started in
its process group is recorded so `recover` can see it and stop it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from checks_helpers import Workspace, by_id, check

from ratchet.checks import runner
from ratchet.cli import main as ratchet_main


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _state(pid: int) -> str | None:
    """A process's state letter, or None once it is gone (a zombie is 'Z')."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return None


def _dead(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")


def _group_members(pgid: int) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                alive.append(int(entry.name))
    return alive


def _slow_stage(ws: Workspace) -> str:
    """A stage that starts a helper in its own process group, records both pids, and
    waits until the test removes the block file."""
    block = ws.control / "block"
    block.touch()
    helper = (
        f"import pathlib, time\nwhile pathlib.Path({str(block)!r}).exists(): time.sleep(0.05)\n"
    )
    return (
        "import os, pathlib, subprocess, sys, time\n"
        f"h = subprocess.Popen([sys.executable, '-c', {helper!r}])\n"
        f"pathlib.Path({str(ws.control / 'pids')!r}).write_text(f'{{os.getpid()}} {{h.pid}}')\n"
        f"while pathlib.Path({str(block)!r}).exists():\n"
        "    time.sleep(0.05)\n"
    )


def _end(ws: Workspace, proc: subprocess.Popen[bytes]) -> None:
    """Unblock the slow stage, and make sure the run's process is gone."""
    (ws.control / "block").unlink(missing_ok=True)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _start(ws: Workspace) -> tuple[subprocess.Popen[bytes], Path, int, int]:
    ws.project([check("quick", repos=["app"]), check("slow", _slow_stage(ws), after=["quick"])])
    proc = subprocess.Popen(
        [sys.executable, "-m", "ratchet.checks", "run", "--workspace-root", str(ws.root)]
        + ["--state-dir", str(ws.state_dir), "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    pids = ws.control / "pids"
    _wait_for(lambda: pids.exists() and " " in pids.read_text(), "the slow stage to start")
    (run_dir,) = (ws.state_dir / "runs").iterdir()
    receipt = run_dir / "receipt.json"
    _wait_for(
        lambda: (
            by_id(runner.read_receipt(ws.root, ws.state_dir, run_dir.name))["slow"].get("pgid")
            is not None
        ),
        "the pgid",
    )
    stage_pid, helper_pid = (int(p) for p in pids.read_text().split())
    return proc, receipt, stage_pid, helper_pid


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_interrupt_the_run_and_kill_the_stage_group(
    two_repos: Workspace, sig: signal.Signals
) -> None:
    ws = two_repos
    proc, receipt_path, stage_pid, helper_pid = _start(ws)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        _end(ws, proc)
    assert proc.returncode == 128 + sig  # the old runner: killed, receipt left "running"
    assert f"interrupted by {sig.name}".encode() in err
    assert b"Traceback" not in err
    receipt = runner.read_receipt(ws.root, ws.state_dir, receipt_path.parent.name)
    assert receipt["status"] == "interrupted"
    slow = by_id(receipt)["slow"]
    assert slow["status"] == "failed"
    assert slow["checkpoint_verified"] is False
    assert slow["pgid"] == stage_pid
    assert by_id(receipt)["quick"]["checkpoint_verified"] is True
    _wait_for(lambda: _group_members(stage_pid) == [], "the stage's process group to go")
    assert _dead(helper_pid)


@pytest.mark.kill
def test_a_sigkilled_run_loses_its_stage_and_recover_stops_what_it_left(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    proc, receipt_path, stage_pid, helper_pid = _start(ws)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        # The parent-death signal takes the stage command down with ratchet ...
        _wait_for(lambda: _dead(stage_pid), "the stage to die with its parent")
        # ... but what it started lives on in its process group, which the receipt names.
        assert not _dead(helper_pid)
        run_id = receipt_path.parent.name
        common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
        apply = [*common, "recover", run_id, "--apply", "--confirm-processes-stopped", "--json"]
        assert ratchet_main(apply) == 1
        refused = json.loads(capsys.readouterr().out)
        assert refused["action"] == "refused"
        assert refused["live_process_groups"] == [{"stage": "slow", "pgid": stage_pid}]
        assert f"slow (process group {stage_pid})" in refused["error"]
        assert ratchet_main([*apply, "--stop-stages"]) == 0
        assert json.loads(capsys.readouterr().out)["status"] == "interrupted"
        assert _dead(helper_pid)
        assert _group_members(stage_pid) == []
    finally:
        (ws.control / "block").unlink(missing_ok=True)
    resumed = ws.run(resume=run_id)
    assert resumed["status"] == "passed"
    assert by_id(resumed)["quick"]["reused_from"] == run_id


def test_recover_stops_nothing_of_a_run_that_is_still_alive(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    """`recover --stop-stages` on a run whose ratchet process lives: refused before any
    group is killed (it used to kill the live run's stage, then refuse); the run ends well."""
    ws = two_repos
    proc, receipt_path, stage_pid, helper_pid = _start(ws)
    try:
        run_id = receipt_path.parent.name
        common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
        apply = [*common, "recover", run_id, "--apply", "--json", "--stop-stages"]
        for extra in ([], ["--confirm-processes-stopped"]):
            assert ratchet_main([*apply, *extra]) == 1
            refused = json.loads(capsys.readouterr().out)
            assert refused["action"] == "refused"
            assert not _dead(stage_pid) and not _dead(helper_pid)
        assert f"pid {proc.pid}) is still alive" in refused["error"]
        assert _group_members(stage_pid) != []
        (ws.control / "block").unlink()
        _, err = proc.communicate(timeout=60)
    finally:
        _end(ws, proc)
    assert proc.returncode == 0, err.decode()[-2000:]
    receipt = runner.read_receipt(ws.root, ws.state_dir, run_id)
    assert receipt["status"] == "passed"
    assert by_id(receipt)["slow"]["status"] == "passed"
