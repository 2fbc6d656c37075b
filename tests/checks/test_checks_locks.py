"""Issue 17: a stage waits (up to --lock-timeout) for a resource another process holds,
instead of failing at once; and resource locks hold across clones of one workspace."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from checks_helpers import Workspace, by_id, check

from ratchet._errors import InvalidArgumentError
from ratchet.checks.common import machine_lock_dir, resource_lock, scope_lock_dir, state_root
from ratchet.checks.runner import read_receipt
from ratchet.cli import main as ratchet_main

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
        holder.communicate(timeout=60)
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
        holder.communicate(timeout=60)
    rec = by_id(result)["a"]
    assert result["status"] == "failed"
    assert "resource 'db' is busy (held by another process" in rec["error"]
    assert "gave up after waiting 0.2 s (raise it with --lock-timeout SECONDS)" in rec["error"]


def test_lock_timeout_inf_waits_as_long_as_it_takes_and_nan_is_refused(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"], resources=["db"])])
    common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
    holder = _hold(ws, "until-waited")
    try:  # the old runner failed the stage with an OverflowError
        code = ratchet_main([*common, "run", "--no-cache", "--lock-timeout", "inf", "--json"])
    finally:
        holder.communicate(timeout=60)
    result = json.loads(capsys.readouterr().out)
    assert code == 0, by_id(result)["a"]["error"]
    assert by_id(result)["a"]["waiting_for_resource"] is None  # it waited, then got it

    assert ratchet_main([*common, "run", "--no-cache", "--lock-timeout", "nan"]) == 2
    err = capsys.readouterr().err
    assert "--lock-timeout must be a number of seconds >= 0" in err and "nan" in err
    assert len(list((ws.state_dir / "runs").iterdir())) == 1  # refused before it started


# --- across clones: the machine-wide lock of the project's resources -----------------------

# The stage both clones run: mark its start, wait while the test holds it, mark its end.
# The markers go to one file outside both clones (never an input).
_STAGE = """
import os, pathlib, sys, time
markers, control = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
clone = pathlib.Path.cwd().parent.name
with markers.open("a") as f:
    f.write(f"start {clone}\\n")
deadline = time.monotonic() + 60
while (control / f"hold-{clone}").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
with markers.open("a") as f:
    f.write(f"end {clone}\\n")
