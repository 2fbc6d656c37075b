"""The project file: validation errors that name the field, and planning."""

from __future__ import annotations

import copy
import json
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
