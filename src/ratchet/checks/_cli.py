"""The command-line shell: parse, call the handler, print, exit code.

`ratchet checks` and `python -m ratchet.checks` both come here. The handlers only turn
arguments into calls of the run (`_run`), `recover` and `explain`, with the real seams.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ratchet._errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, RatchetError
from ratchet.checks import _report
from ratchet.checks._errors import ProjectError, ReceiptError
from ratchet.checks._explain import explain
from ratchet.checks._plan import load_project, plan_stages
from ratchet.checks._receipts import read_receipt, state_dir_for
from ratchet.checks._recover import recover
from ratchet.checks._run import project_path, run_checks

__all__ = ["add_common_arguments", "configure", "dispatch", "exit_code", "main", "register"]

_DESCRIPTION = (
    "Incremental, verified check runs: run a project's checks, resume a run re-running only "
    "what changed, recover a crashed run, explain why a stage re-ran."
)


def configure(parser: argparse.ArgumentParser) -> None:
    """Give `parser` the workspace options and the run/recover/explain/list subcommands."""
    add_common_arguments(parser)
    sub = parser.add_subparsers(dest="checks_command", required=True, metavar="COMMAND")
    register(sub)
    parser.set_defaults(func=dispatch)


def exit_code(result: dict[str, Any]) -> int:
    """0 for a passed run (or a successful recover/explain/list), 1 otherwise."""
    if "ok" in result:
        return EXIT_OK if result["ok"] else EXIT_FAILED
    return EXIT_OK if result.get("status") in ("passed", "planned") else EXIT_FAILED


def dispatch(parsed: argparse.Namespace) -> int:
    """Run the chosen handler and print its result; errors print one line and exit 2."""
    try:
        result = parsed.handler(parsed)
    except (RatchetError, ValueError, OSError) as exc:
        print(f"ratchet checks: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if getattr(parsed, "json", False):
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        _report.render(result)
        if result.get("error") and not result.get("stages"):
            print(f"ratchet checks: {result['error']}", file=sys.stderr)
    return exit_code(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ratchet.checks", description=_DESCRIPTION)
    configure(parser)
    parsed = parser.parse_args(argv)
    return int(parsed.func(parsed))


# --- the subcommands ----------------------------------------------------------------------


def _load(parsed: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    root = Path(parsed.workspace_root).resolve()
    path = project_path(root, parsed.project)
    if path is None:
        raise ProjectError("project: no project file given (--project)")
    return root, load_project(path)


def _handle_run(parsed: argparse.Namespace) -> dict[str, Any]:
    root, project = _load(parsed)
    repos = parsed.repo
    if isinstance(repos, str):
        repos = [repos]
    stages = plan_stages(
        project,
        workspace_root=root,
        profile=parsed.profile,
        repos=repos,
        changed=bool(parsed.changed),
    )
    return run_checks(parsed, stages)


def _handle_recover(parsed: argparse.Namespace) -> dict[str, Any]:
    return recover(
        parsed.workspace_root,
        parsed.state_dir,
        parsed.run_id,
        apply=parsed.apply,
        confirm_processes_stopped=parsed.confirm_processes_stopped,
    )


def _handle_explain(parsed: argparse.Namespace) -> dict[str, Any]:
    return explain(parsed.workspace_root, parsed.state_dir, parsed.run_id, parsed.stage)


def _handle_list(parsed: argparse.Namespace) -> dict[str, Any]:
    root, project = _load(parsed)
    state_dir = state_dir_for(root, parsed.state_dir)
    runs = []
    runs_dir = state_dir / "runs"
    if runs_dir.is_dir():
        for child in sorted(runs_dir.iterdir()):
            try:
                receipt = read_receipt(root, state_dir, child.name)
                runs.append({"run_id": child.name, "status": receipt.get("status")})
            except ReceiptError as exc:
                runs.append({"run_id": child.name, "status": "untrusted", "error": str(exc)})
    lines = [f"project {project['name']}: {len(project['checks'])} checks"]
    for c in project["checks"]:
        edges = "".join(
            [
                f"  deps={','.join(c['deps'])}" if c["deps"] else "",
                f"  after={','.join(c['after'])}" if c["after"] else "",
            ]
        )
        lines.append(f"  {c['id']}: {' '.join(c['argv'])}{edges}")
    for name, ids in project["profiles"].items():
        lines.append(f"profile {name}: {', '.join(ids)}")
    for r in runs[-10:]:
        lines.append(f"run {r['run_id']}: {r['status']}")
    return {
        "ok": True,
        "project": project["name"],
        "checks": project["checks"],
        "profiles": project["profiles"],
        "runs": runs,
        "text": "\n".join(lines),
    }


def add_common_arguments(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """The workspace options; on subcommands they default to SUPPRESS, so they may come
    before or after the subcommand name."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--workspace-root", default=default(os.getcwd()), help="workspace root (default: cwd)"
    )
    parser.add_argument(
        "--project",
        default=default("checks.project.json"),
        help="project file, relative to the workspace root (default: checks.project.json)",
    )
    parser.add_argument(
        "--state-dir",
        default=default(None),
        help="where runs and logs live (default: a folder under $XDG_STATE_HOME)",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print the result as JSON"
    )


def register(subparsers: Any) -> None:
    """Add `run`, `recover`, `explain` and `list`; each sets `handler(parsed) -> dict`."""
    run_p = subparsers.add_parser("run", help="run the checks (or resume a run)")
    add_common_arguments(run_p, suppress=True)
    run_p.add_argument("--profile", default=None, help="run only this profile's checks")
    run_p.add_argument(
        "--repo", action="append", default=None, help="only checks covering this repository"
    )
    run_p.add_argument(
        "--changed", action="store_true", help="only checks covering repos with uncommitted changes"
    )
    run_p.add_argument(
        "--resume", default=None, metavar="RUN_ID", help="reuse verified checkpoints"
    )
    run_p.add_argument("--jobs", "-j", type=int, default=1, help="stages run in parallel")
    run_p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    run_p.set_defaults(handler=_handle_run)

    rec_p = subparsers.add_parser("recover", help="mark a crashed run interrupted")
    add_common_arguments(rec_p, suppress=True)
    rec_p.add_argument("run_id", metavar="RUN_ID")
    rec_p.add_argument("--apply", action="store_true", help="change the receipt (default: report)")
    rec_p.add_argument(
        "--confirm-processes-stopped",
        action="store_true",
        help="confirm the run's processes are gone",
    )
    rec_p.set_defaults(handler=_handle_recover)

    exp_p = subparsers.add_parser("explain", help="why a stage re-ran or was reused")
    add_common_arguments(exp_p, suppress=True)
    exp_p.add_argument("run_id", metavar="RUN_ID")
    exp_p.add_argument("stage", metavar="STAGE")
    exp_p.set_defaults(handler=_handle_explain)

    list_p = subparsers.add_parser("list", help="list checks, profiles and recent runs")
    add_common_arguments(list_p, suppress=True)
    list_p.set_defaults(handler=_handle_list)
