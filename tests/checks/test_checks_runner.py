"""The runner's basics: the receipt, logs, probes, locks, timeouts, parallelism, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from checks_helpers import PY, Workspace, by_id, check, stage

from ratchet.checks import ReceiptError, ResumeRefusedError, runner
from ratchet.checks.checkpoints import Checkpoints
from ratchet.checks.common import atomic_json, read_json, resource_lock, state_root
from ratchet.cli import main as ratchet_main
from ratchet.store import verify_seal

STAGE_FIELDS = {
    "id",
    "status",
    "exit_code",
    "log_path",
    "checkpoint_verified",
    "checkpoint_version",
    "cache_key",
    "error",
}
RUN_FIELDS = {
    "run_id",
    "status",
    "phase",
    "receipt_path",
    "snapshot_verified",
    "source_fingerprint",
    "plan_fingerprint",
    "environment_fingerprint",
    "fingerprint_version",
    "finished_at",
    "stages",
}


def test_fresh_run_returns_and_seals_the_receipt(two_repos: Workspace) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("b", repos=["lib"], deps=["a"])])
    result = ws.run()
    assert RUN_FIELDS <= set(result)
    assert result["status"] == "passed"
    assert result["phase"] == "done"
    assert result["snapshot_verified"] is True
    assert result["fingerprint_version"] == 1
    for rec in result["stages"]:
        assert STAGE_FIELDS <= set(rec)
        assert rec["status"] == "passed"
        assert rec["checkpoint_verified"] is True
        assert rec["checkpoint_version"] == 1
        assert "reused_from" not in rec
    on_disk = read_json(result["receipt_path"])
    assert verify_seal(on_disk)
    assert on_disk == result
    assert ws.receipt(result["run_id"]) == result
    assert runner._seal(on_disk) == on_disk


def test_log_holds_combined_stdout_and_stderr_byte_for_byte(two_repos: Workspace) -> None:
    ws = two_repos
    code = (
        "import sys; sys.stdout.buffer.write(b'out\\xff\\r\\n'); sys.stdout.flush(); "
        "sys.stderr.buffer.write(b'err\\x00'); sys.stderr.flush()"
    )
    result = ws.run([stage("noisy", code, inputs={"repos": ["app"]})])
    assert Path(by_id(result)["noisy"]["log_path"]).read_bytes() == b"out\xff\r\nerr\x00"


def test_identity_is_probed_once_before_and_once_after_each_stage(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    calls: list[str] = []
    real = Checkpoints.identity

    def counting(self: Checkpoints, st: dict[str, Any]) -> dict[str, str]:
        calls.append(st["id"])
        return real(self, st)

    monkeypatch.setattr(Checkpoints, "identity", counting)
    ws.project([check("a", repos=["app"]), check("b", deps=["a"])])
    first = ws.run()
    assert first["status"] == "passed"
    assert calls == ["a", "a", "b", "b"]
    calls.clear()
    second = ws.run(resume=first["run_id"])
    assert [s["reused_from"] for s in second["stages"]] == [first["run_id"]] * 2
    assert calls == ["a", "b"]  # a resumed run probes once to decide reuse


def test_failing_receipt_write_leaves_the_previous_receipt_intact(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    first = ws.run()
    before = Path(first["receipt_path"]).read_bytes()

    def broken(path: Any, payload: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(runner, "atomic_json", broken)
    with pytest.raises(OSError, match="disk full"):
        ws.run(resume=first["run_id"])
    assert Path(first["receipt_path"]).read_bytes() == before
    assert ws.receipt(first["run_id"])["status"] == "passed"


def test_resume_refuses_a_tampered_or_running_receipt(two_repos: Workspace) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    first = ws.run()
    receipt = read_json(first["receipt_path"])
    receipt["stages"][0]["exit_code"] = 0
    receipt["stages"][0]["cache_key"] = "forged"
    atomic_json(first["receipt_path"], receipt)
    with pytest.raises(ReceiptError, match="does not match its seal"):
        ws.run(resume=first["run_id"])
    atomic_json(first["receipt_path"], runner._seal({**receipt, "status": "running"}))
    with pytest.raises(ResumeRefusedError, match="recover"):
        ws.run(resume=first["run_id"])
    with pytest.raises(ReceiptError, match="no receipt"):
        ws.run(resume="20990101T000000-00000000")


def test_resource_lock_is_busy_even_in_the_same_process(tmp_path: Path) -> None:
    with resource_lock(tmp_path, "db"), pytest.raises(RuntimeError, match="busy"):
        with resource_lock(tmp_path, "db"):
            pass
    with resource_lock(tmp_path, "db"):
        pass  # released again


def test_resource_lock_is_busy_across_processes(tmp_path: Path) -> None:
    holder = textwrap.dedent(
        f"""
        import sys
        from ratchet.checks.common import resource_lock
        with resource_lock({str(tmp_path)!r}, "gpu"):
            print("held", flush=True)
            sys.stdin.readline()
        """
    )
    proc = subprocess.Popen(
        [PY, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match="busy"), resource_lock(tmp_path, "gpu"):
            pass
    finally:
        proc.communicate("\n", timeout=30)
    with resource_lock(tmp_path, "gpu"):
        pass


def test_state_root_is_under_xdg_state_home_one_folder_per_workspace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    one, two = state_root(tmp_path / "a"), state_root(tmp_path / "b")
    assert one.is_relative_to(tmp_path / "xdg")
    assert one != two
    assert state_root(tmp_path / "a") == one


def test_timeout_kills_the_whole_process_group(two_repos: Workspace) -> None:
    ws = two_repos
    pid_file = ws.control / "child.pid"
    code = textwrap.dedent(
        f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(60)
        """
    )
    result = ws.run([stage("slow", code, inputs={"repos": ["app"]}, timeout_seconds=1.0)])
    rec = by_id(result)["slow"]
    assert result["status"] == "failed"
    assert rec["status"] == "failed"
    assert "timed out after 1 s; its process group was killed" in rec["error"]
    child = int(pid_file.read_text())
    # The grandchild was killed with its group; only a zombie (or nothing) may remain.
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_jobs_run_stages_in_parallel_but_never_two_holders_of_a_resource(
    two_repos: Workspace,
) -> None:
    ws = two_repos
    c = ws.control

    def rendezvous(me: str, other: str) -> str:
        return (
            "import pathlib, time\n"
            f"pathlib.Path({str(c / me)!r}).touch()\n"
            "deadline = time.time() + 20\n"
            f"while not pathlib.Path({str(c / other)!r}).exists():\n"
            "    assert time.time() < deadline, 'no parallelism'\n"
            "    time.sleep(0.01)\n"
        )

    exclusive = (
        "import os, pathlib, time\n"
        f"p = pathlib.Path({str(c / 'db-holder')!r})\n"
        "assert not p.exists(), 'two holders of db'\n"
        "p.touch(); time.sleep(0.2); p.unlink()\n"
    )
    stages = [
        stage("x", rendezvous("x", "y"), inputs={"repos": ["app"]}),
        stage("y", rendezvous("y", "x"), inputs={"repos": ["lib"]}),
        stage("d1", exclusive, inputs={"repos": []}, resources=["db"]),
        stage("d2", exclusive, inputs={"repos": []}, resources=["db"]),
    ]
    result = ws.run(stages, jobs=3)
    assert {s["id"]: s["status"] for s in result["stages"]} == dict.fromkeys(
        ["x", "y", "d1", "d2"], "passed"
    )


