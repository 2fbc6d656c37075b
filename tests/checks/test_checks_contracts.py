"""Contracts 1-11 of `ratchet checks` (issue 3), one test (or more) each."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from checks_helpers import PY, Workspace, by_id, check, stage

from ratchet.checks import LegacyReceiptError, runner
from ratchet.checks.checkpoints import Checkpoints
from ratchet.checks.common import read_json, resource_lock, state_root
from ratchet.store import verify_seal


def _track_executions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    started: list[str] = []
    real = runner._execute_stage_command

    def tracking(st: dict[str, Any], *args: Any, **kwargs: Any) -> int:
        started.append(st["id"])
        return real(st, *args, **kwargs)

    monkeypatch.setattr(runner, "_execute_stage_command", tracking)
    return started


def _reused(result: dict[str, Any]) -> set[str]:
    return {s["id"] for s in result["stages"] if s.get("reused_from")}


def _ran(result: dict[str, Any]) -> set[str]:
    return {
        s["id"] for s in result["stages"] if s["status"] != "skipped" and not s.get("reused_from")
    }


# --- 1 ------------------------------------------------------------------------------


def test_contract_1_resource_locks_are_held_through_probes_run_and_persist(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    locks_dir = state_root(ws.root) / "resource-locks"
    seen: list[tuple[str, str]] = []

    def probe_lock(where: str) -> None:
        try:
            with resource_lock(locks_dir, "db"):
                seen.append((where, "free"))
        except RuntimeError as exc:
            seen.append((where, "busy" if "busy" in str(exc) else str(exc)))

    real_identity = Checkpoints.identity

    def identity(self: Checkpoints, st: dict[str, Any]) -> dict[str, str]:
        probe_lock("probe")
        return real_identity(self, st)

    real_write = runner.atomic_json
    persisted: list[bool] = []

    def write(path: Any, payload: dict[str, Any]) -> None:
        rec = by_id(payload)["locked"]
        if payload["phase"] == "checking" and rec["checkpoint_verified"] and not persisted:
            persisted.append(True)
            probe_lock("persist")
        real_write(path, payload)

    monkeypatch.setattr(Checkpoints, "identity", identity)
    monkeypatch.setattr(runner, "atomic_json", write)
    # The command itself checks, from another process, that the lock file is flock()ed.
    lock_file = locks_dir / "db.lock"
    code = (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(lock_file)!r}, os.O_RDWR)\n"
        "try:\n"
        "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "except BlockingIOError:\n"
        "    print('busy'); sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    result = ws.run([stage("locked", code, inputs={"repos": ["app"]}, resources=["db"])])
    assert result["status"] == "passed", by_id(result)["locked"]["error"]
    assert Path(by_id(result)["locked"]["log_path"]).read_text() == "busy\n"
    assert seen == [("probe", "busy"), ("probe", "busy"), ("persist", "busy")]
    with resource_lock(locks_dir, "db"):
        pass  # released once the stage is done


# --- 2 ------------------------------------------------------------------------------


def _producer_plan() -> list[dict[str, Any]]:
    return [
        stage("producer", inputs={"repos": ["app"]}),
        stage("consumer", inputs={"repos": ["lib"]}, deps=["producer"]),
        stage("successor", inputs={"repos": ["lib"]}, after=["producer"]),
    ]


def test_contract_2_failed_persist_fails_the_stage_and_skips_dependents(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    started = _track_executions(monkeypatch)
    real_write = runner.atomic_json

    def write(path: Any, payload: dict[str, Any]) -> None:
        if by_id(payload)["producer"]["checkpoint_verified"]:
            raise OSError("disk full")
        real_write(path, payload)

    monkeypatch.setattr(runner, "atomic_json", write)
    result = ws.run(_producer_plan())
    recs = by_id(result)
    assert result["status"] == "failed"
    assert recs["producer"]["status"] == "failed"
    assert recs["producer"]["checkpoint_verified"] is False
    assert "checkpoint could not be persisted" in recs["producer"]["error"]
    assert "disk full" in recs["producer"]["error"]
    assert recs["consumer"]["status"] == "skipped"
    assert recs["successor"]["status"] == "skipped"
    assert started == ["producer"]
    on_disk = read_json(result["receipt_path"])
    assert verify_seal(on_disk)
    assert by_id(on_disk)["producer"]["status"] == "failed"
    assert by_id(on_disk)["producer"]["checkpoint_verified"] is False
    assert by_id(on_disk)["consumer"]["status"] == "skipped"
    assert on_disk["status"] == "failed"


def test_contract_2_no_consumer_starts_while_the_checkpoint_write_is_blocked(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    started = _track_executions(monkeypatch)
    entered, gate = threading.Event(), threading.Event()
    real_write, real_wait = runner.atomic_json, runner.wait
    waits_while_blocked: list[threading.Thread] = []

    def write(path: Any, payload: dict[str, Any]) -> None:
        if by_id(payload)["producer"]["checkpoint_verified"] and not entered.is_set():
            entered.set()
            assert gate.wait(30)
        real_write(path, payload)

    def wait(fs: Any, timeout: float | None = None, return_when: str = "ALL_COMPLETED") -> Any:
        assert timeout is not None
        if entered.is_set() and not gate.is_set():
            assert started == ["producer"]
            waits_while_blocked.append(threading.current_thread())
            if len(waits_while_blocked) >= 5:
                gate.set()
        return real_wait(fs, timeout=timeout, return_when=return_when)

    monkeypatch.setattr(runner, "atomic_json", write)
    monkeypatch.setattr(runner, "wait", wait)
    result = ws.run(_producer_plan())
    assert result["status"] == "passed"
    assert len(waits_while_blocked) >= 5
    assert set(waits_while_blocked) == {threading.main_thread()}
    assert started == ["producer", "consumer", "successor"]


# --- 3 ------------------------------------------------------------------------------


def test_contract_3_resume_reuses_matching_stages_despite_unrelated_changes(
    two_repos: Workspace,
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("b", repos=["lib"])])
    first = ws.run()
    first_bytes = Path(first["receipt_path"]).read_bytes()
    same = ws.run(resume=first["run_id"])
    assert same["receipt_path"] != first["receipt_path"]
    assert _reused(same) == {"a", "b"}
    assert same["source_fingerprint"] == first["source_fingerprint"]
    assert by_id(same)["a"]["log_path"] == by_id(first)["a"]["log_path"]
    assert by_id(same)["a"]["cache_key"] == by_id(first)["a"]["cache_key"]

    ws.write("lib/lib.py", "Y = 3\n")  # unrelated to a
    second = ws.run(resume=first["run_id"])
    assert second["status"] == "passed"
    assert by_id(second)["a"]["reused_from"] == first["run_id"]
    assert _ran(second) == {"b"}
    assert second["source_fingerprint"] != first["source_fingerprint"]
    (ws.root / "lib" / "new.txt").write_text("untracked files are inputs too\n")
    third = ws.run(resume=second["run_id"])
    assert _ran(third) == {"b"}
    assert third["source_fingerprint"] != second["source_fingerprint"]
    assert Path(first["receipt_path"]).read_bytes() == first_bytes  # resumes never rewrite it


# --- 4 ------------------------------------------------------------------------------

CASES: dict[str, tuple[Callable[[list[dict[str, Any]]], None], set[str], str]] = {
    "command": (lambda c: c[0].update(argv=[PY, "-c", "print(2)"]), {"a"}, "command changed"),
    "new deps edge": (lambda c: c[0].update(deps=["c"]), {"a"}, "dependency 'c' added"),
    "declared scope": (
        lambda c: c[0].update(repos=["app", "lib"]),
        {"a"},
        "declared input scope changed",
    ),
    "new stage": (lambda c: c.append(check("n", repos=["app"])), {"n"}, "new stage"),
    "unrelated check": (lambda c: c[1].update(argv=[PY, "-c", "print(3)"]), {"b"}, ""),
    "profile only": (lambda c: None, set(), ""),
}


@pytest.mark.parametrize("case", list(CASES))
def test_contract_4_what_invalidates_a_stage_and_what_does_not(
    two_repos: Workspace, case: str
) -> None:
    ws = two_repos
    checks = [check("a", repos=["app"]), check("b", repos=["lib"]), check("c", repos=["lib"])]
    ws.project(checks, profiles={"p": ["a"]})
    first = ws.run()
    mutate, expect_ran, reason = CASES[case]
    mutate(checks)
    ws.project(checks, profiles={"p": ["a"], "q": ["b", "c"]})
    second = ws.run(resume=first["run_id"])
    assert second["status"] == "passed"
    assert _ran(second) == expect_ran
    if expect_ran or case == "new stage":
        assert second["plan_fingerprint"] != first["plan_fingerprint"]
    else:
        assert second["plan_fingerprint"] == first["plan_fingerprint"]
    if reason:
        (stage_id,) = expect_ran
        explained = runner.explain(ws.root, ws.state_dir, second["run_id"], stage_id)
        assert any(reason in r for r in explained["reasons"]), explained


def test_contract_4_a_changed_environment_fingerprint_invalidates(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    first = ws.run()
    real = runner.environment_fingerprint
    monkeypatch.setattr(runner, "environment_fingerprint", lambda: {**real(), "env:CC": "clang"})
    second = ws.run(resume=first["run_id"])
    assert _ran(second) == {"a"}
    assert second["environment_fingerprint"] != first["environment_fingerprint"]
    explained = runner.explain(ws.root, ws.state_dir, second["run_id"], "a")
    assert "environment key 'env:CC' changed" in explained["reasons"]
    monkeypatch.setattr(runner, "environment_fingerprint", lambda: "opaque-fingerprint")
    third = ws.run(resume=second["run_id"])
    assert _ran(third) == {"a"}
    assert third["environment_fingerprint"] == "opaque-fingerprint"


# --- 5 ------------------------------------------------------------------------------


def test_contract_5_invalidation_follows_deps_transitively_not_after(two_repos: Workspace) -> None:
    ws = two_repos
    ws.project(
        [
            check("a", repos=["app"]),
            check("b", repos=["lib"], deps=["a"]),
            check("c", repos=["lib"], deps=["b"]),
            check("d", repos=["lib"], after=["a"]),
        ]
    )
    first = ws.run()
    ws.write("app/main.py", "print('v2')\n")
    second = ws.run(resume=first["run_id"])
    assert _ran(second) == {"a", "b", "c"}
    assert _reused(second) == {"d"}
    explained = runner.explain(ws.root, ws.state_dir, second["run_id"], "c")
    assert "dependency 'b' has a new checkpoint (it re-ran)" in explained["reasons"]
    explained = runner.explain(ws.root, ws.state_dir, second["run_id"], "a")
    assert "input file app/main.py modified" in explained["reasons"]


def test_contract_5_a_failed_after_predecessor_stops_its_successors(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    started = _track_executions(monkeypatch)
    result = ws.run(
        [
            stage("x", "import sys; sys.exit(4)", inputs={"repos": ["app"]}),
            stage("y", inputs={"repos": ["lib"]}, after=["x"]),
            stage("z", inputs={"repos": ["lib"]}, deps=["y"]),
        ]
    )
    recs = by_id(result)
    assert (recs["x"]["status"], recs["x"]["exit_code"]) == ("failed", 4)
    assert recs["y"]["status"] == "skipped"
    assert "comes after 'x', which is failed" in recs["y"]["error"]
    assert recs["z"]["status"] == "skipped"
    assert started == ["x"]


# --- 6 ------------------------------------------------------------------------------


def test_contract_6_reuse_never_runs_with_its_consumers_but_not_after_successors(
    two_repos: Workspace,
) -> None:
    ws = two_repos
    ws.project(
        [
            check("n", repos=["app"], reuse="never"),
            check("m", repos=["lib"], deps=["n"]),
            check("o", repos=["lib"], after=["n"]),
        ]
    )
    first = ws.run()
    second = ws.run(resume=first["run_id"])
    assert second["status"] == "passed"
    assert _ran(second) == {"n", "m"}
    assert _reused(second) == {"o"}
    assert (
        "reuse is 'never'"
        in runner.explain(ws.root, ws.state_dir, second["run_id"], "n")["reasons"]
    )


def test_contract_6_a_never_stage_with_unchanged_outputs_cuts_its_consumers_off(
    ws: Workspace,
) -> None:
    """As documented: a `never` producer that wrote the same bytes again leaves its
    consumers' keys (which name its output digest) unchanged, so they are reused."""
    ws.repo("app", {"main.py": "x\n", ".gitignore": "out/\n"})
    write = "import pathlib; pathlib.Path('out').mkdir(exist_ok=True); pathlib.Path('out/x').write_text('same')"
    ws.project(
        [
            check("svc", write, cwd="app", repos=["app"], reuse="never", outputs=["app/out"]),
            check("use", repos=["app"], deps=["svc"]),
        ]
    )
    first = ws.run()
    second = ws.run(resume=first["run_id"])
    assert _ran(second) == {"svc"}
    assert _reused(second) == {"use"}


