"""Argument types for the command line's whole-number options, in one place.

argparse is imported only when a value is refused: `ratchet checks run` reads a plain command
line without argparse (tests/checks/test_checks_imports.py), and its `--jobs` uses this too.
"""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    import argparse
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


def add_key_type(
    parser: argparse.ArgumentParser, name: str = "KEY", *, when: str = "", unless: str = ""
) -> None:
    """`--key-type`, as every command that takes a key's text has it: the text "42" names the
    string key and the integer key (`runtime._shards.chosen_key_type` decides auto)."""
    parser.add_argument(
        "--key-type",
        choices=["auto", "str", "int"],
        default="auto",
        help=f"{when}whether a {name} like 42 is the string or the integer key (two keys; "
        f"default auto: the one the state holds, refused when it holds both{unless})",
    )


def refuse_key_type_without_key(key_type: str, key: object, name: str = "KEY") -> None:
    """A `--key-type` that names no key's type is a mistake, not ignored."""
    if key_type != "auto" and key is None:
        from ratchet._errors import ConfigError

        raise ConfigError(f"--key-type {key_type} says which key --key is: give --key {name}")
