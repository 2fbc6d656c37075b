"""`ratchet checks` builds only the subcommand it runs: the same parse as with every
subcommand built, and every subcommand when that cannot be told for sure; and a plain
`checks run` command line is read without argparse, to what argparse would make of it."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet._argparse import HelpFormatter, terminal_columns
from ratchet.checks._cli import SUBCOMMANDS, read_plain_run, subcommand_of
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


# --- a plain `checks run` command line, read without argparse -----------------------------

PLAIN = [
    ["run"],
    [
        "run",
        "--workspace-root",
        "/w",
        "--state-dir",
        "/s",
        "--resume",
        "r1",
        "--no-cache",
        "--json",
    ],
    ["--workspace-root", "/w", "--json", "run", "--resume=latest", "--jobs", "4"],
    ["--project", "run", "run", "--repo", "a", "--repo=b", "--changed", "--base", "origin/main"],
    ["run", "--lock-timeout", "2.5", "--lock-dir", "/l", "--lock-scope", "s", "--junit", "j"],
    ["run", "--dry-run", "--allow-empty", "--cache-dir", "c", "--cache-url", "http://h:1"],
    ["run", "--cache-read-only", "--strict-env", "--profile", "p", "--resume", ""],
    ["--state-dir", "/a", "run", "--state-dir", "/b", "--json", "--json", "--jobs", "1_0"],
]
NOT_PLAIN = [
    [],
    ["--json"],  # no subcommand
    ["run", "--help"],
    ["-h", "run"],
    ["run", "-j", "2"],  # a short option
    ["run", "--res", "r1"],  # abbreviated
    ["run", "--resume"],  # no value
    ["run", "--resume", "--json"],
    ["run", "--jobs", "-1"],  # a value starting with '-'
    ["run", "--jobs", "two"],  # argparse says why
    ["run", "--lock-timeout", "soon"],
    ["run", "--json=yes"],
    ["--resume", "r1", "run"],  # a run option before `run`
    ["run", "run"],
    ["run", "extra"],
    ["list"],
    ["run", "--", "--json"],
]


def _argparse_reads(rest: list[str]) -> dict[str, object] | None:
    parser = build_parser("checks")
    try:
        return vars(parser.parse_args(["checks", *rest]))
    except SystemExit:
        return None


@pytest.mark.parametrize("rest", PLAIN)
def test_a_plain_run_command_line_reads_as_argparse_reads_it(rest: list[str]) -> None:
    plain = read_plain_run(rest)
    assert plain is not None
    assert vars(plain) == _argparse_reads(rest)


@pytest.mark.parametrize("rest", NOT_PLAIN)
def test_anything_else_is_left_to_argparse(rest: list[str]) -> None:
    assert read_plain_run(rest) is None


def _random_command_line(rng: random.Random) -> list[str]:
    """A plain `checks run` command line, then, half the time, one to three edits that may
    make it anything (a tricky value, an unknown or misplaced word, a lost token)."""
    common = ["--workspace-root", "--project", "--state-dir"]
    valued = ["--profile", "--repo", "--base", "--resume", "--junit", "--lock-dir"]
    valued += ["--lock-scope", "--cache-dir", "--cache-url", *common]
    flags = ["--json", "--changed", "--dry-run", "--allow-empty", "--no-cache"]
    flags += ["--cache-read-only", "--strict-env"]
    values = ["x", "", "run", "a=b", "latest", "/w s"]
    tricky = ["-1", "--json", "-", "1e3", "two", "--", "-h", "run", "=", "3"]

    def option(names: list[str]) -> list[str]:
        name = rng.choice(names)
        if name in flags:
            return [name]
        value = rng.choice(values)
        return [f"{name}={value}"] if rng.random() < 0.3 else [name, value]

    rest: list[str] = []
    for _ in range(rng.randrange(3)):
        rest += option([*common, "--json"])
    rest.append("run")
    for _ in range(rng.randrange(6)):
        roll = rng.random()
        if roll < 0.15:
            rest += ["--jobs", str(rng.randrange(1, 9))]
        elif roll < 0.25:
            rest += ["--lock-timeout", rng.choice(["0", "2.5", "1e3"])]
        else:
            rest += option(valued + flags)
    if rng.random() < 0.5:
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(rest) + 1)
            roll = rng.random()
            if roll < 0.4:
                rest.insert(at, rng.choice(tricky))
            elif roll < 0.7 and rest:
                del rest[min(at, len(rest) - 1)]
            else:
                rest.insert(at, rng.choice(["-j", "--res", "--help", "list", "--jobs", "run"]))
    return rest


def test_random_command_lines_read_as_argparse_reads_them_or_are_left_to_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every command line `read_plain_run` reads, argparse reads the same way (and none it
    reads does argparse refuse); a fixed seed, so a failure replays."""
    rng = random.Random(17)
    parser = build_parser("checks")
    plain_count = 0
    for _ in range(3000):
        rest = _random_command_line(rng)
        plain = read_plain_run(rest)
        if plain is None:
            continue
        plain_count += 1
        try:
            theirs = vars(parser.parse_args(["checks", *rest]))
        except SystemExit:
            raise AssertionError(f"read as plain, refused by argparse: {rest}") from None
        assert vars(plain) == theirs, rest
    capsys.readouterr()
    assert plain_count > 1000  # the sample reaches the reader, not only argparse


@pytest.mark.parametrize("jobs", ["0", "-3", "two"])
def test_jobs_below_one_or_not_a_number_is_refused(tmp_path: Path, jobs: str) -> None:
    """--jobs 0 and --jobs -3 ran one stage at a time without a word."""
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "checks", "--workspace-root", str(tmp_path),
         "run", f"--jobs={jobs}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "argument --jobs/-j" in proc.stderr
