"""The project file: validation errors that name the field, and planning."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from checks_helpers import Workspace, check

from ratchet._errors import ConfigError
from ratchet.checks import ProjectError, load_project, plan_stages
from ratchet.checks._plan import normalize_stages, plan_fingerprint, validate_project

REPO_ROOT = Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "schema_version": 1,
    "name": "demo",
    "repositories": [{"name": "app", "path": "app"}, {"name": "lib", "path": "lib"}],
    "checks": [
        {"id": "build", "argv": ["make"], "cwd": "app", "repos": ["app"]},
        {"id": "test", "argv": ["make", "test"], "repos": ["app"], "deps": ["build"]},
        {"id": "lint", "argv": ["ruff"], "repos": ["lib"], "after": ["build"]},
    ],
    "profiles": {"quick": ["lint"], "all": ["build", "test", "lint"]},
}


def _with(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    target: Any = data
    keys = path.split(".")
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target[key]
    last = keys[-1]
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_with("schema_version", 2), "schema_version: unsupported schema version 2"),
        (_with("checks.1.id", "build"), "checks[1].id: duplicate id 'build'"),
        (_with("checks.1.deps", ["nope"]), "checks[1].deps: unknown dependency 'nope'"),
        (_with("checks.2.after", ["ghost"]), "checks[2].after: unknown dependency 'ghost'"),
        (_with("checks.0.deps", ["test"]), "checks: dependency cycle build -> test -> build"),
        (_with("checks.0.repos", ["other"]), "checks[0].repos: unknown repository 'other'"),
        (_with("checks.0.argv", []), "checks[0].argv: must be a non-empty list of strings"),
        (_with("checks.0.cwd", "../outside"), "checks[0].cwd: must stay inside the workspace"),
        (_with("checks.0.reuse", "sometimes"), "checks[0].reuse: must be one of auto, never"),
        (_with("checks.0.timeout_seconds", 0), "checks[0].timeout_seconds: must be a positive"),
        (_with("profiles.quick", ["nope"]), "profiles.quick: unknown check 'nope'"),
        (_with("repositories.1.name", "app"), "repositories[1].name: duplicate repository"),
        (_with("checks.0.dep", ["x"]), "checks[0]: unknown field 'dep'"),
    ],
)
def test_bad_project_file_error_names_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ProjectError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_project(data)


def test_project_error_is_a_config_error_and_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_with("schema_version", 9)))
    with pytest.raises(ConfigError, match=r"p\.json: schema_version"):
        load_project(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_project(path)
    with pytest.raises(ProjectError, match="project file not found"):
        load_project(tmp_path / "missing.json")


def test_stages_are_dicts_in_topological_order_with_declared_scope() -> None:
    stages = plan_stages(validate_project(BASE))
    assert [s["id"] for s in stages] == ["build", "test", "lint"]
    build = stages[0]
    assert build == {
        "id": "build",
        "title": "build",
        "argv": ["make"],
        "cwd": "app",
        "timeout_seconds": 3600.0,
        "inputs": {"repos": ["app"]},
        "deps": [],
        "after": [],
        "resources": [],
        "reuse": "auto",
    }


def test_profile_pulls_in_data_dependencies_and_drops_unselected_after_edges() -> None:
    data = copy.deepcopy(BASE)
    data["profiles"]["t"] = ["test", "lint"]
    project = validate_project(data)
    assert [s["id"] for s in plan_stages(project, profile="quick")] == ["lint"]
    assert plan_stages(project, profile="quick")[0]["after"] == []
    assert [s["id"] for s in plan_stages(project, profile="t")] == ["build", "test", "lint"]
    assert [s["id"] for s in plan_stages(project, repos=["lib"])] == ["lint"]
    with pytest.raises(ProjectError, match="profile: unknown profile 'nope'"):
        plan_stages(project, profile="nope")


def test_changed_selects_checks_over_dirty_repos_and_their_consumers(two_repos: Workspace) -> None:
    ws = two_repos
    ws.project(
        [
            check("a", repos=["app"]),
            check("b", repos=["lib"]),
            check("c", repos=["lib"], deps=["a"]),
        ]
    )
    project = load_project(ws.root / "checks.project.json")
    assert plan_stages(project, workspace_root=ws.root, changed=True) == []
    ws.write("app/main.py", "print('changed')\n")
    planned = plan_stages(project, workspace_root=ws.root, changed=True)
    assert [s["id"] for s in planned] == ["a", "c"]


def test_hand_built_stages_are_validated() -> None:
    with pytest.raises(ProjectError, match=r"stages\[1\]\.deps: unknown dependency 'x'"):
        normalize_stages(
            [{"id": "a", "argv": ["true"]}, {"id": "b", "argv": ["true"], "deps": ["x"]}]
        )
    with pytest.raises(ProjectError, match="dependency cycle"):
        normalize_stages(
            [
                {"id": "a", "argv": ["true"], "after": ["b"]},
                {"id": "b", "argv": ["true"], "deps": ["a"]},
            ]
        )


def test_plan_fingerprint_changes_with_the_plan() -> None:
    one = plan_stages(validate_project(BASE))
    two = copy.deepcopy(one)
    two[0]["argv"] = ["make", "-j2"]
    assert plan_fingerprint(one) == plan_fingerprint(copy.deepcopy(one))
    assert plan_fingerprint(one) != plan_fingerprint(two)


def test_dogfood_project_file_describes_the_repositorys_own_checks() -> None:
    project = load_project(REPO_ROOT / "checks.project.json")
    stages = {s["id"]: s for s in plan_stages(project, profile="test")}
    assert stages["lint"]["argv"] == [".venv/bin/ruff", "check", "src", "tests"]
    assert stages["unit"]["argv"] == [".venv/bin/pytest", "-q", "tests", "-m", "not kill"]
    assert stages["kill"]["argv"] == [".venv/bin/pytest", "-q", "tests", "-m", "kill"]


def test_a_project_file_inside_a_repository_is_not_an_input_of_its_checks(ws: Workspace) -> None:
    """With a repository at the workspace root (ratchet's own layout), editing one check in
    the project file re-ran every check: the file was hashed as one of their inputs."""
    from checks_helpers import _git

    ws.write("src.txt", "v1\n")
    _git(ws.root, "init", "-q")
    ws.repos.append({"name": "main", "path": "."})
    ws.project([check("build", repos=["main"]), check("lint", repos=["main"])])
    _git(ws.root, "add", "-A")
    _git(ws.root, "-c", "commit.gpgsign=false", "commit", "-q", "-m", "init")
    first = ws.run()
    assert first["status"] == "passed"
    ws.project([check("build", repos=["main"]), check("lint", "print('lint 2')", repos=["main"])])
    second = ws.run(resume=first["run_id"])
    stages = {s["id"]: s for s in second["stages"]}
    assert stages["build"]["reused_from"] == first["run_id"]
    assert stages["build"]["explain"]["reasons"][0].startswith(  # it was empty
        f"cache key matched run {first['run_id']}"
    )
    assert not stages["lint"].get("reused_from")
    ws.write("src.txt", "v2\n")  # a real input still counts
    third = ws.run(resume=second["run_id"])
    assert not any(s.get("reused_from") for s in third["stages"])


@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_a_repository_path_that_is_not_a_folder_is_refused(ws: Workspace, kind: str) -> None:
    """It was hashed as one constant, so its checks' results stayed valid whatever happened."""
    ws.repo("api", {"src.txt": "v1\n"})
    ws.repos[0]["path"] = "apii"  # a typo
    if kind == "a file":
        ws.write("apii", "not a folder\n")
    ws.project([check("test", repos=["api"])])
    with pytest.raises(
        ProjectError, match=r"repository 'api' at .*apii (does not exist|is not a folder)"
    ):
        ws.run()


def test_changed_looks_only_at_each_repository_folder_of_a_shared_work_tree(
    ws: Workspace,
) -> None:
    """Two repositories in one git work tree (a monorepo): --changed marked both as changed
    when one was edited (git status saw the whole work tree)."""
    from checks_helpers import _git

    for name in ("api", "web"):
        (ws.root / name).mkdir()
        ws.write(f"{name}/src.txt", "v1\n")
        ws.repos.append({"name": name, "path": name})
    _git(ws.root, "init", "-q")
    ws.project([check("a", repos=["api"]), check("w", repos=["web"])])
    _git(ws.root, "add", "-A")
    _git(ws.root, "-c", "commit.gpgsign=false", "commit", "-q", "-m", "init")
    project = load_project(ws.root / "checks.project.json")
    assert plan_stages(project, workspace_root=ws.root, changed=True) == []
    ws.write("web/src.txt", "v2\n")
    planned = plan_stages(project, workspace_root=ws.root, changed=True)
    assert [s["id"] for s in planned] == ["w"]


def _changed_run(ws: Workspace, *argv: str) -> tuple[int, list[str], str]:
    """`ratchet checks run --changed --json` in its own process: exit code, stage ids run."""
    done = subprocess.run(
        [sys.executable, "-m", "ratchet.checks", "--workspace-root", str(ws.root)]
        + ["--state-dir", str(ws.state_dir), "run", "--changed", "--json", *argv],
        capture_output=True,
        text=True,
        cwd=ws.root,
    )
    assert "Traceback" not in done.stderr, done.stderr
    result = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, [s["id"] for s in result.get("stages", [])], done.stderr


def _monorepo(ws: Workspace, files: dict[str, str], checks: list[dict[str, Any]]) -> None:
    """One git work tree at the root holding `files`, repository `api` and `checks`;
    all committed."""
    from checks_helpers import _git

    for rel, text in {"api/main.py": "print(1)\n", **files}.items():
        (ws.root / rel).parent.mkdir(parents=True, exist_ok=True)
        ws.write(rel, text)
    ws.repos.append({"name": "api", "path": "api"})
    if "evals/data.txt" in files:
        ws.repos.append({"name": "evals", "path": "evals"})
    ws.project(checks)
    _git(ws.root, "init", "-q")
    _git(ws.root, "add", "-A")
    _git(ws.root, "-c", "commit.gpgsign=false", "commit", "-q", "-m", "init")


def test_changed_counts_a_repository_that_is_an_ignored_folder(ws: Workspace) -> None:
    """--changed asked git about an ignored folder declared as a repository: git lists
    nothing in it, so an edit there never selected its checks."""
    _monorepo(
        ws,
        {"evals/data.txt": "v1\n", ".gitignore": "evals/\n"},
        [
            check("build", repos=["api"]),
            check("eval", "print(open('evals/data.txt').read())", repos=["evals"]),
        ],
    )
    ws.write("evals/data.txt", "v2\n")
    code, ran, err = _changed_run(ws)
    assert (code, ran) == (0, ["eval"]), err
    # Git cannot tell whether an ignored folder changed, and the plan keeps no hash of it:
    # it is always a candidate; the run's cache key (which hashes it) decides the rest.
    code, ran, err = _changed_run(ws)
    assert (code, ran) == (0, ["eval"]), err
    project = load_project(ws.root / "checks.project.json")
    planned = plan_stages(project, workspace_root=ws.root, changed=True, base="HEAD")
    assert [s["id"] for s in planned] == ["eval"]


def test_changed_counts_the_workspace_roots_own_files(ws: Workspace) -> None:
    """A check without repos reads the workspace root's own files (tools/ci.sh), but
    --changed only asked git about the repositories: a modified tools/ci.sh selected
    nothing ("the plan selects no checks")."""
    _monorepo(
        ws,
        {"tools/ci.sh": "echo ci\n"},
        [check("build", repos=["api"]), check("ci", "print(open('tools/ci.sh').read())")],
    )
    code, ran, err = _changed_run(ws)
    assert code == 2 and "the plan selects no checks" in err  # nothing changed
    ws.write("tools/ci.sh", "echo ci2\n")
    code, ran, err = _changed_run(ws)
    assert (code, ran) == (0, ["ci"]), err
    project = load_project(ws.root / "checks.project.json")
    planned = plan_stages(project, workspace_root=ws.root, changed=True, base="HEAD")
    assert [s["id"] for s in planned] == ["ci"]
    # The project file is not an input; a repository's change is not the root's own.
    from checks_helpers import _git

    _git(ws.root, "checkout", "--", "tools/ci.sh")
    ws.write("checks.project.json", ws.root.joinpath("checks.project.json").read_text() + " ")
    code, ran, err = _changed_run(ws)
    assert code == 2 and "the plan selects no checks" in err
    ws.write("api/main.py", "print(2)\n")
    code, ran, err = _changed_run(ws)
    assert (code, ran) == (0, ["build", "ci"]), err
