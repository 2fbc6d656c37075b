"""Defects a review of `ratchet checks` found, one test each, on real git repositories
through the command line (`ratchet checks ...` in process, as the other CLI tests do)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from checks_helpers import Workspace, by_id, check

from ratchet.checks import ProjectError, ReceiptError, load_project
from ratchet.checks._plan import validate_project
from ratchet.cli import main as ratchet_main

KEY = "k" * 32


def _common(ws: Workspace) -> list[str]:
    return ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]


# --- a receipt belongs to its run folder -------------------------------------------------


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_a_receipt_copied_into_another_run_folder_is_refused(
    two_repos: Workspace,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    signed: bool,
) -> None:
    ws = two_repos
    if signed:
        monkeypatch.setenv("RATCHET_CHECKS_SIGNING_KEY", KEY)
    flag = ws.control / "fail"
    ws.project([check("t", f"import os, sys; sys.exit(os.path.exists({str(flag)!r}))")])
    common = _common(ws)
    assert ratchet_main([*common, "run", "--no-cache", "--json"]) == 0
    good = json.loads(capsys.readouterr().out)
    flag.touch()
    assert ratchet_main([*common, "run", "--no-cache", "--json"]) == 1
    bad = json.loads(capsys.readouterr().out)
    # Someone who can write the state folder passes the failed run off as the passed one.
    shutil.copyfile(good["receipt_path"], bad["receipt_path"])

    with pytest.raises(ReceiptError, match=f"receipt of run '{good['run_id']}', not of run"):
        ws.receipt(bad["run_id"])
    assert ratchet_main([*common, "list", "--json"]) == 0
    runs = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert runs[bad["run_id"]]["status"] == "untrusted"
    assert runs[good["run_id"]]["status"] == "passed"
    assert ratchet_main([*common, "explain", bad["run_id"], "t"]) == 2
    err = capsys.readouterr().err
    assert bad["run_id"] in err and good["run_id"] in err and "Traceback" not in err
    assert ratchet_main([*common, "run", "--no-cache", "--resume", bad["run_id"]]) == 2
    assert "not trusted" in capsys.readouterr().err


# --- gc keeps the evidence kept runs reuse ---------------------------------------------


def test_gc_in_the_ci_loop_keeps_the_run_folders_whose_logs_kept_runs_reuse(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("t", repos=["app"])])
    common = _common(ws)
    assert ratchet_main([*common, "run", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    for _ in range(3):  # the documented CI loop
        assert ratchet_main([*common, "run", "--resume", "latest", "--json"]) == 0
        resumed = json.loads(capsys.readouterr().out)
        assert by_id(resumed)["t"]["log_path"] == by_id(first)["t"]["log_path"]
        assert ratchet_main([*common, "gc", "--keep-runs", "2", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
    assert report["kept_referenced_runs"] == [first["run_id"]]
    assert f"whose logs kept runs reuse ({first['run_id']})" in report["text"]
    assert ratchet_main([*common, "run", "--resume", "latest", "--json"]) == 0
    assert by_id(json.loads(capsys.readouterr().out))["t"]["status"] == "passed"
    runs = sorted(p.name for p in (ws.state_dir / "runs").iterdir())
    assert len(runs) == 4 and first["run_id"] in runs  # 2 kept, the one they reuse, the last


@pytest.mark.parametrize("what", ["missing", "a file"])
def test_gc_on_a_state_dir_that_is_not_there_is_a_usage_error(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str], tmp_path: Path, what: str
) -> None:
    wrong = tmp_path / "mistyped"
    if what == "a file":
        wrong.write_text("")
    argv = ["checks", "--workspace-root", str(two_repos.root), "--state-dir", str(wrong), "gc"]
    assert ratchet_main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"--state-dir {wrong} {'does not exist' if what == 'missing' else 'is not a folder'}" in err
    )
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not wrong.is_dir()


def test_gc_keeps_the_cache_blob_a_kept_run_reuses_as_its_log(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("t", repos=["app"])])
    common = _common(ws)
    assert ratchet_main([*common, "run", "--json"]) == 0
    capsys.readouterr()
    assert ratchet_main([*common, "run", "--json"]) == 0  # reused from the cache
    second = json.loads(capsys.readouterr().out)
    assert "blobs" in Path(by_id(second)["t"]["log_path"]).parts
    assert ratchet_main([*common, "gc", "--keep-runs", "1", "--max-age-days", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["removed_entries"], report["removed_blobs"]) == (1, 0)
    assert ratchet_main([*common, "run", "--resume", second["run_id"], "--json"]) == 0
    assert by_id(json.loads(capsys.readouterr().out))["t"]["reused_from"] == second["run_id"]


# --- CI reports of a log with terminal colours, control characters and backticks ----------

_NOISY = (
    "import sys\n"
    "sys.stdout.write('\\x1b[31mFAILED\\x1b[0m test_x\\n')\n"
    "sys.stdout.write('bell \\x07 nul \\x00 end\\n')\n"
    "sys.stdout.write('````\\nnot code\\n')\n"
    "sys.exit(1)\n"
)


def test_junit_and_the_step_summary_survive_a_log_with_escapes_and_fences(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from xml.etree import ElementTree as ET

    ws = two_repos
    ws.project([check("test", _NOISY, repos=["app"])])
    summary = ws.control / "summary.md"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    junit = ws.control / "junit.xml"
    assert ratchet_main([*_common(ws), "run", "--no-cache", "--junit", str(junit)]) == 1
    capsys.readouterr()
    failure = ET.parse(junit).find(".//failure")  # well-formed XML
    assert failure is not None and failure.text is not None
    assert "FAILED test_x" in failure.text  # the colours are gone
    assert "bell \\x07 nul \\x00 end" in failure.text  # other control characters escaped
    text = summary.read_text()
    # The tail holds a line of four backticks, so the fence is five: it ends after the tail.
    assert "`````\nFAILED test_x\n" in text
    assert text.rstrip().endswith("not code\n`````\n</details>")


# --- a state folder that cannot be used is named as such ----------------------------------


def test_a_bad_state_dir_is_named_with_its_fix(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    afile = ws.control / "afile"
    afile.write_text("x")
    for bad, reason in ((afile, "it is a file, not a folder"), (afile / "sub", "Not a directory")):
        for extra in ([], ["--dry-run"]):
            argv = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(bad), "run"]
            assert ratchet_main([*argv, "--no-cache", *extra]) == 2
            err = capsys.readouterr().err
            assert f"--state-dir {bad} cannot be used: " in err and reason in err
            assert "pass --state-dir a folder you can write" in err
            assert ".gitignore" not in err and len(err.strip().splitlines()) == 1


# --- a malformed project file: one line naming the field, exit 2 -------------------------

_HEAD = '{"schema_version": 1, "name": "x", "repositories": [{"name": "app", "path": "app"}], '


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            _HEAD + '"checks": [{"id": "c", "argv": ["true"], "timeout_seconds": NaN}]}',
            "checks[0].timeout_seconds: NaN is not a JSON number; write a finite number",
        ),
        (
            _HEAD + '"checks": [{"id": "c", "argv": ["true"], "timeout_seconds": -Infinity}]}',
            "checks[0].timeout_seconds: -Infinity is not a JSON number",
        ),
        (
            _HEAD + '"checks": [{"id": "\\ud800", "argv": ["true"]}]}',
            "checks[0].id: '\\ud800' holds a lone surrogate (not valid Unicode)",
        ),
        (
            _HEAD + '"checks": [{"id": "c", "argv": ["echo", "\\udfff"]}]}',
            "checks[0].argv[1]: '\\udfff' holds a lone surrogate",
        ),
        (
            _HEAD + '"checks": [{"id": "c", "id": "d", "argv": ["true"]}]}',
            "checks[0]: key 'id' appears twice; keep one",
        ),
        (
            _HEAD + '"checks": [{"id": "c", "argv": ["true"]}], "checks": []}',
            "project: key 'checks' appears twice",
        ),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply to read"),
    ],
    ids=["nan", "infinity", "surrogate-id", "surrogate-argv", "dup-key", "dup-top", "deep"],
)
def test_a_malformed_project_file_is_one_line_naming_the_field(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    ws = two_repos
    (ws.root / "checks.project.json").write_text(text)
    assert ratchet_main([*_common(ws), "run", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert f"checks.project.json: {message}" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_escaped_surrogate_pair_is_read_as_its_character(two_repos: Workspace) -> None:
    ws = two_repos
    (ws.root / "checks.project.json").write_text(
        _HEAD + '"checks": [{"id": "c", "title": "\\ud83d\\ude00", "argv": ["true"]}]}'
    )
    assert load_project(ws.root / "checks.project.json")["checks"][0]["title"] == "\U0001f600"


def test_a_hand_built_project_with_an_infinite_timeout_is_refused() -> None:
    raw = json.loads(_HEAD + '"checks": [{"id": "c", "argv": ["true"]}]}')
    raw["checks"][0]["timeout_seconds"] = float("inf")
    with pytest.raises(ProjectError, match="timeout_seconds: must be a positive finite number"):
        validate_project(raw)


# --- explain names the declared component that changed ----------------------------------

_WRITE_OUT = "import pathlib; pathlib.Path('out').mkdir(exist_ok=True); pathlib.Path('out/a.txt').write_text('a')"


def test_explain_names_a_changed_env_value_runtime_input_env_mode_or_outputs(
    ws: Workspace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ws.repo("app", {"main.py": "x\n", ".gitignore": "out/\n"})
    (ws.root / "tool.txt").write_text("v1")  # a runtime input outside every repository
    (ws.root / ".gitignore").write_text("tool.txt\n")

    def project(outputs: list[str]) -> None:
        runtime = [{"path": "tool.txt"}]
        ws.project(
            [
                check(
                    "u",
                    _WRITE_OUT,
                    cwd="app",
                    repos=["app"],
                    env=["FOO"],
                    runtime_inputs=runtime,
                    outputs=outputs,
                )
            ]
        )

    ran: list[str] = []

    def reasons(**overrides: object) -> list[str]:
        result = ws.run(resume=last, cache=False, **overrides)
        ran.append(result["run_id"])
        return list(by_id(result)["u"]["explain"]["reasons"])

    project(["app/out"])
    monkeypatch.setenv("FOO", "1")
    last = ws.run()["run_id"]
    monkeypatch.setenv("FOO", "2")
    assert reasons() == ["declared env variable 'FOO': value changed"]
    last = ws.run(cache=False)["run_id"]
    (ws.root / "tool.txt").write_text("v2")
    assert reasons() == ["runtime input 'tool.txt' changed"]
    last = ws.run(cache=False)["run_id"]
    assert reasons(strict_env=True) == [
        "environment mode changed: inherited -> strict (--strict-env)"
    ]
    project(["app/out/*.txt"])
    got = reasons()
    assert got == ["declared outputs changed: ['app/out'] -> ['app/out/*.txt']"]
    # `explain` reads the same reasons back, and a dry run predicts them.
    rid = ran[-1]
    assert ratchet_main([*_common(ws), "explain", rid, "u"]) == 0
    assert "declared outputs changed" in capsys.readouterr().out
    monkeypatch.delenv("FOO")
    dry = ws.run(resume=rid, dry_run=True, cache=False)
    assert by_id(dry)["u"]["reasons"][0] == "declared env variable 'FOO': now unset"


# --- --junit is checked before the run ---------------------------------------------------


def test_a_junit_path_that_cannot_be_written_is_refused_before_the_run(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    afile = ws.control / "afile"
    afile.write_text("x")
    for bad, message in (
        (ws.control, f"--junit {ws.control} is a folder; give a file path"),
        (afile / "j.xml", f"--junit {afile / 'j.xml'}: {afile} is not a folder"),
    ):
        assert ratchet_main([*_common(ws), "run", "--no-cache", "--junit", str(bad)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    assert not (ws.state_dir / "runs").exists()  # nothing ran
    # Missing parent folders are made, as most CI tools do.
    nested = ws.control / "reports" / "ci" / "checks.xml"
    assert ratchet_main([*_common(ws), "run", "--no-cache", "--junit", str(nested)]) == 0
    assert "<testsuites" in nested.read_text()


# --- a cache that cannot be written says so, once ------------------------------------------


def test_a_cache_that_cannot_be_written_is_one_warning_per_run(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("b", repos=["lib"])])
    blocked = ws.control / "not-a-folder"
    blocked.write_text("x")
    assert ratchet_main([*_common(ws), "run", "--cache-dir", str(blocked), "--json"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warnings) == 1, captured.err
    assert f"the cache {blocked} cannot be written (" in warnings[0]
    assert all(s["cache_error"] for s in json.loads(captured.out)["stages"])
