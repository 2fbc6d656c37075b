"""Contract 9 with a real crash: SIGKILL a running `python -m ratchet.checks`, recover, resume."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checks_helpers import Workspace, by_id, check

from ratchet.checks import ResumeRefusedError, runner
from ratchet.checks.common import read_json
from ratchet.cli import main as ratchet_main


def _wait_for(predicate: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.kill
def test_contract_9_sigkill_mid_run_then_recover_then_resume(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    block, pid_file = ws.control / "block", ws.control / "slow.pid"
    block.touch()
    slow = (
        "import os, pathlib, time\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
        f"while pathlib.Path({str(block)!r}).exists():\n"
        "    time.sleep(0.02)\n"
        "print('slow done')\n"
    )
    ws.project(
        [
            check("quick", "print('quick')", repos=["app"]),
            check("slow", slow, repos=["lib"], after=["quick"]),
            check("last", repos=["lib"], deps=["slow"]),
        ]
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "ratchet.checks", "run", "--workspace-root", str(ws.root)]
        + ["--state-dir", str(ws.state_dir), "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(pid_file.exists, "the slow stage to start")
        (run_dir,) = (ws.state_dir / "runs").iterdir()
        receipt_path = run_dir / "receipt.json"
        _wait_for(
            lambda: (
                by_id(runner.read_receipt(ws.root, ws.state_dir, run_dir.name))["slow"]["status"]
                == "running"
            ),
            "the receipt to record the slow stage running",
        )
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # The stage ran in its own session; its parent-death signal ends it with ratchet, and
    # the user makes sure before confirming recovery (it may already be gone).
    _wait_for(lambda: pid_file.read_text().strip() != "", "the stage pid")
    stage_pid = int(pid_file.read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(stage_pid, signal.SIGKILL)
    # Gone, not only signalled: until init reaps it (slow on a loaded machine) its process
    # group still exists, and `recover` rightly refuses while a stage's group is alive.
    _wait_for(lambda: not _group_alive(stage_pid), "the killed stage's process group to end")
    run_id = run_dir.name

    # receipt.json still holds the run's start; the journal beside it, folded, the rest.
    assert read_json(receipt_path)["status"] == "running"
    crashed = runner.read_receipt(ws.root, ws.state_dir, run_id)
    assert crashed["status"] == "running"
    assert by_id(crashed)["quick"]["checkpoint_verified"] is True
    assert by_id(crashed)["slow"]["status"] == "running"
    with pytest.raises(ResumeRefusedError, match="recover"):
        ws.run(resume=run_id)

    common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
    before = receipt_path.read_bytes()
    assert ratchet_main([*common, "recover", run_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["action"] == "would-recover"
    assert ratchet_main([*common, "recover", run_id, "--apply", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["action"] == "refused"
    assert receipt_path.read_bytes() == before
    assert (
        ratchet_main(
            [*common, "recover", run_id, "--apply", "--confirm-processes-stopped", "--json"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["status"] == "interrupted"
    recovered = runner.read_receipt(ws.root, ws.state_dir, run_id)
    assert recovered["status"] == "interrupted"
    assert by_id(recovered)["slow"]["status"] == "failed"
    assert by_id(recovered)["last"]["status"] == "skipped"

    block.unlink()
    resumed = ws.run(resume=run_id)
    recs = by_id(resumed)
    assert resumed["status"] == "passed"
    assert recs["quick"]["reused_from"] == run_id
    assert "reused_from" not in recs["slow"]
    assert "reused_from" not in recs["last"]
    assert Path(recs["slow"]["log_path"]).read_text() == "slow done\n"
    assert Path(recs["quick"]["log_path"]).read_text() == "quick\n"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.kill
def test_recover_with_a_live_stage_group_names_stop_stages_and_prints_no_raw_json(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    pid_file = ws.control / "sleeper.pid"
    # The stage dies with ratchet (parent-death signal); the child it started does not, so
    # the stage's process group outlives the run, as `sh -c 'sleep 30 & wait'` does.
    slow = (
        "import pathlib, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid))\n"
        "child.wait()\n"
    )
    ws.project([check("slow", slow, repos=["lib"])])
    proc = subprocess.Popen(
        [sys.executable, "-m", "ratchet.checks", "run", "--workspace-root", str(ws.root)]
        + ["--state-dir", str(ws.state_dir), "--no-cache"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(lambda: pid_file.exists() and pid_file.read_text(), "the sleeper to start")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    sleeper = int(pid_file.read_text())
    try:
        (run_dir,) = (ws.state_dir / "runs").iterdir()
        common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
        assert ratchet_main([*common, "recover", run_dir.name]) == 0
        out = " ".join(capsys.readouterr().out.split())  # the table wraps long lines
        assert "--apply --confirm-processes-stopped --stop-stages" in out
        assert "stage process groups are still alive: slow (process group" in out
        argv = [*common, "recover", run_dir.name, "--apply", "--confirm-processes-stopped"]
        assert ratchet_main(argv) == 1
        captured = capsys.readouterr()
        assert captured.out == ""  # the refusal is on stderr; its JSON only with --json
        assert "or pass --stop-stages" in captured.err
        assert ratchet_main([*argv, "--stop-stages"]) == 0
        assert "marked interrupted" in capsys.readouterr().out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sleeper, signal.SIGKILL)
