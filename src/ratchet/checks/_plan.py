"""The project file and the plan: validation with errors that name the field, and stages.

A *check* is what a user writes in the project file; a *stage* is a planned check, a plain
dict the runner executes. Planning selects checks (profile, repository, changed repos),
pulls in their data dependencies and orders them topologically.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from ratchet.checks._errors import ProjectError
from ratchet.store import canonical_json, sha256_bytes

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    import subprocess
    from typing import Any

SCHEMA_VERSION = 1
DEFAULT_TIMEOUT_SECONDS = 3600.0
REUSE_POLICIES = ("auto", "never")
_INF = float("inf")

_PROJECT_FIELDS = {"schema_version", "name", "description", "repositories", "checks", "profiles"}
_REPO_FIELDS = {"name", "path"}
_CHECK_FIELDS = {
    "id",
    "title",
    "description",
    "argv",
    "cwd",
    "repos",
    "deps",
    "after",
    "resources",
    "reuse",
    "timeout_seconds",
    "outputs",
    "env",
    "runtime_inputs",
}
_OPTIONAL_FIELDS = ("outputs", "env", "runtime_inputs")
_STAGE_FIELDS = {
    "outputs",
    "env",
    "runtime_inputs",
    "id",
    "title",
    "argv",
    "cwd",
    "timeout_seconds",
    "inputs",
    "deps",
    "after",
    "resources",
    "reuse",
}


def _fail(field: str, message: str) -> ProjectError:
    return ProjectError(f"{field}: {message}")


def _string_list(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _fail(field, f"must be a list of non-empty strings, got {value!r}")
    if len(set(value)) != len(value):
        raise _fail(field, f"lists a name twice: {value!r}")
    return list(value)


def _relative_path(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(
            field, f"must be a non-empty path relative to the workspace root, got {value!r}"
        )
    if os.path.isabs(value) or ".." in Path(value).parts:
        raise _fail(field, f"must stay inside the workspace root, got {value!r}")
    return value


def _unknown(obj: Mapping[str, Any], allowed: set[str], field: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise _fail(field, f"unknown field {extra[0]!r} (known: {', '.join(sorted(allowed))})")


def load_project(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a project file; every error names the offending field."""
    p = Path(path)
    try:
        raw = _read_project_json(p)
    except FileNotFoundError as exc:
        raise ProjectError(f"{p}: project file not found") from exc
    except IsADirectoryError:
        raise ProjectError(
            f"--project {p} is a folder; a project file is expected there (e.g. "
            f"{p / 'checks.project.json'})"
        ) from None
    except OSError as exc:
        raise ProjectError(
            f"--project {p}: the project file cannot be read ({exc.strerror or exc}); "
            "pass --project a project file you can read"
        ) from None
    except ProjectError as exc:
        raise ProjectError(f"{p}: {exc}") from None
    except ValueError as exc:
        raise ProjectError(str(exc)) from exc
    try:
        return validate_project(raw)
    except ProjectError as exc:
        raise ProjectError(f"{p}: {exc}") from None


class _Constant:
    """What `NaN`, `Infinity` or `-Infinity` (which Python's JSON reader takes, and JSON
    does not have) parse to, so the field holding one can be named."""

    def __init__(self, text: str) -> None:
        self.text = text


class _Duplicated(dict):  # type: ignore[type-arg]
    """An object in which key `key` appears twice: refused, where `json` lets the later
    one win (a typo would then be silently ignored)."""

    key = ""


# A \\uD800-\\uDFFF escape: the only way a UTF-8 project file can hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _read_project_json(p: Path) -> Any:
    """Parse a project file, refusing (ProjectError naming the field) what Python's JSON
    reader would take silently or fail on without saying where: a duplicated key,
    NaN/Infinity, a lone surrogate (no command can be given one), or nesting too deep to
    parse. The walk that names the field runs only when one of them is there."""
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProjectError(f"is not UTF-8 ({exc}); save it as UTF-8") from None
    flagged: list[bool] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(items)
        if len(obj) == len(items):
            return obj
        flagged.append(True)
        dup = _Duplicated(obj)
        seen: set[str] = set()
        for k, _ in items:
            if k in seen:
                dup.key = k
                break
            seen.add(k)
        return dup

    def constant(name: str) -> _Constant:
        flagged.append(True)
        return _Constant(name)

    try:
        raw = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON ({exc})") from exc
    except RecursionError:
        raise ProjectError(
            "nested too deeply to read (arrays or objects inside each other too many times); "
            "a project file needs only a few levels"
        ) from None
    if flagged or _SURROGATE_ESCAPE.search(text):
        _refuse_values(raw)
    return raw


