"""`ratchet checks` builds only the subcommand it runs: the same parse as with every
subcommand built, and every subcommand when that cannot be told for sure."""

from __future__ import annotations

import argparse

import pytest

from ratchet._argparse import HelpFormatter, terminal_columns
from ratchet.checks._cli import SUBCOMMANDS, subcommand_of
from ratchet.cli import build_parser


@pytest.mark.parametrize(
    ("rest", "expected"),
    [
        (["run", "--resume", "latest"], "run"),
        (["--workspace-root", "list", "run"], "run"),  # "list" is the option's value
        (["--workspace-root=/w", "--json", "explain", "r1", "s"], "explain"),
        (["--proj", "p.json", "--state", "s", "gc"], "gc"),  # abbreviated, as argparse allows
        (["--js", "recover", "r1"], "recover"),
        (["cache", "serve", "--dir", "d"], "cache"),
        (["--help"], None),
        (["-h", "run"], None),
        (["--no-such-option", "run"], None),
        (["--", "run"], None),
        (["runs"], None),
        ([], None),
    ],
)
def test_the_subcommand_is_told_only_when_it_is_certain(
    rest: list[str], expected: str | None
) -> None:
    assert subcommand_of(rest) == expected


@pytest.mark.parametrize(
    "rest",
    [
        ["run", "--workspace-root", "/w", "--resume", "r1", "--no-cache", "--json", "-j", "2"],
        ["--workspace-root", "/w", "--state-dir", "/s", "run", "--dry-run", "--repo", "a"],
        ["recover", "r1", "--apply", "--confirm-processes-stopped"],
        ["explain", "r1", "stage"],
        ["gc", "--keep-runs", "3", "--dry-run"],
        ["cache", "serve", "--dir", "/c", "--port", "0"],
        ["--json", "list"],
    ],
)
def test_building_one_subcommand_parses_as_building_all_of_them(rest: list[str]) -> None:
    argv = ["checks", *rest]
    one = build_parser("checks", rest).parse_args(argv)
    every = build_parser("checks").parse_args(argv)
    assert _comparable(one) == _comparable(every)


def test_each_subcommand_can_be_built_alone() -> None:
    for name in SUBCOMMANDS:
        parser = build_parser("checks", [name])
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["checks", name, "--help"])
        assert exit_info.value.code == 0


def _comparable(ns: argparse.Namespace) -> dict[str, object]:
    return {k: v for k, v in vars(ns).items() if k not in ("func", "handler")} | {
        "handler": ns.handler.__name__
    }


@pytest.mark.parametrize("columns", ["100", "37", "0", "-5", "wide", None])
def test_the_help_is_as_wide_as_argparse_would_make_it(
    monkeypatch: pytest.MonkeyPatch, columns: str | None
) -> None:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    ours = HelpFormatter("ratchet")
    theirs = argparse.HelpFormatter("ratchet")  # asks shutil.get_terminal_size()
    assert (ours._width, ours._max_help_position) == (theirs._width, theirs._max_help_position)
    assert terminal_columns() == ours._width + 2
