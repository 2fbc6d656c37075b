"""Issue 17: every way `ratchet checks` could pass what it did not check, one test each.

Each test builds the situation the review found on real git repositories and shows the
resume (or fresh run) re-running, refusing or failing where the old runner reused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from checks_helpers import PY, Workspace, _git, by_id, check

from ratchet.checks import ProjectError, ReceiptError, runner
from ratchet.checks.common import read_json
from ratchet.cli import main as ratchet_main
from ratchet.store import seal


def _ran(result: dict[str, Any]) -> set[str]:
    return {
        s["id"] for s in result["stages"] if s["status"] != "skipped" and not s.get("reused_from")
    }


def _reused(result: dict[str, Any]) -> set[str]:
    return {s["id"] for s in result["stages"] if s.get("reused_from")}


# --- 1. declared outputs ----------------------------------------------------------------

_BUILD = (
    "import pathlib\n"
    "src = pathlib.Path('src.txt').read_text()\n"
    "pathlib.Path('out').mkdir(exist_ok=True)\n"
    "pathlib.Path('out/data.txt').write_text(src.upper())\n"
)
_TEST = (
    "import pathlib, sys\n"
    "data = pathlib.Path('app/out/data.txt').read_text()\n"
    "print('data', data)\n"
    "sys.exit(0 if data == 'GOOD' else 1)\n"
)


def _producer(ws: Workspace) -> None:
    ws.repo("app", {"src.txt": "good", "notes.md": "n\n", ".gitignore": "out/\n"})
    ws.repo("lib", {"lib.py": "Y = 2\n"})
    ws.project(
        [
            check("build", _BUILD, cwd="app", repos=["app"], outputs=["app/out"]),
            check("test", _TEST, repos=["lib"], deps=["build"]),
        ]
    )


def test_a_reused_producer_whose_outputs_changed_on_disk_re_runs(ws: Workspace) -> None:
    _producer(ws)
    first = ws.run()
    assert first["status"] == "passed"
    assert by_id(first)["build"]["outputs_digest"]
    # Another run (another branch) left different bytes in the gitignored output folder.
    (ws.root / "app" / "out" / "data.txt").write_text("BAD")
    second = ws.run(resume=first["run_id"])
    recs = by_id(second)
    assert second["status"] == "passed"
    assert "reused_from" not in recs["build"]  # the old runner reused it over "BAD"
    assert "declared outputs on disk differ" in recs["build"]["explain"]["reasons"][0]
    assert (ws.root / "app" / "out" / "data.txt").read_text() == "GOOD"
    # Early cutoff: the re-run produced the same bytes, so its consumer is still reused.
    assert recs["test"]["reused_from"] == first["run_id"]
    assert recs["build"]["outputs_digest"] == by_id(first)["build"]["outputs_digest"]


def test_a_removed_output_makes_the_producer_re_run(ws: Workspace) -> None:
    _producer(ws)
    first = ws.run()
    (ws.root / "app" / "out" / "data.txt").unlink()
    second = ws.run(resume=first["run_id"])
    assert _ran(second) == {"build"}
    assert _reused(second) == {"test"}
    assert (ws.root / "app" / "out" / "data.txt").read_text() == "GOOD"


def test_early_cutoff_and_its_limit(ws: Workspace) -> None:
    _producer(ws)
    first = ws.run()
    ws.write("app/notes.md", "an input of build that does not change its outputs\n")
    second = ws.run(resume=first["run_id"])
    assert _ran(second) == {"build"}
    assert _reused(second) == {"test"}
    ws.write("app/src.txt", "bad")  # now the outputs change: the consumer must run, and fail
    third = ws.run(resume=second["run_id"])
    assert _ran(third) == {"build", "test"}
    assert by_id(third)["test"]["status"] == "failed"
    assert third["status"] == "failed"


def test_declared_outputs_that_match_nothing_fail_the_stage(ws: Workspace) -> None:
    ws.repo("app", {"a.txt": "a\n"})
    ws.project([check("build", "print('forgot to write')", repos=["app"], outputs=["app/dist"])])
    result = ws.run()
    rec = by_id(result)["build"]
    assert result["status"] == "failed"
    assert rec["checkpoint_verified"] is False
    assert "declared outputs ['app/dist'] match no file" in rec["error"]


def test_outputs_must_stay_inside_the_workspace(ws: Workspace) -> None:
    ws.repo("app", {"a.txt": "a\n"})
    ws.project([check("build", repos=["app"], outputs=["../elsewhere"])])
    with pytest.raises(ProjectError, match=r"checks\[0\]\.outputs\[0\]: must stay inside"):
        ws.plan()


# --- 2. submodules and nested repositories ----------------------------------------------


def _nested(ws: Workspace, kind: str) -> Path:
    app = ws.repo("app", {"main.py": "print('app')\n"})
    if kind == "nested repository":
        inner = app / "vendor"
        inner.mkdir()
        (inner / "dep.py").write_text("V = 1\n")
        _git(inner, "init", "-q")
        _git(inner, "add", "-A")
        _git(inner, "-c", "commit.gpgsign=false", "commit", "-q", "-m", "v")
        return inner / "dep.py"
    upstream = ws.control / "upstream"
    upstream.mkdir()
    (upstream / "dep.py").write_text("V = 1\n")
    _git(upstream, "init", "-q")
    _git(upstream, "add", "-A")
    _git(upstream, "-c", "commit.gpgsign=false", "commit", "-q", "-m", "v")
    _git(app, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(upstream), "vendor")
    _git(app, "-c", "commit.gpgsign=false", "commit", "-q", "-m", "sub")
    return app / "vendor" / "dep.py"


@pytest.mark.parametrize("kind", ["nested repository", "submodule"])
def test_an_edit_inside_a_nested_repository_or_submodule_invalidates(
    ws: Workspace, kind: str
) -> None:
    dep = _nested(ws, kind)
    ws.project([check("a", repos=["app"])])
    first = ws.run()
    dep.write_text("V = 2\n")
    second = ws.run(resume=first["run_id"])
    assert _ran(second) == {"a"}  # the old runner hashed the folder as the word "dir"
    reasons = runner.explain(ws.root, ws.state_dir, second["run_id"], "a")["reasons"]
    assert "input file app/vendor/dep.py modified" in reasons


# --- 3. a declared repository the enclosing repository ignores --------------------------


def test_an_ignored_declared_folder_is_hashed_as_a_plain_directory(ws: Workspace) -> None:
    (ws.root / ".gitignore").write_text("evals/\n")
    data = ws.root / "evals"
    data.mkdir()
    (data / "cases.jsonl").write_text('{"q": 1}\n')
    _git(ws.root, "init", "-q")
    ws.repos.append({"name": "evals", "path": "evals"})
    ws.project([check("eval", repos=["evals"])])
    first = ws.run()
    (data / "cases.jsonl").write_text('{"q": 2}\n')
    second = ws.run(resume=first["run_id"])
    assert _ran(second) == {"eval"}  # the old runner saw an empty manifest both times


def test_an_empty_declared_repository_is_refused(ws: Workspace) -> None:
    ws.repo("app", {"a.txt": "a\n"})
    (ws.root / "empty").mkdir()
    ws.repos.append({"name": "empty", "path": "empty"})
    ws.project([check("a", repos=["empty"])])
    with pytest.raises(ProjectError, match="repository 'empty' at .* has no files to hash"):
        ws.run()


# --- 4. files at the workspace root ------------------------------------------------------


def test_workspace_root_files_are_inputs_of_a_default_scope_check(ws: Workspace) -> None:
    ws.repo("app", {"a.txt": "a\n"})
    (ws.root / "tools").mkdir()
    ws.write("tools/ci.py", "print('ci v1')\n")
    ws.project([check("ci", "print(open('tools/ci.py').read())"), check("other", repos=["app"])])
    first = ws.run()
    ws.write("tools/ci.py", "print('ci v2')\n")
    second = ws.run(resume=first["run_id"])
    assert _ran(second) == {"ci"}  # the old runner reused it: tools/ci.py was no input
    reasons = runner.explain(ws.root, ws.state_dir, second["run_id"], "ci")["reasons"]
    assert "input file tools/ci.py (workspace root) modified" in reasons
    # The project file is not an input itself: its checks are keyed one by one.
    ws.project([check("ci", "print(open('tools/ci.py').read())"), check("other", "print(2)")])
    third = ws.run(resume=second["run_id"])
    assert _reused(third) == {"ci"}
    assert _ran(third) == {"other"}


# --- 5. signed receipts -------------------------------------------------------------------

KEY = "k" * 32


def test_with_a_key_receipts_are_signed_and_forgeries_refused(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    secret_probe = "import os; print('key:', os.environ.get('RATCHET_CHECKS_SIGNING_KEY'))"
    ws.project([check("a", secret_probe, repos=["app"]), check("b", "raise SystemExit(1)")])
    monkeypatch.setenv("RATCHET_CHECKS_SIGNING_KEY", KEY)
    first = ws.run()
    path = Path(first["receipt_path"])
    assert first["seal"].startswith("hmac-sha256:")
    assert KEY not in path.read_text()
    assert Path(by_id(first)["a"]["log_path"]).read_text() == "key: None\n"  # not passed on

    # Someone who can write the state directory, but has not the key, flips b to passed.
    forged = read_json(path)
    by_id(forged)["b"].update(status="passed", checkpoint_verified=True)
    forged["status"] = "passed"
    path.write_text(json.dumps(seal(forged)))  # an unkeyed seal
    with pytest.raises(ReceiptError, match="is not signed, and a signing key is configured"):
        ws.receipt(first["run_id"])
    path.write_text(json.dumps(seal(forged, b"another key, 32 bytes long......")))
    with pytest.raises(ReceiptError, match="does not match its signature"):
        ws.run(resume=first["run_id"])

    monkeypatch.delenv("RATCHET_CHECKS_SIGNING_KEY")
    unsigned = ws.run()
    monkeypatch.setenv("RATCHET_CHECKS_SIGNING_KEY", KEY)
    with pytest.raises(ReceiptError, match="is not signed"):
        ws.run(resume=unsigned["run_id"])
    signed = ws.run()
    monkeypatch.delenv("RATCHET_CHECKS_SIGNING_KEY")
    with pytest.raises(ReceiptError, match="is signed, but no signing key is configured"):
        ws.receipt(signed["run_id"])


def test_a_key_file_signs_and_a_bad_one_is_a_clear_error(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    key_file = ws.control / "key"
    key_file.write_text(KEY + "\n")
    monkeypatch.setenv("RATCHET_CHECKS_SIGNING_KEY_FILE", str(key_file))
    first = ws.run()
    assert first["seal"].startswith("hmac-sha256:")
    assert ws.run(resume=first["run_id"])["status"] == "passed"
    monkeypatch.setenv("RATCHET_CHECKS_SIGNING_KEY_FILE", str(ws.control / "nope"))
    common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
    assert ratchet_main([*common, "run"]) == 2
    err = capsys.readouterr().err
    assert "RATCHET_CHECKS_SIGNING_KEY_FILE=" in err
    assert "cannot be read" in err
    assert "Traceback" not in err
    key_file.write_text("short")
    monkeypatch.setenv("RATCHET_CHECKS_SIGNING_KEY_FILE", str(key_file))
    assert ratchet_main([*common, "run"]) == 2
    assert "use at least 16 random bytes" in capsys.readouterr().err


# --- 6. symlinks, the environment, runtime inputs ---------------------------------------


def test_a_symlink_leaving_the_repository_is_followed(two_repos: Workspace) -> None:
    ws = two_repos
    outside = ws.control / "shared.cfg"
    outside.write_text("v1\n")
    (ws.root / "app" / "shared.cfg").symlink_to(outside)
    (ws.root / "app" / "inner.py").symlink_to("main.py")  # inside: the target text is enough
    ws.project([check("a", repos=["app"])])
    first = ws.run()
    outside.write_text("v2\n")
    second = ws.run(resume=first["run_id"])
    assert _ran(second) == {"a"}  # the old runner hashed only the link's text
    reasons = runner.explain(ws.root, ws.state_dir, second["run_id"], "a")["reasons"]
    assert "input file app/shared.cfg modified" in reasons


def test_environment_values_never_appear_in_receipts_or_json(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    monkeypatch.setenv("RATCHET_ENV_KEYS", "DEPLOY_TOKEN")
    monkeypatch.setenv("DEPLOY_TOKEN", "s3cr3t-token-value")
    common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
    assert ratchet_main([*common, "run", "--json"]) == 0
    out = capsys.readouterr().out
    receipt = json.loads(out)
    assert "s3cr3t-token-value" not in out
    assert "s3cr3t-token-value" not in Path(receipt["receipt_path"]).read_text()
    assert receipt["environment"]["env:DEPLOY_TOKEN"].startswith("sha256:")
    monkeypatch.setenv("DEPLOY_TOKEN", "rotated")
    again = ws.run(resume=receipt["run_id"])
    assert _ran(again) == {"a"}
    reasons = runner.explain(ws.root, ws.state_dir, again["run_id"], "a")["reasons"]
    assert "environment key 'env:DEPLOY_TOKEN' changed" in reasons


def test_strict_env_passes_only_declared_variables_and_keys_on_them(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    show = "import os; print(os.environ.get('API_URL'), os.environ.get('STRAY'))"
    ws.project([check("a", show, repos=["app"], env=["API_URL"])])
    monkeypatch.setenv("API_URL", "https://one.example")
    monkeypatch.setenv("STRAY", "leaks-in")
    loose = ws.run()
    assert Path(by_id(loose)["a"]["log_path"]).read_text() == "https://one.example leaks-in\n"
    strict = ws.run(strict_env=True)
    assert strict["strict_env"] is True
    assert Path(by_id(strict)["a"]["log_path"]).read_text() == "https://one.example None\n"
    assert "https://one.example" not in Path(strict["receipt_path"]).read_text()
    same = ws.run(strict_env=True, resume=strict["run_id"])
    assert _reused(same) == {"a"}
    monkeypatch.setenv("API_URL", "https://two.example")
    changed = ws.run(strict_env=True, resume=same["run_id"])
    assert _ran(changed) == {"a"}


def test_declared_runtime_inputs_enter_the_cache_key(two_repos: Workspace) -> None:
    ws = two_repos
    version = ws.control / "tool-version"
    version.write_text("1.0\n")
    (ws.root / "app" / ".gitignore").write_text(".venv/\n")
    venv = ws.root / "app" / ".venv"
    venv.mkdir()
    (venv / "tool.py").write_text("T = 1\n")
    runtime = [{"argv": [PY, "-c", f"print(open({str(version)!r}).read())"]}, {"path": "app/.venv"}]
    ws.project([check("a", repos=["app"], runtime_inputs=runtime)])
    first = ws.run()
    assert ws.run(resume=first["run_id"])["stages"][0]["reused_from"] == first["run_id"]
    version.write_text("2.0\n")
    second = ws.run(resume=first["run_id"])
    assert _ran(second) == {"a"}
    (venv / "tool.py").write_text("T = 2\n")  # ignored by git, yet declared
    third = ws.run(resume=second["run_id"])
    assert _ran(third) == {"a"}
    ws.project([check("a", repos=["app"], runtime_inputs=[{"argv": ["no-such-tool-xyz"]}])])
    broken = ws.run()
    assert by_id(broken)["a"]["status"] == "failed"
    assert "could not probe the stage's runtime inputs" in by_id(broken)["a"]["error"]


# --- 7. an empty plan -------------------------------------------------------------------


def test_an_empty_plan_is_not_a_pass(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
    # Nothing is uncommitted, so --changed selects nothing (the old runner exited 0).
    assert ratchet_main([*common, "run", "--changed"]) == 2
    err = capsys.readouterr().err
    assert "the plan selects no checks" in err
    assert "--allow-empty" in err
    assert ratchet_main([*common, "run", "--changed", "--allow-empty", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "passed"


# --- 8. non-UTF-8 file names ------------------------------------------------------------


def test_a_non_utf8_file_name_is_hashed_and_named(two_repos: Workspace) -> None:
    ws = two_repos
    name = os.fsdecode(b"data-\xff.bin")
    (ws.root / "app" / name).write_bytes(b"one")
    ws.project([check("a", repos=["app"])])
    first = ws.run()  # the old runner aborted every run here, naming nothing
    assert first["status"] == "passed"
    (ws.root / "app" / name).write_bytes(b"two")
    second = ws.run(resume=first["run_id"])
    assert _ran(second) == {"a"}
    reasons = runner.explain(ws.root, ws.state_dir, second["run_id"], "a")["reasons"]
    assert "input file app/data-\\xff.bin [non-UTF-8 name] modified" in reasons


# --- for CI ---------------------------------------------------------------------------


def test_resume_latest_changed_base_and_junit(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("b", "raise SystemExit(3)", repos=["lib"])])
    common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
    assert ratchet_main([*common, "run", "--resume", "latest"]) == 2
    assert "--resume latest: no finished run" in capsys.readouterr().err
    summary = ws.control / "summary.md"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    junit = ws.control / "junit.xml"
    assert ratchet_main([*common, "run", "--no-cache", "--junit", str(junit), "--json"]) == 1
    captured = capsys.readouterr()
    first = json.loads(captured.out)
    assert "::error title=ratchet checks: b::command exited with status 3" in captured.err
    xml = junit.read_text()
    assert '<testcase classname="ratchet.checks" name="b"' in xml
    assert "command exited with status 3" in xml
    assert "| b | failed |" in summary.read_text()
    assert ratchet_main([*common, "run", "--no-cache", "--resume", "latest", "--json"]) == 1
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["resumed_from"] == first["run_id"]
    assert by_id(resumed)["a"]["reused_from"] == first["run_id"]

    # --changed --base: committed changes since a commit count, not only uncommitted ones.
    for repo in ("app", "lib"):
        _git(ws.root / repo, "tag", "base")
    ws.write("lib/lib.py", "Y = 9\n")
    _git(ws.root / "lib", "-c", "commit.gpgsign=false", "commit", "-qam", "change")
    assert ratchet_main([*common, "run", "--changed", "--json"]) == 2  # nothing uncommitted
    capsys.readouterr()
    assert ratchet_main([*common, "run", "--changed", "--base", "base", "--json"]) == 1
    assert [s["id"] for s in json.loads(capsys.readouterr().out)["stages"]] == ["b"]
    assert ratchet_main([*common, "run", "--changed", "--base", "nope"]) == 2
    assert "has no commit 'nope'" in capsys.readouterr().err


def test_dry_run_predicts_reuse_with_reasons_and_writes_nothing(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project(
        [
            check("a", repos=["app"]),
            check("b", repos=["lib"]),
            check("c", repos=["app"], deps=["b"]),
        ]
    )
    first = ws.run()
    ws.write("lib/lib.py", "Y = 3\n")
    runs = sorted((ws.state_dir / "runs").iterdir())
    plan = ws.run(resume=first["run_id"], dry_run=True)
    assert sorted((ws.state_dir / "runs").iterdir()) == runs
    got = {s["id"]: (s["prediction"], s["reasons"]) for s in plan["stages"]}
    assert got["a"] == ("reuse", [f"its checkpoint in run {first['run_id']} matches"])
    assert got["b"] == ("run", ["input file lib/lib.py modified"])
    assert got["c"] == ("run", ["dependency 'b' would run, so what it produces is new"])
    common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
    assert ratchet_main([*common, "run", "--dry-run", "--resume", "latest", "--json"]) == 0
    predicted = by_id(json.loads(capsys.readouterr().out))
    # The command line also asks the cache (read-only in a dry run), and says so.
    assert predicted["b"]["reasons"] == ["input file lib/lib.py modified", "cache: no cache entry"]
    # What it predicted is what a run then does.
    real = ws.run(resume=first["run_id"])
    assert _ran(real) == {"b", "c"}
    assert _reused(real) == {"a"}
