"""Defects a user-level review of `ratchet checks` found, one test (or a few) each, on real
git repositories through the command line (`ratchet checks ...` in process, as
`test_checks_review.py` does)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from checks_helpers import Workspace, by_id, check

from ratchet.checks._run import _log_name
from ratchet.checks.common import read_json, state_root
from ratchet.cli import main as ratchet_main


def _common(ws: Workspace) -> list[str]:
    return ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]


def _run(ws: Workspace, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    """`ratchet checks run --json EXTRA`: the receipt."""
    ratchet_main([*_common(ws), "run", "--json", *extra])
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def _explain(
    ws: Workspace, capsys: pytest.CaptureFixture[str], run_id: str, stage: str
) -> tuple[str, dict[str, Any]]:
    """`ratchet checks explain RUN STAGE`: its text (as `--json` has it: the terminal wraps
    it), and its `--json` answer."""
    assert ratchet_main([*_common(ws), "explain", run_id, stage]) == 0
    printed = capsys.readouterr().out
    assert ratchet_main([*_common(ws), "--json", "explain", run_id, stage]) == 0
    answer: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert "".join(printed.split()) == "".join(answer["text"].split())
    return answer["text"], answer


# --- explain says why the cache did not serve a stage --------------------------------------


def test_explain_names_a_damaged_cache_entry_or_altered_log_as_the_reason_a_stage_ran(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    first = _run(ws, capsys)
    (entry,) = sorted((ws.state_dir / "cache" / "entries").glob("*/*.json"))
    damaged = read_json(entry)
    damaged["origin_run_id"] = "someone-else"  # the seal no longer matches
    entry.write_text(json.dumps(damaged))
    second = _run(ws, capsys)
    assert by_id(second)["a"].get("cache_hit") is None
    text, answer = _explain(ws, capsys, second["run_id"], "a")
    assert "does not match its seal" in answer["cache"]
    assert f"- cache: cache entry {entry} does not match its seal" in text
    assert answer["reasons"][-1] == f"cache: {answer['cache']}"

    # The re-run stored a good entry again; now its log blob is altered.
    log_sha = by_id(first)["a"]["log_sha256"]
    with open(ws.state_dir / "cache" / "blobs" / log_sha[:2] / log_sha, "ab") as blob:
        blob.write(b"x")
    third = _run(ws, capsys)
    assert by_id(third)["a"].get("cache_hit") is None
    text, answer = _explain(ws, capsys, third["run_id"], "a")
    assert "was altered" in answer["cache"] and "was altered" in text


def test_explain_names_the_input_that_changed_since_the_last_cached_checkpoint(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("b", repos=["lib"])])
    first = _run(ws, capsys)
    shutil.move(ws.root / "app" / "main.py", ws.root / "app" / "renamed.py")
    second = _run(ws, capsys)  # no --resume
    assert by_id(second)["b"]["cache_hit"] is True
    text, answer = _explain(ws, capsys, second["run_id"], "a")
    assert answer["cache"] == "no cache entry"
    assert answer["compared_with"] == first["run_id"]
    assert "input file app/renamed.py added" in answer["reasons"]
    assert any(r.startswith("input file app/main.py ") for r in answer["reasons"])
    assert f"that of run {first['run_id']} (this stage's last verified checkpoint)" in text
    assert "- input file app/renamed.py added" in text
    # A dry run says the same before running anything.
    dry = _run(ws, capsys, "--dry-run")
    assert "input file app/renamed.py added" not in by_id(dry)["a"]["reasons"]  # cached now
    (ws.root / "app" / "renamed.py").write_text("print('changed')\n")
    dry = _run(ws, capsys, "--dry-run")
    assert "input file app/renamed.py modified" in by_id(dry)["a"]["reasons"]


def test_explain_says_the_entry_is_gone_when_the_key_is_unchanged(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    first = _run(ws, capsys)
    shutil.rmtree(ws.state_dir / "cache" / "entries")
    second = _run(ws, capsys)
    _, answer = _explain(ws, capsys, second["run_id"], "a")
    assert answer["compared_with"] == first["run_id"] and answer["changes"] == []
    same = f"run {first['run_id']} left a verified checkpoint with this same cache key"
    assert same in answer["reasons"][-1]


def test_explain_says_the_cache_was_off_or_not_asked(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("n", repos=["lib"], reuse="never")])
    result = _run(ws, capsys, "--no-cache")
    text, answer = _explain(ws, capsys, result["run_id"], "a")
    assert answer["cache"] == "the cache is off (--no-cache)"
    assert "- cache: the cache is off (--no-cache)" in text
    result = _run(ws, capsys)
    _, answer = _explain(ws, capsys, result["run_id"], "n")
    assert answer["cache"] == "not asked (reuse is 'never')"


# --- a very long check id or resource name is a file name that fits ------------------------


def test_a_very_long_check_id_or_resource_name_runs_with_a_capped_unique_file_name(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    long_a, long_b = "x" * 300, "x" * 299 + "y"  # the same first 64 characters
    resource = "r" * 300
    ws.project(
        [
            check(long_a, "print('a')", repos=["app"], resources=[resource]),
            check(long_b, "print('b')", repos=["app"], resources=[resource + "!"]),
        ]
    )
    result = _run(ws, capsys)
    assert result["status"] == "passed", result
    logs = {Path(s["log_path"]).name: Path(s["log_path"]) for s in result["stages"]}
    assert len(logs) == 2 and all(len(name) < 100 for name in logs)
    assert {p.read_text() for p in logs.values()} == {"a\n", "b\n"}
    assert all(name.startswith("x" * 64 + "-") for name in logs)
    machine = Path(os.environ["RATCHET_CHECKS_LOCK_DIR"])
    for folder in (state_root(ws.root) / "resource-locks", *machine.iterdir()):
        locks = sorted(p.name for p in folder.iterdir())
        assert len(locks) == 2 and all(len(n) < 100 and n.startswith("r" * 64) for n in locks)
    # Short names keep the files they always had.
    assert _log_name("build") == "build.log" and _log_name("../x") == ".._x-d6b96a97.log"


# --- a cwd that is not a folder is named as such ------------------------------------------


def test_a_cwd_that_does_not_exist_is_refused_before_any_stage_runs(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    marker = ws.control / "ran"
    (ws.root / "afile").write_text("x")
    for cwd, what in (("nope", "does not exist"), ("afile", "is not a folder")):
        ws.project(
            [
                check("first", f"open({str(marker)!r}, 'w')", repos=["app"]),
                {"id": "y", "argv": ["true"], "cwd": cwd},
            ]
        )
        for extra in ([], ["--dry-run"]):
            assert ratchet_main([*_common(ws), "run", *extra]) == 2
            err = capsys.readouterr().err
            assert (
                f"checks.project.json: checks[1].cwd (check 'y'): '{cwd}' ({ws.root / cwd}) " in err
            )
            assert f"{what}, and no stage runs before this one to make it" in err
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
            assert "could not run" not in err
    assert not marker.exists() and not (ws.state_dir / "runs").exists()


def test_a_cwd_an_earlier_stage_makes_is_checked_when_the_stage_starts(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    make = "import os; os.makedirs('build', exist_ok=True)"  # outside every scope below
    ws.project(
        [
            check("configure", make, repos=["app"]),
            check("test", cwd="build", repos=["lib"], after=["configure"]),
            check("other", cwd="elsewhere", repos=["lib"], after=["configure"]),
            check(
                "probe",
                cwd="gone",
                repos=["lib"],
                after=["configure"],
                runtime_inputs=[{"argv": ["true"]}],
            ),
        ]
    )
    result = _run(ws, capsys, "--no-cache")
    stages = by_id(result)
    assert stages["test"]["status"] == "passed"  # configure made its cwd first
    assert stages["other"]["status"] == "failed"
    error = stages["other"]["error"]
    assert error.startswith(f"its cwd 'elsewhere' ({ws.root / 'elsewhere'}) does not exist when")
    assert "could not run" not in error
    probe = stages["probe"]["error"]
    assert "its cwd 'gone' (" in probe and "its runtime input commands cannot run" in probe


# --- small usage errors --------------------------------------------------------------------


@pytest.mark.parametrize("spelling", [["--resume", ""], ["--resume="]], ids=["space", "equals"])
def test_an_empty_resume_run_id_is_a_usage_error(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str], spelling: list[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    assert ratchet_main([*_common(ws), "run", "--no-cache", *spelling]) == 2
    err = capsys.readouterr().err
    assert err == (
        "ratchet checks: error: --resume: an empty run id; pass a run id (`ratchet checks "
        "list` shows them) or 'latest', or leave --resume out for a run that resumes nothing\n"
    )
    assert not (ws.state_dir / "runs").exists()


def test_a_project_option_naming_a_folder_says_a_project_file_is_expected(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    for command in (["run", "--no-cache"], ["list"]):
        assert ratchet_main([*_common(ws), "--project", str(ws.control), *command]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"ratchet checks: error: --project {ws.control} is a folder; a project file is "
            f"expected there (e.g. {ws.control / 'checks.project.json'})\n"
        )


def test_control_characters_in_a_check_id_are_escaped_in_the_table(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ids = ["a\x1b[31mb", "c\nd", "[bold]e"]
    ws.project([check(cid, repos=["app"]) for cid in ids])
    assert ratchet_main([*_common(ws), "run", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "c\nd" not in out
    for shown in ("a\\x1b[31mb", "c\\nd", "[bold]e"):
        assert shown in out
    # The receipt (and --json) keep the ids as they are.
    result = _run(ws, capsys, "--no-cache")
    assert [s["id"] for s in result["stages"]] == ids
    assert ratchet_main([*_common(ws), "list"]) == 0
    listed = capsys.readouterr().out
    assert "\x1b" not in listed and "  c\\nd: " in listed
    assert ratchet_main([*_common(ws), "explain", result["run_id"], "c\nd"]) == 0
    assert "stage c\\nd: passed" in capsys.readouterr().out
