"""Helpers for the checks tests: a real workspace of git repositories in tmp_path."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ratchet.checks import plan_stages, runner
from ratchet.checks._plan import load_project

PY = sys.executable


def _git(cwd: Path, *argv: str) -> None:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    subprocess.run(["git", *argv], cwd=cwd, env=env, check=True, capture_output=True)


class Workspace:
    """A workspace root with git repositories, a project file and a state dir."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "ws"
        self.root.mkdir()
        self.state_dir = tmp_path / "state"
        self.control = tmp_path / "control"  # outside every repository: not an input
        self.control.mkdir()
        self.repos: list[dict[str, str]] = []

    def repo(self, name: str, files: Mapping[str, str]) -> Path:
        path = self.root / name
        path.mkdir(parents=True)
        for rel, text in files.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_text(text)
        _git(path, "init", "-q")
        _git(path, "add", "-A")
        _git(path, "-c", "commit.gpgsign=false", "commit", "-q", "-m", "init")
        self.repos.append({"name": name, "path": name})
        return path

    def write(self, rel: str, text: str) -> None:
        (self.root / rel).write_text(text)

    def project(
        self, checks: Iterable[Mapping[str, Any]], profiles: Mapping[str, list[str]] | None = None
    ) -> None:
        data = {
            "schema_version": 1,
            "name": "demo",
            "repositories": self.repos,
            "checks": list(checks),
            "profiles": dict(profiles or {}),
        }
        (self.root / "checks.project.json").write_text(json.dumps(data, indent=2))

    def args(self, **overrides: Any) -> argparse.Namespace:
        values: dict[str, Any] = {
            "workspace_root": str(self.root),
            "project": "checks.project.json",
            "state_dir": str(self.state_dir),
            "dry_run": False,
            "jobs": 1,
            "profile": None,
            "resume": None,
            "repo": None,
            "changed": False,
        }
        values.update(overrides)
        return argparse.Namespace(**values)

    def plan(self, **kw: Any) -> list[dict[str, Any]]:
        return plan_stages(
            load_project(self.root / "checks.project.json"), workspace_root=self.root, **kw
        )

    def run(self, stages: list[dict[str, Any]] | None = None, **overrides: Any) -> dict[str, Any]:
        args = self.args(**overrides)
        if stages is None:
            stages = self.plan(profile=args.profile)
        return runner.run_checks(args, stages)

    def receipt(self, run_id: str) -> dict[str, Any]:
        return runner.read_receipt(self.root, self.state_dir, run_id)


def check(cid: str, code: str = "print('ok')", **fields: Any) -> dict[str, Any]:
    """A project-file check running a Python snippet."""
    return {"id": cid, "argv": [PY, "-c", code], **fields}


def stage(cid: str, code: str = "print('ok')", **fields: Any) -> dict[str, Any]:
    """A hand-built stage dict running a Python snippet."""
    base: dict[str, Any] = {
        "id": cid,
        "title": cid,
        "argv": [PY, "-c", code],
        "cwd": ".",
        "timeout_seconds": 60,
        "deps": [],
        "after": [],
        "resources": [],
    }
    base.update(fields)
    return base


def by_id(result: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["id"]: s for s in result["stages"]}