_WRITE = "write the character itself, or a valid surrogate pair"


def _refuse_values(raw: Any) -> None:
    """Raise ProjectError naming the first field (in file order) holding a duplicated
    key, NaN/Infinity, or a string that is not valid Unicode; walked without recursion."""
    todo: list[tuple[str, Any]] = [("project", raw)]
    while todo:
        field, value = todo.pop()
        if isinstance(value, _Constant):
            raise _fail(field, f"{value.text} is not a JSON number; write a finite number")
        if isinstance(value, str) and not _is_unicode(value):
            raise _fail(field, f"{value!r} holds a lone surrogate (not valid Unicode); {_WRITE}")
        if isinstance(value, _Duplicated):
            raise _fail(
                field, f"key {value.key!r} appears twice; keep one (the later would silently win)"
            )
        if isinstance(value, dict):
            for key in reversed(list(value)):
                if not _is_unicode(key):
                    raise _fail(field, f"key {key!r} holds a lone surrogate; {_WRITE}")
                todo.append((key if field == "project" else f"{field}.{key}", value[key]))
        elif isinstance(value, list):
            todo.extend((f"{field}[{i}]", item) for i, item in reversed(list(enumerate(value))))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate_project(raw: Any) -> dict[str, Any]:
    """Validate a parsed project file and return it normalised (defaults filled in)."""
    if not isinstance(raw, dict):
        raise _fail("project", "must be a JSON object")
    _unknown(raw, _PROJECT_FIELDS, "project")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise _fail(
            "schema_version",
            f"unsupported schema version {version!r} (this ratchet reads {SCHEMA_VERSION})",
        )
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise _fail("name", f"must be a non-empty string, got {name!r}")

    repos_raw = raw.get("repositories")
    if not isinstance(repos_raw, list):
        raise _fail("repositories", "must be a list of {name, path} objects")
    repositories: list[dict[str, str]] = []
    seen_repos: set[str] = set()
    for i, repo in enumerate(repos_raw):
        field = f"repositories[{i}]"
        if not isinstance(repo, dict):
            raise _fail(field, "must be an object with 'name' and 'path'")
        _unknown(repo, _REPO_FIELDS, field)
        rname = repo.get("name")
        if not isinstance(rname, str) or not rname:
            raise _fail(f"{field}.name", f"must be a non-empty string, got {rname!r}")
        if rname in seen_repos:
            raise _fail(f"{field}.name", f"duplicate repository name {rname!r}")
        seen_repos.add(rname)
        repositories.append(
            {"name": rname, "path": _relative_path(repo.get("path"), f"{field}.path")}
        )

    checks_raw = raw.get("checks")
    if not isinstance(checks_raw, list):
        raise _fail("checks", "must be a list of check objects")
    checks: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    for i, check in enumerate(checks_raw):
        field = f"checks[{i}]"
        if not isinstance(check, dict):
            raise _fail(field, "must be an object")
        _unknown(check, _CHECK_FIELDS, field)
        cid = check.get("id")
        if not isinstance(cid, str) or not cid:
            raise _fail(f"{field}.id", f"must be a non-empty string, got {cid!r}")
        if cid in index:
            raise _fail(f"{field}.id", f"duplicate id {cid!r} (first at checks[{index[cid]}])")
        index[cid] = i
        normal: dict[str, Any] = {
            "id": cid,
            "title": check.get("title", cid),
            "argv": _argv(check.get("argv"), f"{field}.argv"),
            "cwd": _relative_path(check.get("cwd", "."), f"{field}.cwd"),
            "deps": _string_list(check.get("deps", []), f"{field}.deps"),
            "after": _string_list(check.get("after", []), f"{field}.after"),
            "resources": _string_list(check.get("resources", []), f"{field}.resources"),
            "reuse": _reuse(check.get("reuse", "auto"), f"{field}.reuse"),
            "timeout_seconds": _timeout(
                check.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS), f"{field}.timeout_seconds"
            ),
        }
        normal.update(_optional(check, field))
        if not isinstance(normal["title"], str):
            raise _fail(f"{field}.title", "must be a string")
        if "repos" in check:
            repos = _string_list(check["repos"], f"{field}.repos")
            for r in repos:
                if r not in seen_repos:
                    raise _fail(f"{field}.repos", f"unknown repository {r!r}")
            normal["repos"] = repos
        checks.append(normal)

    for i, check in enumerate(checks):
        for kind in ("deps", "after"):
            for target in check[kind]:
                if target not in index:
                    raise _fail(f"checks[{i}].{kind}", f"unknown dependency {target!r}")
                if target == check["id"]:
                    raise _fail(f"checks[{i}].{kind}", f"check {target!r} depends on itself")
    _check_acyclic(checks, field="checks")

    profiles_raw = raw.get("profiles", {})
    if not isinstance(profiles_raw, dict):
        raise _fail("profiles", "must be an object mapping a profile name to check ids")
    profiles: dict[str, list[str]] = {}
    for pname, ids in profiles_raw.items():
        members = _string_list(ids, f"profiles.{pname}")
        for cid in members:
            if cid not in index:
                raise _fail(f"profiles.{pname}", f"unknown check {cid!r}")
        profiles[pname] = members

    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "repositories": repositories,
        "checks": checks,
        "profiles": profiles,
    }


