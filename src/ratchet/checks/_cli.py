"""The command-line shell: parse, call the handler, print, exit code.

`ratchet checks` and `python -m ratchet.checks` both come here. The handlers only turn
arguments into calls of the run (`_run`), `recover` and `explain`, with the real seams.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

from ratchet._argtypes import whole_number
from ratchet._errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ConfigError, RatchetError
from ratchet.checks import _report
from ratchet.checks._ci import ci_report, write_junit
from ratchet.checks._errors import ProjectError, ReceiptError
from ratchet.checks._explain import explain
from ratchet.checks._plan import load_project, plan_stages
from ratchet.checks._receipts import read_receipt, state_dir_for
from ratchet.checks._recover import recover
from ratchet.checks._run import project_path, run_checks
from ratchet.checks.common import printable, readable_json

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    import argparse
    from typing import Any

__all__ = ["add_common_arguments", "configure", "dispatch", "exit_code", "main", "register"]

_DESCRIPTION = (
    "Incremental, verified check runs: run a project's checks, resume a run re-running only "
    "what changed, recover a crashed run, explain why a stage re-ran."
)


# --jobs: a whole number of stages at once, at least 1 (0 or less used to mean 1).
_jobs = whole_number(1, out_of_range="{n}: at least one stage must be able to run")


def configure(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> None:
    """Give `parser` the workspace options and the run/recover/explain/list subcommands.

    With `argv` (what follows `checks`), only the subcommand it names is built when that
    can be told for sure (`subcommand_of`): building all of them is a few milliseconds of
    every start-up, most of a no-op run's argument parsing."""
    add_common_arguments(parser)
    sub = parser.add_subparsers(dest="checks_command", required=True, metavar="COMMAND")
    register(sub, only=None if argv is None else subcommand_of(argv))
    parser.set_defaults(func=dispatch)


SUBCOMMANDS = ("run", "recover", "explain", "gc", "cache", "list")
# The options of `ratchet checks` itself (`add_common_arguments`) that take a value.
_VALUE_OPTIONS = ("--workspace-root", "--project", "--state-dir")


