"""Why a stage re-ran or was reused: diffs of cache-key components, in words.

Kept apart from the reuse decision (`_decide`): naming the changed files needs the stored
manifests, which is I/O, while deciding does not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ratchet.checks._errors import ProjectError
from ratchet.checks._receipts import read_receipt
from ratchet.checks.checkpoints import WORKSPACE_REST, diff_manifests
from ratchet.checks.common import printable

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

    from ratchet.checks._protocols import ManifestSource

MAX_FILES = 20


def explain(
    workspace_root: str | os.PathLike[str],
    state_dir: str | os.PathLike[str] | None,
    run_id: str,
    stage_id: str,
) -> dict[str, Any]:
    """Why a stage of a run re-ran or was reused, naming the cache-key component that changed."""
    receipt = read_receipt(Path(workspace_root).resolve(), state_dir, run_id)
    recs = {s.get("id"): s for s in receipt.get("stages", [])}
    if stage_id not in recs:
        known = ", ".join(str(k) for k in recs)
        raise ProjectError(f"stage: run {run_id} has no stage {stage_id!r} (stages: {known})")
    return explain_record(receipt, recs[stage_id])


def diff_identity(
    old: Mapping[str, str] | Any, new: Mapping[str, str] | Any, checkpoints: ManifestSource
) -> list[dict[str, Any]]:
    """The input changes between two identities, down to file paths where manifests allow."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return [{"component": "inputs", "change": "modified"}]
    changes: list[dict[str, Any]] = []
    for repo in sorted(set(old) | set(new)):
        if old.get(repo) == new.get(repo):
            continue
        if repo not in old or repo not in new:
            change = "added to scope" if repo not in old else "removed from scope"
            changes.append({"component": "scope", "repo": repo, "change": change})
            continue
        before = checkpoints.stored_manifest(str(old[repo]))
        after = checkpoints.stored_manifest(str(new[repo]))
        files = diff_manifests(before, after) if before is not None and after is not None else []
        if not files:
            changes.append({"component": "inputs", "repo": repo, "change": "modified"})
        for f in files[:MAX_FILES]:
            changes.append({"component": "inputs", "repo": repo, **f})
        if len(files) > MAX_FILES:
            more = len(files) - MAX_FILES
            changes.append({"component": "inputs", "repo": repo, "change": f"{more} more files"})
    return changes


def diff_components(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    old_env: Any,
    new_env: Any,
    checkpoints: ManifestSource,
) -> list[dict[str, Any]]:
    """Every cache-key component that differs, most fundamental first."""
    changes: list[dict[str, Any]] = []
    if old.get("fingerprint_version") != new.get("fingerprint_version"):
        changes.append({"component": "fingerprint_version", "old": old.get("fingerprint_version")})
    if old.get("command") != new.get("command"):
        changes.append(
            {"component": "command", "old": old.get("command"), "new": new.get("command")}
        )
    if old.get("cwd") != new.get("cwd"):
        changes.append({"component": "cwd", "old": old.get("cwd"), "new": new.get("cwd")})
    if old.get("scope") != new.get("scope"):
        changes.append({"component": "scope", "old": old.get("scope"), "new": new.get("scope")})
    elif old.get("inputs") != new.get("inputs"):
        changes.extend(diff_identity(old.get("inputs"), new.get("inputs"), checkpoints))
    old_deps, new_deps = old.get("deps") or {}, new.get("deps") or {}
    for dep in sorted(set(old_deps) | set(new_deps)):
        if dep not in old_deps:
            changes.append({"component": "dependency", "dependency": dep, "change": "added"})
        elif dep not in new_deps:
            changes.append({"component": "dependency", "dependency": dep, "change": "removed"})
        elif old_deps[dep] != new_deps[dep]:
            changes.append({"component": "dependency", "dependency": dep, "change": "re-ran"})
    if old.get("environment") != new.get("environment"):
        if isinstance(old_env, Mapping) and isinstance(new_env, Mapping):
            keys = sorted(
                k for k in set(old_env) | set(new_env) if old_env.get(k) != new_env.get(k)
            )
            for key in keys:
                changes.append({"component": "environment", "key": key})
            if not keys:
                changes.append({"component": "environment", "key": None})
        else:
            changes.append(
                {
                    "component": "environment",
                    "key": None,
                    "old": old.get("environment"),
                    "new": new.get("environment"),
                }
            )
    changes += _diff_declared(old, new)
    return changes


# The components `_diff_declared` names; `cache_components` adds them only to stages that
# declare them (`env_mode` only under --strict-env).
_DECLARED = ("env", "runtime", "env_mode", "outputs")
_DIFFED = {"fingerprint_version", "command", "cwd", "scope", "inputs", "deps", "environment"}


