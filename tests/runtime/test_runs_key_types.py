"""`ratchet runs restart` and `runs abandon` with the integer key 1 and the string key "1"
both parked: `--key 1` is refused (exit 2) until `--key-type` says which, and then acts on
that key's run only (it took whichever was listed first: `runs abandon --key 1` abandoned the
integer key's run when the string key's was meant, and `--key-type` was not accepted). Real
`ratchet run` and `ratchet runs` processes on a SQLite state, one worker and two."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

RATCHET = [sys.executable, "-m", "ratchet.cli"]
AGENT = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Approve(Agent):
    @action(InputEvent)
    async def wait(self, event, ctx):
        got = await ctx.wait_for_signal("approve")
        ctx.send_event(OutputEvent(output={"type": type(ctx.key).__name__, "got": got}))
"""


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RATCHET, *argv], capture_output=True, text=True, timeout=120)


@pytest.fixture(params=["1", "2"], ids=["one-worker", "two-workers"])
def parked(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The state of a job whose runs of the string key "1" (input 0) and of the integer key 1
    (input 1) wait for the signal "approve"."""
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "in.jsonl").write_text('{"key": "1"}\n{"key": 1}\n')
    first = cli("run", f"{tmp_path / 'agent.py'}:Approve", "--input", str(tmp_path / "in.jsonl"),
                "--output", str(tmp_path / "out.jsonl"), "--state", str(tmp_path / "st"),
                "--workers", request.param)  # fmt: skip
    assert first.returncode == 0, first.stderr
    return str(tmp_path / "st")


def in_flight(state: str) -> list[tuple[Any, str]]:
    done = cli("runs", "list", "--state", state, "--json")
    assert done.returncode == 0, done.stderr
    return [(r["key"], type(r["key"]).__name__) for r in json.loads(done.stdout)["in_flight"]]


@pytest.mark.parametrize("what", ["restart", "abandon"])
def test_a_key_text_both_keys_have_is_refused_until_key_type_says_which(
    parked: str, what: str
) -> None:
    refused = cli("runs", what, "--state", parked, "--key", "1")
    assert refused.returncode == 2, refused.stderr
    assert "holds both the string key '1' and the integer key 1" in refused.stderr
    assert "--key-type" in refused.stderr and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert in_flight(parked) == [("1", "str"), (1, "int")], "nothing was discarded"

    done = cli("runs", what, "--state", parked, "--key", "1", "--key-type", "str", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert (got["key"], got["key_type"], got["seq"]) == ("1", "str", 0), got
    assert in_flight(parked) == [(1, "int")]  # a restarted run starts again at the next run
    done = cli("runs", what, "--state", parked, "--key", "1", "--key-type", "int")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("key 1 (int) input 1: "), done.stdout
    if what == "abandon":
        assert in_flight(parked) == []
        letters = cli("dead-letters", "--state", parked, "--json")
        assert letters.returncode == 0, letters.stderr
        keys = sorted((d["key"], d["key_type"]) for d in json.loads(letters.stdout))
        assert keys == [("1", "int"), ("1", "str")], keys


def test_seq_names_the_run_and_a_wrong_key_type_is_one_line(parked: str) -> None:
    done = cli("runs", "abandon", "--state", parked, "--key", "1", "--seq", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["key_type"] == "int"
    assert in_flight(parked) == [("1", "str")]
    wrong = cli("runs", "restart", "--state", parked, "--key", "1", "--key-type", "int")
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr, wrong.stderr
    assert "run in flight for the int key '1'" in wrong.stderr, wrong.stderr


def test_runs_list_shows_the_key_type_where_both_keys_are_in_flight(parked: str) -> None:
    done = cli("runs", "list", "--state", parked)
    assert done.returncode == 0, done.stderr
    assert "1 (str)" in done.stdout and "1 (int)" in done.stdout, done.stdout
    cli("runs", "abandon", "--state", parked, "--key", "1", "--key-type", "int")
    done = cli("runs", "list", "--state", parked)
    assert "1 (str)" not in done.stdout and "(int)" not in done.stdout, done.stdout