def test_cli_run_explain_list_and_exit_codes(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    flag = ws.control / "fail"
    ws.project(
        [
            check("a", repos=["app"]),
            check(
                "b",
                f"import os, sys; sys.exit(1 if os.path.exists({str(flag)!r}) else 0)",
                reuse="never",  # the flag is not an input; only "never" makes it re-run
            ),
        ],
        profiles={"quick": ["a"]},
    )
    common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
    assert ratchet_main([*common, "run", "--json", "--jobs", "2"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["status"] == "passed"
    flag.touch()
    assert ratchet_main([*common, "run", "--resume", first["run_id"], "--json"]) == 1
    second = json.loads(capsys.readouterr().out)
    assert by_id(second)["b"]["status"] == "failed"
    assert ratchet_main([*common, "explain", second["run_id"], "a"]) == 0
    assert "reused" in capsys.readouterr().out
    assert ratchet_main([*common, "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in listed["checks"]] == ["a", "b"]
    assert {r["run_id"] for r in listed["runs"]} == {first["run_id"], second["run_id"]}
    assert ratchet_main([*common, "run", "--profile", "nope"]) == 2
    assert "unknown profile 'nope'" in capsys.readouterr().err
    # The summary table (no --json) names every stage.
    assert ratchet_main([*common, "run", "--profile", "quick"]) == 0
    assert "passed" in capsys.readouterr().out


def test_python_dash_m_ratchet_checks_runs(two_repos: Workspace) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.checks", "run", "--workspace-root", str(ws.root)]
        + ["--state-dir", str(ws.state_dir), "--json"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "passed"


def test_a_run_whose_final_write_failed_can_be_recovered_in_the_same_process(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("b", repos=["lib"])])
    real = runner.atomic_json

    def no_final(path: Any, payload: dict[str, Any]) -> None:
        if payload["phase"] == "done":
            raise OSError("disk gone")
        real(path, payload)

    monkeypatch.setattr(runner, "atomic_json", no_final)
    with pytest.raises(ReceiptError, match="recover it before resuming"):
        ws.run()
    monkeypatch.setattr(runner, "atomic_json", real)
    (run_dir,) = (ws.state_dir / "runs").iterdir()
    assert ws.receipt(run_dir.name)["status"] == "running"
    report = runner.recover(
        ws.root, ws.state_dir, run_dir.name, apply=True, confirm_processes_stopped=True
    )
    assert report["action"] == "recovered"
    resumed = ws.run(resume=run_dir.name)
    assert {s["id"] for s in resumed["stages"] if s.get("reused_from")} == {"a", "b"}


def test_live_progress_renders_on_a_terminal(two_repos: Workspace) -> None:
    import io

    from ratchet.checks._report import LiveProgress, render

    stream = io.StringIO()
    records = [{"id": "a", "status": "running"}, {"id": "b", "status": "passed"}]
    with LiveProgress(2, stream=stream, enabled=True) as progress:
        progress.update(records)
    out = io.StringIO()
    render({"run_id": "r1", "status": "passed", "stages": records, "snapshot_verified": True}, out)
    assert "r1" in out.getvalue()
    assert "passed" in out.getvalue()