def _diff_declared(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Changes in the declared `env` values, `runtime_inputs`, env mode and `outputs`, and
    any other component a newer ratchet adds: never just "the cache key changed"."""
    changes: list[dict[str, Any]] = []
    old_env, new_env = old.get("env") or {}, new.get("env") or {}
    for name in sorted(set(old_env) | set(new_env)):
        if name not in old_env or name not in new_env:
            what = "declared" if name not in old_env else "no longer declared"
        elif old_env[name] == new_env[name]:
            continue
        elif old_env[name] is None or new_env[name] is None:
            what = "now set" if old_env[name] is None else "now unset"
        else:
            what = "value changed"
        changes.append({"component": "env", "key": name, "change": what})
    old_rt, new_rt = old.get("runtime") or {}, new.get("runtime") or {}
    for label in sorted(set(old_rt) | set(new_rt)):
        if old_rt.get(label) != new_rt.get(label):
            how = "added" if label not in old_rt else "removed" if label not in new_rt else None
            changes.append({"component": "runtime_input", "input": label, "change": how})
    if old.get("env_mode") != new.get("env_mode"):
        changes.append(
            {
                "component": "env_mode",
                "old": old.get("env_mode") or "inherited",
                "new": new.get("env_mode") or "inherited",
            }
        )
    if old.get("outputs") != new.get("outputs"):
        changes.append(
            {"component": "outputs", "old": old.get("outputs"), "new": new.get("outputs")}
        )
    for name in sorted((set(old) | set(new)) - _DIFFED - set(_DECLARED)):
        if old.get(name) != new.get(name):
            changes.append({"component": name})
    return changes


def describe(change: Mapping[str, Any]) -> str:
    """One change in words, naming the file, env key, dependency or command."""
    kind = change.get("component")
    if kind == "command":
        return f"command changed: {change.get('old')} -> {change.get('new')}"
    if kind == "cwd":
        return f"cwd changed: {change.get('old')!r} -> {change.get('new')!r}"
    if kind == "scope":
        if "repo" in change:
            return f"declared input scope changed: repository {change['repo']!r} {change['change']}"
        return f"declared input scope changed: {change.get('old')} -> {change.get('new')}"
    if kind == "inputs":
        if "path" in change:
            if change["repo"] == WORKSPACE_REST:
                return f"input file {change['path']} (workspace root) {change['change']}"
            return f"input file {change['repo']}/{change['path']} {change['change']}"
        return f"inputs of repository {change.get('repo')!r} changed ({change.get('change')})"
    if kind == "dependency":
        dep, what = change.get("dependency"), change.get("change")
        if what == "re-ran":
            return f"dependency {dep!r} has a new checkpoint (it re-ran)"
        return f"dependency {dep!r} {what}"
    if kind == "environment":
        if change.get("key"):
            return f"environment key {change['key']!r} changed"
        return f"environment fingerprint changed: {change.get('old')} -> {change.get('new')}"
    if kind == "env":
        return f"declared env variable {change.get('key')!r}: {change.get('change')}"
    if kind == "runtime_input":
        label = str(change.get("input"))
        what = change.get("change")
        if label.startswith("argv:"):
            name = f"runtime input command {label[len('argv:') :]}"
            return f"{name} {what}" if what else f"{name}: its exit code or output changed"
        name = f"runtime input {label[len('path:') :]!r}" if label.startswith("path:") else label
        return f"{name} {what}" if what else f"{name} changed"
    if kind == "env_mode":
        return (
            f"environment mode changed: {change.get('old')} -> {change.get('new')} (--strict-env)"
        )
    if kind == "outputs":
        return f"declared outputs changed: {change.get('old')} -> {change.get('new')}"
    if kind == "fingerprint_version":
        return f"fingerprint version changed (was {change.get('old')})"
    return f"{kind} changed"


def summarize(changes: list[dict[str, Any]]) -> str:
    return "; ".join(describe(c) for c in changes) or "identity changed"


def reused_reason(resumed_from: Any) -> str:
    """Why a stage was reused from the run it resumed."""
    return (
        f"cache key matched run {resumed_from} (command, cwd, declared scope, input bytes, "
        "dependency checkpoints, environment) and its log re-hashed to the sha256 the "
        "receipt sealed"
    )


def cache_reasons(info: Mapping[str, Any]) -> list[str]:
    """Why the cache did not serve a stage that ran, from its `explain` record: the miss or
    refusal (`cache`) and, for a key the cache had no entry for, what differs from the
    stage's last verified checkpoint (`compared_with`, `changes`). Without these a plain
    run's stage said only "fresh run", whatever the cache had found."""
    cache = info.get("cache")
    if not cache:
        return []
    since = info.get("compared_with")
    if since is None:
        return [f"cache: {cache}"]
    changes = [c for c in info.get("changes") or [] if isinstance(c, Mapping)]
    if not changes:
        return [
            f"cache: {cache}, though run {since} left a verified checkpoint with this same "
            "cache key (its entry was removed by gc, is in another cache, or was never stored)"
        ]
    head = (
        f"cache: {cache}; this cache key differs from that of run {since} (this stage's last "
        "verified checkpoint) in:"
    )
    return [head, *(describe(c) for c in changes)]


def explain_record(receipt: Mapping[str, Any], record: Mapping[str, Any]) -> dict[str, Any]:
    """The `explain` answer for one stage record of a receipt."""
    info = record.get("explain") or {}
    status = record.get("status")
    decision = info.get("decision")
    reasons = list(info.get("reasons") or [])
    if decision == "reused" and not reasons:  # a receipt written before reasons were kept
        reasons.append(reused_reason(info.get("resumed_from")))
    if decision != "reused":
        reasons += [r for r in cache_reasons(info) if r not in reasons]
    if decision is None:
        decision = "skipped" if status in ("skipped", "pending") else "unknown"
        if record.get("error"):
            reasons.append(str(record["error"]))
    lines = [f"run {receipt.get('run_id')} stage {record.get('id')}: {status} ({decision})"]
    if record.get("reused_from"):
        lines.append(f"  reused from run {record['reused_from']}")
    lines += [f"  - {r}" for r in reasons]
    if record.get("error") and record["error"] not in reasons:
        lines.append(f"  error: {record['error']}")
    if record.get("snapshot_error"):
        lines.append(f"  snapshot: {record['snapshot_error']}")
    return {
        "ok": True,
        "run_id": receipt.get("run_id"),
        "stage": record.get("id"),
        "status": status,
        "decision": decision,
        "resumed_from": info.get("resumed_from"),
        "reasons": reasons,
        "changes": list(info.get("changes") or []),
        "cache": info.get("cache"),
        "compared_with": info.get("compared_with"),
        "text": "\n".join(printable(line) for line in lines),
    }