def subcommand_of(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` (the arguments after `checks`) runs, or None when that is not
    certain without argparse (help, an unknown or ambiguous option): then every subcommand
    is built. Long options may be abbreviated, as argparse allows."""
    args = iter(argv)
    for arg in args:
        if arg == "--json" or (arg.startswith("--") and "=" in arg):
            continue
        if arg.startswith("-"):
            known = [
                o for o in (*_VALUE_OPTIONS, "--json") if arg.startswith("--") and o.startswith(arg)
            ]
            if len(known) != 1:
                return None  # -h, --, an unknown or an ambiguous option: let argparse say
            if known[0] != "--json":
                next(args, None)  # its value
            continue
        return arg if arg in SUBCOMMANDS else None
    return None


def exit_code(result: dict[str, Any]) -> int:
    """0 for a passed run (or a successful recover/explain/list), 1 otherwise."""
    if "ok" in result:
        return EXIT_OK if result["ok"] else EXIT_FAILED
    return EXIT_OK if result.get("status") in ("passed", "planned") else EXIT_FAILED


class RunInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: the run stops as it does on Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _terminate_like_interrupt() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP (what `timeout`, CI cancellation and systemd send) into an
    interrupt of the main thread, so the run kills its stages' process groups and writes an
    `interrupted` receipt. A second signal while that happens is ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if not fired:
            fired.append(signum)
            raise RunInterrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in _TERMINATING}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


_TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def dispatch(parsed: argparse.Namespace) -> int:
    """Run the chosen handler and print its result; errors print one line and exit 2; an
    interrupted run (Ctrl-C, SIGTERM, SIGHUP) exits 128 + the signal number."""
    try:
        with _terminate_like_interrupt():
            result = parsed.handler(parsed)
    except (RatchetError, ValueError, OSError) as exc:
        print(f"ratchet checks: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, RunInterrupted) else int(signal.SIGINT)
        print(
            f"ratchet checks: interrupted by {signal.Signals(signum).name}: the stages' process "
            "groups were killed and the run's receipt says 'interrupted'",
            file=sys.stderr,
        )
        return 128 + signum
    if getattr(parsed, "json", False):
        print(readable_json(result, ensure_ascii=True).decode("ascii"), end="")
    else:
        _report.render(result)
        if result.get("error") and not result.get("stages"):
            print(f"ratchet checks: {result['error']}", file=sys.stderr)
    return exit_code(result)


def main(argv: list[str] | None = None) -> int:
    from ratchet._argparse import Parser

    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(prog="python -m ratchet.checks", description=_DESCRIPTION)
    configure(parser, argv)
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
    if getattr(parsed, "base", None) and not parsed.changed:
        raise ConfigError("--base REF needs --changed (it says what 'changed' is measured from)")
    stages = plan_stages(
        project,
        workspace_root=root,
        profile=parsed.profile,
        repos=repos,
        changed=bool(parsed.changed),
        base=getattr(parsed, "base", None),
        project_file=project_path(root, parsed.project),
    )
    junit = Path(parsed.junit) if getattr(parsed, "junit", None) else None
    if junit is not None:
        _check_junit(junit)
    result = run_checks(parsed, stages)
    if junit is not None:
        try:
            write_junit(result, junit)
        except OSError as exc:
            raise ConfigError(
                f"--junit {junit}: the run ended {result.get('status')} but the report could "
                f"not be written ({exc}); its receipt is {result.get('receipt_path')}"
            ) from exc
    ci_report(result)
    return result


def _check_junit(path: Path) -> None:
    """Refuse, before the run, a --junit path the report could not be written to: else a
    run that passed ends with exit 2 and a bare OS error. Missing parent folders are fine
    (they are made, as most CI tools do), but not a parent that is a file or unwritable."""
    if path.is_dir():
        raise ConfigError(
            f"--junit {path} is a folder; give a file path, e.g. {path / 'checks.xml'}"
        )
    if path.exists():
        if not os.access(path, os.W_OK):
            raise ConfigError(f"--junit {path} is not writable; give a path you can write")
        return
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(
            f"--junit {path}: {parent} is not a folder, so the report cannot go there; "
            "give a path under a folder"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--junit {path}: {parent} is not writable; give a path you can write")


def _handle_recover(parsed: argparse.Namespace) -> dict[str, Any]:
    return recover(
        parsed.workspace_root,
        parsed.state_dir,
        parsed.run_id,
        apply=parsed.apply,
        confirm_processes_stopped=parsed.confirm_processes_stopped,
        stop_stages=getattr(parsed, "stop_stages", False),
    )


def _handle_explain(parsed: argparse.Namespace) -> dict[str, Any]:
    return explain(parsed.workspace_root, parsed.state_dir, parsed.run_id, parsed.stage)


def _handle_gc(parsed: argparse.Namespace) -> dict[str, Any]:
    from ratchet.checks._gc import collect_garbage  # not part of every start-up

    root = Path(parsed.workspace_root).resolve()
    state_dir = state_dir_for(root, parsed.state_dir)
    if parsed.max_age_days < 0 or parsed.keep_runs < 0:
        raise ConfigError("gc: --max-age-days and --keep-runs must not be negative")
    if parsed.state_dir and not state_dir.is_dir():
        # A mistyped folder in a CI clean-up step removed nothing, said so, and exited 0
        # every night while the real one grew.
        raise ConfigError(
            f"gc: --state-dir {state_dir} "
            f"{'is not a folder' if state_dir.exists() else 'does not exist'}: nothing to "
            f"collect there; pass the --state-dir your runs use (without it, the workspace's "
            f"own state folder)"
        )
    where = parsed.cache_dir or os.environ.get("RATCHET_CHECKS_CACHE_DIR")
    cache_root = Path(where) if where else state_dir / "cache"
    return collect_garbage(
        state_dir,
        cache_root,
        max_age_seconds=parsed.max_age_days * 86400.0,
        keep_runs=parsed.keep_runs,
        dry_run=parsed.dry_run,
    )


def _handle_cache_serve(parsed: argparse.Namespace) -> dict[str, Any]:
    from ratchet.checks._server import serve  # http.server only for the server

    try:
        return serve(
            Path(parsed.dir), host=parsed.host, port=parsed.port, read_only=parsed.read_only
        )
    except KeyboardInterrupt:  # a signal before the server listened
        return {"ok": True, "text": "cache server stopped"}


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
        "text": "\n".join(printable(line) for line in lines),
    }


# An option: its flags and `add_argument`'s keywords. The options of `checks run` (and the
# workspace options) are tables, read by argparse and by `read_plain_run` alike.
Option = tuple[tuple[str, ...], "dict[str, Any]"]  # a string: `Any` is not imported


def _common_options() -> list[Option]:
    return [
        (("--workspace-root",), {"default": os.getcwd(), "help": "workspace root (default: cwd)"}),
        (
            ("--project",),
            {
                "default": "checks.project.json",
                "help": "project file, relative to the workspace root (default: "
                "checks.project.json)",
            },
        ),
        (
            ("--state-dir",),
            {
                "default": None,
                "help": "where runs and logs live (default: a folder under $XDG_STATE_HOME)",
            },
        ),
        (
            ("--json",),
            {"action": "store_true", "default": False, "help": "print the result as JSON"},
        ),
    ]


def add_common_arguments(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """The workspace options; on subcommands they default to SUPPRESS, so they may come
    before or after the subcommand name."""
    import argparse

    for flags, options in _common_options():
        if suppress:
            options = {**options, "default": argparse.SUPPRESS}
        parser.add_argument(*flags, **options)


def register(subparsers: Any, only: str | None = None) -> None:
    """Add `run`, `recover`, `explain`, `gc`, `cache` and `list` (only `only`, when given);
    each sets `handler(parsed) -> dict`."""
    if only is None or only == "run":
        _register_run(subparsers)
    if only is None or only == "recover":
        _register_recover(subparsers)
    if only is None or only == "explain":
        _register_explain(subparsers)
    if only is None or only == "gc":
        _register_gc(subparsers)
    if only is None or only == "cache":
        _register_cache(subparsers)
    if only is None or only == "list":
        _register_list(subparsers)


_RUN_OPTIONS: tuple[Option, ...] = (
    (("--profile",), {"default": None, "help": "run only this profile's checks"}),
    (
        ("--repo",),
        {"action": "append", "default": None, "help": "only checks covering this repository"},
    ),
    (
        ("--changed",),
        {
            "action": "store_true",
            "help": "only checks covering repos with uncommitted changes",
        },
    ),
    (
        ("--base",),
        {
            "default": None,
            "metavar": "REF",
            "help": "with --changed: changes since this commit (e.g. origin/main), not just "
            "uncommitted",
        },
    ),
    (
        ("--resume",),
        {
            "default": None,
            "metavar": "RUN_ID",
            "help": "reuse verified checkpoints of this run ('latest': the newest finished run)",
        },
    ),
    (("--junit",), {"default": None, "metavar": "PATH", "help": "also write JUnit XML here"}),
    (("--jobs", "-j"), {"type": _jobs, "default": 1, "help": "stages run in parallel (>= 1)"}),
    (
        ("--lock-timeout",),
        {
            "type": float,
            "default": None,
            "metavar": "SECONDS",
            "help": "how long a stage waits for a resource another run holds (default 600; 0: "
            "fail)",
        },
    ),
    (
        ("--lock-dir",),
        {
            "default": None,
            "metavar": "DIR",
            "help": "the machine-wide folder of resource locks every clone of the workspace "
            "shares (default: $RATCHET_CHECKS_LOCK_DIR, else $XDG_RUNTIME_DIR/ratchet/"
            "checks-locks, else $TMPDIR/ratchet-checks-locks-UID)",
        },
    ),
    (
        ("--lock-scope",),
        {
            "default": None,
            "metavar": "NAME",
            "help": "whose resource locks this run shares (default: $RATCHET_CHECKS_LOCK_SCOPE, "
            "else the project's name, the same in every clone)",
        },
    ),
    (("--dry-run",), {"action": "store_true", "help": "print the plan, run nothing"}),
    (
        ("--allow-empty",),
        {
            "action": "store_true",
            "help": "accept a plan that selects no checks as a pass (default: exit 2)",
        },
    ),
    (
        ("--no-cache",),
        {
            "dest": "cache",
            "action": "store_false",
            "help": "neither read nor write the content-addressed cache",
        },
    ),
    (
        ("--cache-dir",),
        {
            "default": None,
            "metavar": "DIR",
            "help": "the cache folder, e.g. a shared mount (default: $RATCHET_CHECKS_CACHE_DIR, "
            "else the state folder's cache/)",
        },
    ),
    (
        ("--cache-url",),
        {
            "default": None,
            "metavar": "URL",
            "help": "a cache server (`ratchet checks cache serve`) instead of a cache folder "
            "(default: $RATCHET_CHECKS_CACHE_URL); the state folder's cache/ is its local mirror",
        },
    ),
    (
        ("--cache-read-only",),
        {
            "action": "store_true",
            "help": "reuse from the cache but never write to it (untrusted jobs)",
        },
    ),
    (
        ("--strict-env",),
        {
            "action": "store_true",
            "help": "pass stages only the fingerprinted variables and their declared `env`",
        },
    ),
)


def _run_defaults() -> dict[str, Any]:
    return {"handler": _handle_run, "cache": True}


def _register_run(subparsers: Any) -> None:
    run_p = subparsers.add_parser("run", help="run the checks (or resume a run)")
    add_common_arguments(run_p, suppress=True)
    for flags, options in _RUN_OPTIONS:
        run_p.add_argument(*flags, **options)
    run_p.set_defaults(**_run_defaults())


def read_plain_run(rest: Sequence[str]) -> SimpleNamespace | None:
    """What argparse would make of `ratchet checks REST` when REST is a plain `run` command
    line, without importing argparse or building a parser (4-6 ms of every start-up, a
    tenth of a no-op's command line); None for anything else, which argparse then parses.

    Plain: the workspace options, then `run`, then the workspace and run options, each
    spelled out in full (`--name value` or `--name=value`; flags without a value), no value
    starting with `-`, and `--jobs`/`--lock-timeout` values that `int`/`float` take. Help,
    abbreviations, short options, unknown words and anything argparse would refuse are
    not plain. `tests/checks/test_checks_cli_start.py` pins that every plain command line
    reads as argparse reads it.
    """
    common = {flags[0]: options for flags, options in _common_options()}
    after_run = {**common, **{flags[0]: options for flags, options in _RUN_OPTIONS}}
    values: dict[str, Any] = {
        "command": "checks",
        "verbose": False,
        "log_format": "text",
        "func": dispatch,
        "checks_command": "run",
        **{_dest(flag, options): _default(options) for flag, options in common.items()},
        **{_dest(flags[0], options): _default(options) for flags, options in _RUN_OPTIONS},
        **_run_defaults(),
    }
    known = common
    seen_run = False
    tokens = iter(rest)
    for token in tokens:
        if token == "run" and not seen_run:
            seen_run, known = True, after_run
            continue
        name, equals, given = token.partition("=")
        options = known.get(name)
        if options is None:
            return None
        action = options.get("action")
        if action in ("store_true", "store_false"):
            if equals:
                return None
            values[_dest(name, options)] = action == "store_true"
            continue
        value = given if equals else next(tokens, None)
        if value is None or value.startswith("-"):
            return None
        convert = options.get("type")
        if convert is not None:
            try:
                value = convert(value)
            except Exception:  # noqa: BLE001 - argparse then reads it and says what is wrong
                return None
        dest = _dest(name, options)
        if action == "append":
            values[dest] = [*(values[dest] or []), value]
        else:
            values[dest] = value
    return SimpleNamespace(**values) if seen_run else None


def _dest(flag: str, options: dict[str, Any]) -> str:
    return str(options.get("dest") or flag.lstrip("-").replace("-", "_"))


def _default(options: dict[str, Any]) -> Any:
    """The value argparse gives an option that is not given."""
    if "default" in options:
        return options["default"]
    return {"store_true": False, "store_false": True}.get(options.get("action", ""))


def _register_recover(subparsers: Any) -> None:
    rec_p = subparsers.add_parser("recover", help="mark a crashed run interrupted")
    add_common_arguments(rec_p, suppress=True)
    rec_p.add_argument("run_id", metavar="RUN_ID")
    rec_p.add_argument("--apply", action="store_true", help="change the receipt (default: report)")
    rec_p.add_argument(
        "--confirm-processes-stopped",
        action="store_true",
        help="confirm the run's processes are gone",
    )
    rec_p.add_argument(
        "--stop-stages",
        action="store_true",
        help="kill the recorded stage process groups that are still alive",
    )
    rec_p.set_defaults(handler=_handle_recover)


def _register_explain(subparsers: Any) -> None:
    exp_p = subparsers.add_parser("explain", help="why a stage re-ran or was reused")
    add_common_arguments(exp_p, suppress=True)
    exp_p.add_argument("run_id", metavar="RUN_ID")
    exp_p.add_argument("stage", metavar="STAGE")
    exp_p.set_defaults(handler=_handle_explain)


def _register_gc(subparsers: Any) -> None:
    gc_p = subparsers.add_parser("gc", help="bound the cache and the kept runs")
    add_common_arguments(gc_p, suppress=True)
    gc_p.add_argument("--cache-dir", default=None, metavar="DIR", help="the cache folder")
    gc_p.add_argument(
        "--max-age-days",
        type=float,
        default=30.0,
        help="drop cache entries stored longer ago than this (default 30)",
    )
    gc_p.add_argument(
        "--keep-runs",
        type=int,
        default=50,
        help="keep the folders of this many most recent finished runs (default 50)",
    )
    gc_p.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    gc_p.set_defaults(handler=_handle_gc)


def _register_cache(subparsers: Any) -> None:
    cache_p = subparsers.add_parser("cache", help="the cache server")
    cache_sub = cache_p.add_subparsers(dest="cache_command", required=True, metavar="COMMAND")
    serve_p = cache_sub.add_parser(
        "serve", help="serve a cache folder over HTTP (until SIGINT or SIGTERM)"
    )
    serve_p.add_argument("--dir", required=True, metavar="DIR", help="the cache folder to serve")
    serve_p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1; any other needs "
        "RATCHET_CHECKS_CACHE_TOKEN unless --read-only)",
    )
    serve_p.add_argument(
        "--port", type=int, default=8765, help="the port (default 8765; 0: any free port)"
    )
    serve_p.add_argument(
        "--read-only", action="store_true", help="answer every write with 403 (untrusted jobs)"
    )
    serve_p.set_defaults(handler=_handle_cache_serve)


def _register_list(subparsers: Any) -> None:
    list_p = subparsers.add_parser("list", help="list checks, profiles and recent runs")
    add_common_arguments(list_p, suppress=True)
    list_p.set_defaults(handler=_handle_list)
