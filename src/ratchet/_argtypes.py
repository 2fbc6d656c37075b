"""Argument types for the command line's whole-number options, in one place.

argparse is imported only when a value is refused: `ratchet checks run` reads a plain command
line without argparse (tests/checks/test_checks_imports.py), and its `--jobs` uses this too.
"""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from collections.abc import Callable


def whole_number(
    low: int,
    high: int | None = None,
    *,
    out_of_range: str,
    not_a_number: str = "{text!r} is not a whole number",
) -> Callable[[str], int]:
    """An argparse `type=`: a whole number from `low` to `high` (None: no upper bound); the
    messages are formats of `text` (what was given) and `n` (the number it is)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise _refused(not_a_number.format(text=text)) from None
        if n < low or (high is not None and n > high):
            raise _refused(out_of_range.format(n=n, text=text))
        return n

    return parse


def _refused(message: str) -> Exception:
    import argparse

    return argparse.ArgumentTypeError(message)
