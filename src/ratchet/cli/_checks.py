"""`ratchet checks ...`: incremental, verified check runs with sealed receipts."""

from __future__ import annotations

from collections.abc import Sequence

from ratchet.checks import _cli

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    import argparse
    from typing import Any


def register(sub: Any, argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Add the `checks` command to the top-level subparsers; `func` returns the exit code.
    `argv`, the arguments after `checks`, lets it build only the subcommand they name."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "checks",
        help="run checks incrementally with sealed receipts",
        description=__doc__,
    )
    _cli.configure(parser, argv)
    return parser
