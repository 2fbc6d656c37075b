"""The command-line shell around the runner: parse, call the handler, print, exit code."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ratchet._errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, RatchetError
from ratchet.checks import _report, runner


def configure(parser: argparse.ArgumentParser) -> None:
    """Give `parser` the workspace options and the run/recover/explain/list subcommands."""
    runner.add_common_arguments(parser)
    sub = parser.add_subparsers(dest="checks_command", required=True, metavar="COMMAND")
    runner.register(sub)
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
    parser = argparse.ArgumentParser(prog="python -m ratchet.checks", description=runner.__doc__)
    configure(parser)
    parsed = parser.parse_args(argv)
    return int(parsed.func(parsed))