# --- 7 ------------------------------------------------------------------------------


def test_contract_7_inputs_changed_while_running_make_the_stage_stale(two_repos: Workspace) -> None:
    ws = two_repos
    target = ws.root / "app" / "main.py"
    original = target.read_text()
    result = ws.run(
        [
            stage(
                "mutator", f"open({str(target)!r}, 'w').write('edited')", inputs={"repos": ["app"]}
            ),
            # Restoring the bytes later in the same run does not make it pass.
            stage(
                "restorer",
                f"open({str(target)!r}, 'w').write({original!r})",
                inputs={"repos": ["lib"]},
            ),
        ]
    )
    recs = by_id(result)
    assert target.read_text() == original
    assert recs["mutator"]["status"] == "stale"
    assert recs["mutator"]["checkpoint_verified"] is False
    assert (
        "inputs changed while the stage ran: input file app/main.py modified"
        in recs["mutator"]["error"]
    )
    assert recs["restorer"]["status"] == "passed"
    assert result["status"] == "stale"
    assert result["snapshot_verified"] is False


def test_contract_7_end_of_run_probe_catches_changes_after_a_checkpoint(
    two_repos: Workspace,
) -> None:
    ws = two_repos
    target = ws.root / "app" / "pkg" / "util.py"
    result = ws.run(
        [
            stage("a", inputs={"repos": ["app"]}),
            stage(
                "b",
                f"open({str(target)!r}, 'a').write('# later\\n')",
                inputs={"repos": ["lib"]},
                after=["a"],
            ),
        ]
    )
    recs = by_id(result)
    assert recs["a"]["status"] == "passed"
    assert recs["b"]["status"] == "passed"
    assert result["status"] == "stale"
    assert result["snapshot_verified"] is False
    assert "app/pkg/util.py" in recs["a"]["snapshot_error"]


