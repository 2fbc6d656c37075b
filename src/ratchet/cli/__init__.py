"""The `ratchet` command line: `run`, `status`, `inspect`, and `checks`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from ratchet._errors import RatchetError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ratchet",
        description="Durable, event-driven agents and incremental, verified checks.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine activity")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from ratchet.cli import _agents

    _agents.register(sub)
    from ratchet.cli import _checks, _flink

    _checks.register(sub)
    _flink.register(sub)  # imports PyFlink only when a flink command runs
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = int(args.func(args) or 0)
    except RatchetError as exc:
        print(f"ratchet: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    if args.command == "run" and threading.active_count() > 1:
        # A thread still blocked in a user's call would hold the interpreter's exit; the job's
        # state is already committed, so leave without waiting for it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
