"""An `argparse.ArgumentParser` that does not import `shutil` to build itself.

argparse makes a help formatter for every `add_argument` (to check the metavar), and each
formatter asks `shutil.get_terminal_size()` for its width; importing `shutil` loads
`zlib`, `bz2` and `lzma` too: 2-3 ms of every start of the command line, where a no-op
`ratchet checks run` takes tens. `Parser` asks the terminal the same way, with `os` only.
"""

from __future__ import annotations

import argparse
import os
import sys

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

__all__ = ["HelpFormatter", "Parser", "terminal_columns"]


def terminal_columns(fallback: int = 80) -> int:
    """The width `shutil.get_terminal_size()` reports: $COLUMNS when it is a positive
    integer, else the width of the terminal on stdout, else `fallback`."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns > 0:
        return columns
    stdout = sys.__stdout__
    try:
        return (stdout is not None and os.get_terminal_size(stdout.fileno()).columns) or fallback
    except (AttributeError, ValueError, OSError):
        return fallback


class HelpFormatter(argparse.HelpFormatter):
    """argparse's default formatter, its width found by `terminal_columns`."""

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 24,
        width: int | None = None,
    ) -> None:
        if width is None:
            width = terminal_columns() - 2  # as argparse does
        super().__init__(prog, indent_increment, max_help_position, width)


class Parser(argparse.ArgumentParser):
    """`ArgumentParser` with `HelpFormatter` by default; its subcommands' parsers are
    `Parser`s too (argparse makes them of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