def test_contract_7_a_failing_post_run_probe_makes_the_stage_stale_keeping_evidence(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    calls: list[str] = []
    real = Checkpoints.identity

    def flaky(self: Checkpoints, st: dict[str, Any]) -> dict[str, str]:
        calls.append(st["id"])
        if calls.count("a") == 2:
            raise OSError("probe broke")
        return real(self, st)

    monkeypatch.setattr(Checkpoints, "identity", flaky)
    result = ws.run([stage("a", "print('evidence')", inputs={"repos": ["app"]})])
    rec = by_id(result)["a"]
    assert rec["status"] == "stale"
    assert rec["exit_code"] == 0
    assert rec["checkpoint_verified"] is False
    assert Path(rec["log_path"]).read_text() == "evidence\n"
    assert "post-run input probe failed" in rec["error"]
    assert "probe broke" in rec["error"]
    assert result["status"] == "stale"


# --- 8 ------------------------------------------------------------------------------


def test_contract_8_a_failed_run_donates_its_passed_stages(two_repos: Workspace) -> None:
    ws = two_repos
    flag = ws.control / "break-b"
    flag.touch()
    code = f"import os, sys; sys.exit(1 if os.path.exists({str(flag)!r}) else 0)"
    ws.project([check("a", repos=["app"]), check("b", code, repos=["lib"]), check("c", deps=["b"])])
    first = ws.run()
    assert first["status"] == "failed"
    assert by_id(first)["c"]["status"] == "skipped"
    flag.unlink()
    second = ws.run(resume=first["run_id"])
    assert second["status"] == "passed"
    assert _reused(second) == {"a"}
    assert _ran(second) == {"b", "c"}


def test_contract_8_a_stale_run_donates_only_checkpoints_matching_current_inputs(
    two_repos: Workspace,
) -> None:
    ws = two_repos
    flag = ws.control / "edit-app"
    flag.touch()
    target = ws.root / "app" / "main.py"
    edit = f"import os\nif os.path.exists({str(flag)!r}):\n    open({str(target)!r}, 'a').write('#\\n')"
    ws.project(
        [
            check("a", repos=["app"]),
            check("b", repos=["lib"]),
            check("c", edit, repos=["lib"], after=["a", "b"]),
        ]
    )
    first = ws.run()
    assert first["status"] == "stale"
    flag.unlink()
    second = ws.run(resume=first["run_id"])
    assert second["status"] == "passed"
    assert _ran(second) == {"a"}  # its checkpoint no longer matches app's bytes
    assert _reused(second) == {"b", "c"}


# --- 9 (the SIGKILL version is in test_checks_kill.py) --------------------------------


def test_contract_9_recover_then_resume_reuses_only_verified_checkpoints(
    two_repos: Workspace,
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("b", repos=["lib"]), check("c", repos=["lib"])])
    first = ws.run()
    path = Path(first["receipt_path"])
    # Make it look like a crash: b was running (its record not durable), c not started.
    crashed = read_json(path)
    recs = by_id(crashed)
    recs["b"].update(status="running", checkpoint_verified=False, log_sha256=None)
    recs["c"].update(status="pending", checkpoint_verified=False)
    # The run's process (here a stand-in) is still alive.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    crashed.update(status="running", pid=holder.pid, pid_start=runner._process_start(holder.pid))
    path.write_text(json.dumps(runner._seal(crashed)))
    before = path.read_bytes()

    with pytest.raises(ValueError, match="still marked running"):
        ws.run(resume=first["run_id"])
    report = runner.recover(ws.root, ws.state_dir, first["run_id"])
    assert report["action"] == "would-recover"
    assert report["mark_failed"] == ["b"]
    assert path.read_bytes() == before
    refused = runner.recover(ws.root, ws.state_dir, first["run_id"], apply=True)
    assert refused["action"] == "refused"
    assert "--confirm-processes-stopped" in refused["error"]
    try:
        alive = runner.recover(
            ws.root, ws.state_dir, first["run_id"], apply=True, confirm_processes_stopped=True
        )
    finally:
        holder.kill()
        holder.wait()
    assert alive["action"] == "refused"
    assert "still alive" in alive["error"]
    assert path.read_bytes() == before
    done = runner.recover(
        ws.root, ws.state_dir, first["run_id"], apply=True, confirm_processes_stopped=True
    )
    assert done["action"] == "recovered"
    recovered = ws.receipt(first["run_id"])
    assert recovered["status"] == "interrupted"
    assert by_id(recovered)["b"]["status"] == "failed"
    assert by_id(recovered)["c"]["status"] == "skipped"
    resumed = ws.run(resume=first["run_id"])
    assert resumed["status"] == "passed"
    assert _reused(resumed) == {"a"}
    assert _ran(resumed) == {"b", "c"}