"""


def _clones(tmp_path: Path, markers: Path, control: Path) -> tuple[Path, Path]:
    """Two git clones of one workspace (its project file names the resource 'db')."""
    origin = tmp_path / "origin"
    (origin / "app").mkdir(parents=True)
    (origin / "app" / "main.py").write_text("print('app')\n")
    project = {
        "schema_version": 1,
        "name": "locks-demo",
        "repositories": [{"name": "app", "path": "app"}],
        "checks": [
            {
                "id": "db-test",
                "argv": [sys.executable, "-c", _STAGE, str(markers), str(control)],
                "cwd": "app",
                "repos": ["app"],
                "resources": ["db"],
            }
        ],
        "profiles": {},
    }
    (origin / "checks.project.json").write_text(json.dumps(project, indent=2))
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    for argv in (
        ["init", "-q"],
        ["add", "-A"],
        ["-c", "commit.gpgsign=false", "commit", "-qm", "i"],
    ):
        subprocess.run(["git", *argv], cwd=origin, env=env, check=True, capture_output=True)
    clones = (tmp_path / "clone1", tmp_path / "clone2")
    for clone in clones:
        subprocess.run(["git", "clone", "-q", str(origin), str(clone)], check=True)
    return clones


def _start_run(clone: Path) -> subprocess.Popen[bytes]:
    """`ratchet checks run` in `clone`, a process of its own (each clone its own state)."""
    argv = [sys.executable, "-m", "ratchet.cli", "checks", "run", "--workspace-root", str(clone)]
    argv += ["--state-dir", str(clone.parent / f"{clone.name}-state"), "--json"]
    argv += ["--lock-timeout", "120", "--no-cache"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(what: str, ready: Callable[[], bool], *procs: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for proc in procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"a run ended early ({proc.returncode}): {err[-2000:]!r}")
        time.sleep(0.02)


def _waiting_for_db(clone: Path) -> bool:
    """True once the run in `clone` says its stage waits for resource 'db'."""
    state = clone.parent / f"{clone.name}-state"
    for receipt in (state / "runs").glob("*/receipt.json"):
        try:  # receipt.json and its journal, folded
            stages = read_receipt(clone, state, receipt.parent.name)["stages"]
        except (OSError, ValueError, KeyError):
            continue
        if any(s.get("waiting_for_resource") == "db" for s in stages):
            return True
    return False


def _markers(markers: Path) -> list[str]:
    return markers.read_text().splitlines() if markers.exists() else []


def _finish(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode(errors="replace")
    result: dict[str, Any] = json.loads(out)
    return result


def test_two_clones_of_one_workspace_exclude_each_other_on_a_resource(tmp_path: Path) -> None:
    markers, control = tmp_path / "markers.txt", tmp_path / "control"
    control.mkdir()
    one, two = _clones(tmp_path, markers, control)
    (control / "hold-clone1").touch()
    first = _start_run(one)
    second = None
    try:
        _wait_for("clone1's stage to start", lambda: _markers(markers) == ["start clone1"], first)
        second = _start_run(two)
        # clone2's run, in another workspace folder with its own state folder, waits for
        # the resource clone1's run holds (before, each clone had its own locks).
        _wait_for("clone2 to wait for 'db'", lambda: _waiting_for_db(two), first, second)
        assert _markers(markers) == ["start clone1"]
        (control / "hold-clone1").unlink()
        results = [_finish(first), _finish(second)]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert [r["status"] for r in results] == ["passed", "passed"]
    # The two stages' intervals do not overlap: each ends before the other starts.
    assert _markers(markers) == ["start clone1", "end clone1", "start clone2", "end clone2"]


def test_a_sigkilled_holder_in_another_clone_releases_the_resource(tmp_path: Path) -> None:
    markers, control = tmp_path / "markers.txt", tmp_path / "control"
    control.mkdir()
    one, two = _clones(tmp_path, markers, control)
    (control / "hold-clone1").touch()  # clone1's stage never ends on its own
    holder = _start_run(one)
    waiter = None
    try:
        _wait_for("clone1's stage to start", lambda: _markers(markers) == ["start clone1"], holder)
        waiter = _start_run(two)
        _wait_for("clone2 to wait for 'db'", lambda: _waiting_for_db(two), holder, waiter)
        os.kill(holder.pid, signal.SIGKILL)  # no cleanup runs: only the kernel releases
        holder.communicate(timeout=60)
        result = _finish(waiter)
    finally:
        for proc in (holder, waiter):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert holder.returncode == -signal.SIGKILL
    assert result["status"] == "passed"
    assert by_id(result)["db-test"]["waiting_for_resource"] is None  # it got the lock
    # clone1's stage died with its ratchet (parent-death signal) and never ended.
    assert _markers(markers) == ["start clone1", "start clone2", "end clone2"]


def test_runs_of_unrelated_projects_do_not_share_resource_locks(two_repos: Workspace) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"], resources=["db"])])  # project "demo"
    shared = Path(os.environ["RATCHET_CHECKS_LOCK_DIR"])
    with resource_lock(scope_lock_dir(shared, "project:another"), "db"):
        result = ws.run(lock_timeout=0)
    assert result["status"] == "passed"
    with resource_lock(scope_lock_dir(shared, "project:demo"), "db"):
        result = ws.run(lock_timeout=0)
    error = by_id(result)["a"]["error"]
    assert result["status"] == "failed"
    assert "resource 'db' is busy (held by this process; lock " in error
    assert str(scope_lock_dir(shared, "project:demo")) in error


def test_the_default_lock_folder_must_be_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RATCHET_CHECKS_LOCK_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    folder = machine_lock_dir()
    assert folder == tmp_path / f"ratchet-checks-locks-{os.getuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert machine_lock_dir("/elsewhere") == Path("/elsewhere")  # --lock-dir wins
    folder.chmod(0o777)  # anyone could now replace its lock files
    with pytest.raises(InvalidArgumentError, match="is not a folder that only you can write"):
        machine_lock_dir()
