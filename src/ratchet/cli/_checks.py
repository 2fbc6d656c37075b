"""`ratchet checks ...`: incremental, verified check runs with sealed receipts."""

from __future__ import annotations

import argparse
from typing import Any

from ratchet.checks import _cli


def register(sub: Any) -> argparse.ArgumentParser:
    """Add the `checks` command to the top-level subparsers; `func` returns the exit code."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "checks",
        help="run checks incrementally with sealed receipts",
        description=__doc__,
    )
    _cli.configure(parser)
    return parser
