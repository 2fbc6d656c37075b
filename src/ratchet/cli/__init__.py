"""The `ratchet` command line: `run`, `status`, `inspect`, and `checks`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from ratchet._errors import EXIT_INTERRUPTED, RatchetError, exit_code_for

_GROUPS = {
    "checks": "run checks incrementally with sealed receipts",
    "flink": "run agents on Apache Flink (needs ratchet[flink])",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; for a known `command`, the other groups are stubs (not imported).

    `ratchet run` is what a restarted worker executes, so its start-up should not pay for
    importing the check runner or the Flink front end.
    """
    parser = argparse.ArgumentParser(
        prog="ratchet",
        description="Durable, event-driven agents and incremental, verified checks.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine activity")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from ratchet.cli import _agents, _state

    _agents.register(sub)
    _state.register(sub)
    for group, help_text in _GROUPS.items():
        if command is not None and command != group:
            sub.add_parser(group, help=help_text)
        elif group == "checks":
            from ratchet.cli import _checks

            _checks.register(sub)
        else:
            from ratchet.cli import _flink

            _flink.register(sub)  # imports PyFlink only when a flink command runs
    return parser


def _command_of(argv: list[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = _command_of(argv)
    parser = build_parser(command if command in ("run", "status", "inspect") else None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = int(args.func(args) or 0)
    except RatchetError as exc:
        print(f"ratchet: error: {exc}", file=sys.stderr)
        code = exit_code_for(exc)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    if args.command == "run" and threading.active_count() > 1:
        # A thread still blocked in a user's call would hold the interpreter's exit; the job's
        # state is already committed, so leave without waiting for it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