# --- 10 -----------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["tampered", "missing"])
def test_contract_10_damaged_log_evidence_fails_the_run_without_reuse_or_rerun(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    ws = two_repos
    ws.project(
        [
            check("a", "print('ok')", repos=["app"]),
            check("b", repos=["lib"], deps=["a"]),
            check("c", repos=["lib"]),
        ]
    )
    first = ws.run()
    log = Path(by_id(first)["a"]["log_path"])
    if damage == "tampered":
        log.write_text("ok, trust me\n")
    else:
        log.unlink()
    started = _track_executions(monkeypatch)
    second = ws.run(resume=first["run_id"])
    recs = by_id(second)
    assert second["status"] == "failed"
    assert recs["a"]["status"] == "failed"
    assert recs["a"]["checkpoint_verified"] is False
    assert "reused_from" not in recs["a"]
    assert ("altered" if damage == "tampered" else "missing") in recs["a"]["error"]
    assert "not re-running it silently" in recs["a"]["error"]
    assert recs["b"]["status"] == "skipped"
    assert recs["c"]["reused_from"] == first["run_id"]
    assert started == []


# --- 11 -----------------------------------------------------------------------------


def test_contract_11_a_legacy_receipt_grants_no_reuse(two_repos: Workspace) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    first = ws.run()
    legacy = read_json(first["receipt_path"])
    legacy.pop("fingerprint_version")
    for rec in legacy["stages"]:
        for key in ("checkpoint_verified", "checkpoint_version", "checkpoint_id", "cache_key"):
            rec.pop(key)
    Path(first["receipt_path"]).write_text(json.dumps(runner._seal(legacy)))
    with pytest.raises(LegacyReceiptError, match="predates checkpoints") as info:
        ws.run(resume=first["run_id"])
    assert isinstance(info.value, ValueError)