def _argv(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise _fail(field, f"must be a non-empty list of strings, got {value!r}")
    return list(value)


def _outputs(value: Any, field: str) -> list[str]:
    patterns = _string_list(value, field)
    for i, pattern in enumerate(patterns):
        _relative_path(pattern, f"{field}[{i}]")
    return patterns


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env_names(value: Any, field: str) -> list[str]:
    names = _string_list(value, field)
    for name in names:
        if not _ENV_NAME.match(name):
            raise _fail(field, f"{name!r} is not an environment variable name")
    return names


def _runtime_inputs(value: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise _fail(field, f"must be a list of {{'argv': [...]}} or {{'path': ...}}, got {value!r}")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        here = f"{field}[{i}]"
        if not isinstance(item, Mapping) or len(item) != 1 or set(item) - {"argv", "path"}:
            raise _fail(here, f"must be {{'argv': [...]}} or {{'path': '...'}}, got {item!r}")
        if "argv" in item:
            out.append({"argv": _argv(item["argv"], f"{here}.argv")})
        else:
            out.append({"path": _relative_path(item["path"], f"{here}.path")})
    return out


_OPTIONAL_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "outputs": _outputs,
    "env": _env_names,
    "runtime_inputs": _runtime_inputs,
}


def _optional(raw: Mapping[str, Any], field: str) -> dict[str, Any]:
    """The optional fields `outputs`, `env` and `runtime_inputs`, validated, when present."""
    return {
        key: check(raw[key], f"{field}.{key}")
        for key, check in _OPTIONAL_CHECKS.items()
        if raw.get(key) is not None
    }


def _reuse(value: Any, field: str) -> str:
    if value not in REUSE_POLICIES:
        raise _fail(field, f"must be one of {', '.join(REUSE_POLICIES)}, got {value!r}")
    return str(value)


def _timeout(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < _INF:
        raise _fail(field, f"must be a positive finite number of seconds, got {value!r}")
    return float(value)


def _check_acyclic(nodes: Sequence[Mapping[str, Any]], *, field: str) -> None:
    """Raise naming one cycle (a -> b -> a) over `deps` and `after` edges."""
    edges = {n["id"]: list(n.get("deps", [])) + list(n.get("after", [])) for n in nodes}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, []):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise _fail(field, f"dependency cycle {' -> '.join(cycle)}")
            if state.get(nxt) is None and nxt in edges:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for n in nodes:
        if state.get(n["id"]) is None:
            visit(n["id"])


def topological_order(stages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Stage ids so every stage comes after its `deps` and `after`; ties keep file order."""
    position = {s["id"]: i for i, s in enumerate(stages)}
    waiting = {s["id"]: set(s["deps"]) | set(s["after"]) for s in stages}
    order: list[str] = []
    done: set[str] = set()
    while waiting:
        ready = sorted((sid for sid, w in waiting.items() if w <= done), key=position.__getitem__)
        if not ready:
            _check_acyclic(stages, field="stages")
            raise _fail("stages", "unsatisfiable ordering")
        for sid in ready:
            order.append(sid)
            done.add(sid)
            del waiting[sid]
    return order


def normalize_stages(stages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate hand-built or planned stage dicts and fill in defaults, in topological order."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, raw in enumerate(stages):
        field = f"stages[{i}]"
        if not isinstance(raw, Mapping):
            raise _fail(field, "must be a dict")
        sid = raw.get("id")
        if not isinstance(sid, str) or not sid:
            raise _fail(f"{field}.id", f"must be a non-empty string, got {sid!r}")
        if sid in seen:
            raise _fail(f"{field}.id", f"duplicate id {sid!r}")
        seen.add(sid)
        stage: dict[str, Any] = {
            "id": sid,
            "title": str(raw.get("title") or sid),
            "argv": _argv(raw.get("argv"), f"{field}.argv"),
            "cwd": str(raw.get("cwd") or "."),
            "timeout_seconds": _timeout(
                raw.get("timeout_seconds") or DEFAULT_TIMEOUT_SECONDS, f"{field}.timeout_seconds"
            ),
            "deps": _string_list(list(raw.get("deps") or []), f"{field}.deps"),
            "after": _string_list(list(raw.get("after") or []), f"{field}.after"),
            "resources": _string_list(list(raw.get("resources") or []), f"{field}.resources"),
            "reuse": _reuse(raw.get("reuse") or "auto", f"{field}.reuse"),
        }
        stage.update(_optional(raw, field))
        # Fields this runner does not know are kept (they enter the plan fingerprint).
        for key in sorted(set(raw) - _STAGE_FIELDS):
            stage[key] = raw[key]
        if raw.get("inputs") is not None:
            inputs = raw["inputs"]
            if not isinstance(inputs, Mapping) or set(inputs) - {"repos"}:
                raise _fail(f"{field}.inputs", f"must be {{'repos': [...]}}, got {inputs!r}")
            stage["inputs"] = {
                "repos": _string_list(list(inputs.get("repos") or []), f"{field}.inputs.repos")
            }
        out.append(stage)
    for i, stage in enumerate(out):
        for kind in ("deps", "after"):
            for target in stage[kind]:
                if target not in seen:
                    raise _fail(f"stages[{i}].{kind}", f"unknown dependency {target!r}")
    by_id = {s["id"]: s for s in out}
    return [by_id[sid] for sid in topological_order(out)]


def check_to_stage(check: Mapping[str, Any]) -> dict[str, Any]:
    """Turn a validated check into a stage dict (`repos` becomes the declared input scope)."""
    stage: dict[str, Any] = {
        "id": check["id"],
        "title": check["title"],
        "argv": list(check["argv"]),
        "cwd": check["cwd"],
        "timeout_seconds": check["timeout_seconds"],
        "deps": list(check["deps"]),
        "after": list(check["after"]),
        "resources": list(check["resources"]),
        "reuse": check["reuse"],
    }
    if "repos" in check:
        stage["inputs"] = {"repos": list(check["repos"])}
    for key in _OPTIONAL_FIELDS:
        if key in check:
            stage[key] = check[key]
    return stage


def _git_out(path: Path, *argv: str) -> subprocess.CompletedProcess[bytes]:
    import subprocess  # only `--changed` runs git here

    return subprocess.run(["git", "-C", str(path), *argv], capture_output=True, check=False)


def _changed_in(
    path: Path, base: str | None, what: str, excluded: Sequence[str] | None = None
) -> bool:
    """Whether the folder `path` (less the `excluded` pathspecs under it) has changes: not
    committed ones, or with `base`, anything that differs from that commit (committed or
    not) plus untracked files. Where git cannot tell, it is changed: not a git work tree,
    git failing, or a folder git lists nothing in (one the enclosing repository ignores,
    which a run hashes as a plain folder: ratchet keeps no earlier hash of it to compare
    with before a run, so it is always a candidate, and its cache key decides the rest)."""
    # `-- .`: only this folder (repositories may share one work tree)
    spec = ["--", ".", *(f":(exclude){rel}" for rel in excluded or ())]
    if base is None:
        proc = _git_out(path, "status", "--porcelain", "--untracked-files=all", *spec)
        if proc.returncode != 0 or proc.stdout.strip():
            return True
    else:
        if _git_out(path, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}").returncode:
            raise _fail(
                "base",
                f"{what} ({path}) has no commit {base!r}: fetch it "
                "(e.g. `git fetch origin main`) or pass another --base",
            )
        diff = _git_out(path, "diff", "--quiet", base, *spec)
        others = _git_out(path, "ls-files", "--others", "--exclude-standard", *spec)
        if diff.returncode != 0 or others.returncode != 0 or others.stdout.strip():
            return True
    if excluded is not None:
        return False  # the workspace root: listing nothing of its own is nothing changed
    listed = _git_out(path, "ls-files", "--cached", "--others", "--exclude-standard", *spec)
    return listed.returncode != 0 or not listed.stdout.strip()


def _dirty_repos(
    workspace_root: Path,
    project: Mapping[str, Any],
    base: str | None = None,
    project_file: Path | None = None,
) -> tuple[set[str], bool]:
    """The repositories with changes (see `_changed_in`), and whether the workspace root's
    own files (outside every repository, the project file aside) changed."""
    dirty = {
        repo["name"]
        for repo in project["repositories"]
        if _changed_in(workspace_root / repo["path"], base, f"repository {repo['name']!r}")
    }
    return dirty, _root_changed(workspace_root, project, base, project_file)


def _root_changed(
    workspace_root: Path, project: Mapping[str, Any], base: str | None, project_file: Path | None
) -> bool:
    """Whether the workspace root's own files changed: asked of git when the root is a
    work tree; otherwise any file outside the repositories counts as changed (git cannot
    tell)."""
    root = workspace_root.resolve()
    inside: list[str] = []
    for repo in project["repositories"]:
        try:
            rel = (root / repo["path"]).resolve().relative_to(root).as_posix()
        except ValueError:
            continue  # a repository outside the root holds none of its files
        if rel == ".":
            return False  # the root is a repository: it has no files of its own
        inside.append(rel)
    if project_file is not None:
        with contextlib.suppress(ValueError):
            inside.append(project_file.resolve().relative_to(root).as_posix())
    top = _git_out(root, "rev-parse", "--show-toplevel")
    if top.returncode == 0 and top.stdout.strip():
        return _changed_in(root, base, "the workspace root", excluded=inside)
    skip = {root / rel for rel in inside}
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if here / d not in skip]
        if any(here / f not in skip for f in files):
            return True
    return False


def plan_stages(
    project: Mapping[str, Any],
    *,
    workspace_root: str | os.PathLike[str] = ".",
    profile: str | None = None,
    repos: Sequence[str] | None = None,
    changed: bool = False,
    base: str | None = None,
    project_file: str | os.PathLike[str] | None = None,
) -> list[dict[str, Any]]:
    """Select checks and return their stages in order.

    `profile` picks the listed checks; `repos` picks checks whose scope covers one of those
    repositories (a check without `repos` covers all of them); `changed` picks checks whose
    scope covers a repository with uncommitted changes (or, with `base`, changes since
    that commit), and checks without `repos` when the workspace root's own files changed
    (`project_file` is not one of them), plus their data consumers. Every
    selected check pulls in its `deps` (they produce its inputs); `after` edges to checks
    that are not selected are dropped, since they only order.
    """
    checks = {c["id"]: c for c in project["checks"]}
    all_repos = [r["name"] for r in project["repositories"]]
    selected = list(checks)
    if profile is not None:
        if profile not in project["profiles"]:
            known = ", ".join(sorted(project["profiles"])) or "none"
            raise _fail("profile", f"unknown profile {profile!r} (known: {known})")
        selected = list(project["profiles"][profile])

    def scope(cid: str) -> set[str]:
        return set(checks[cid].get("repos", all_repos))

    if repos:
        for r in repos:
            if r not in all_repos:
                raise _fail("repo", f"unknown repository {r!r} (known: {', '.join(all_repos)})")
        selected = [cid for cid in selected if scope(cid) & set(repos)]
    if changed:
        root = Path(workspace_root)
        # the command line's default project file, when the caller names none
        given = Path(project_file) if project_file else root / "checks.project.json"
        dirty, root_dirty = _dirty_repos(root, project, base, given)
        touched = {
            cid
            for cid in selected
            if scope(cid) & dirty or (root_dirty and "repos" not in checks[cid])
        }
        grew = True
        while grew:
            consumers = {cid for cid in selected if set(checks[cid]["deps"]) & touched}
            grew = not consumers <= touched
            touched |= consumers
        selected = [cid for cid in selected if cid in touched]

    wanted: set[str] = set()
    todo = list(selected)
    while todo:
        cid = todo.pop()
        if cid not in wanted:
            wanted.add(cid)
            todo.extend(checks[cid]["deps"])
    stages = []
    for check in project["checks"]:
        if check["id"] in wanted:
            stage = check_to_stage(check)
            stage["after"] = [a for a in stage["after"] if a in wanted]
            stages.append(stage)
    return normalize_stages(stages)


def plan_fingerprint(stages: Sequence[Mapping[str, Any]]) -> str:
    """A digest of the whole plan: any change to any stage changes it."""
    return sha256_bytes(canonical_json([dict(s) for s in stages]))
