"""The integer key 1 and the string key "1" are two keys: a signal sent for one is delivered
to a run of that one only (it went to whichever of the two waited first: an approval of one
entity given to another). Real `ratchet run` and `ratchet signal` processes on a SQLite state,
one worker and two."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ratchet
from ratchet.store._sqlite import DB_NAME

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
def parked(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """A job whose two runs, of the string key "1" and of the integer key 1, wait for the
    signal "approve" (a bounded job leaves them parked)."""
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "in.jsonl").write_text('{"key": "1"}\n{"key": 1}\n')
    run = ["run", f"{tmp_path / 'agent.py'}:Approve", "--input", str(tmp_path / "in.jsonl"),
           "--output", str(tmp_path / "out.jsonl"), "--state", str(tmp_path / "st"),
           "--workers", request.param]  # fmt: skip
    first = cli(*run)
    assert first.returncode == 0, first.stderr
    assert not (tmp_path / "out.jsonl").read_text()
    return {"run": run, "state": str(tmp_path / "st"), "out": tmp_path / "out.jsonl"}


def outputs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line)["output"] for line in out.read_text().splitlines()]


def test_a_signal_for_the_integer_key_reaches_its_run_only(parked: dict[str, Any]) -> None:
    sent = cli("signal", "--state", parked["state"], "--key", "1", "--key-type", "int",
               "approve", "--value", '"for int"', "--json")  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert json.loads(sent.stdout)["key_type"] == "int"
    again = cli(*parked["run"])
    assert again.returncode == 0, again.stderr
    assert outputs(parked["out"]) == [{"type": "int", "got": "for int"}]
    # The string key's run still waits; its own signal reaches it.
    sent = cli("signal", "--state", parked["state"], "--key", "1", "--key-type", "str",
               "approve", "--value", '"for str"')  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert cli(*parked["run"]).returncode == 0
    assert outputs(parked["out"])[1:] == [{"type": "str", "got": "for str"}]


def test_a_signal_whose_key_could_be_either_is_refused(parked: dict[str, Any]) -> None:
    sent = cli("signal", "--state", parked["state"], "--key", "1", "approve", "--value", "1")
    assert sent.returncode == 2, sent.stderr
    assert "holds both the string key '1' and the integer key 1" in sent.stderr
    assert "--key-type" in sent.stderr and "Traceback" not in sent.stderr


def test_the_python_api_takes_the_type_of_the_key_it_is_given(parked: dict[str, Any]) -> None:
    ratchet.send_signal(parked["state"], "1", "approve", "for str")
    assert cli(*parked["run"]).returncode == 0
    assert outputs(parked["out"]) == [{"type": "str", "got": "for str"}]


def test_a_signal_stored_before_key_types_goes_to_either_key(tmp_path: Path) -> None:
    """A state from before the signals' key types (schema 10), with a signal pending for the
    text "1": it keeps its meaning then (the first run of either key that waits takes it)."""
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "in.jsonl").write_text('{"key": 1}\n')
    state, out = tmp_path / "st", tmp_path / "out.jsonl"
    run = ["run", f"{tmp_path / 'agent.py'}:Approve", "--input", str(tmp_path / "in.jsonl"),
           "--output", str(out), "--state", str(state)]  # fmt: skip
    assert cli(*run).returncode == 0
    with sqlite3.connect(state / DB_NAME) as db:  # as schema 10 had it: no key_type
        db.execute(
            "INSERT INTO signals(key_text, name, value, sent_at) VALUES ('1', 'approve', ?, 0)",
            (b"\xa3old",),
        )
    again = cli(*run)
    assert again.returncode == 0, again.stderr
    assert outputs(out) == [{"type": "int", "got": "old"}]


def test_rest_says_which_key_with_key_type(tmp_path: Path) -> None:
    from test_rest_metrics import free_port, get_json, poll, request, stop

    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "in.jsonl").write_text('{"key": "1"}\n{"key": 1}\n')
    port = free_port()
    out = tmp_path / "out.jsonl"
    cmd = [*RATCHET, "run", f"{tmp_path / 'agent.py'}:Approve", "--input",
           str(tmp_path / "in.jsonl"), "--output", str(out), "--state", str(tmp_path / "st"),
           "--supervise", "--follow", "--rest-port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        poll("both waits", lambda: len(get_json(port, "/v1/job")["waiting"] or []) == 2)
        status, body, _ = request(port, "POST", "/v1/keys/1/signals/approve", body={"value": 0})
        assert status == 400 and "--key-type" in str(body), body
        status, body, _ = request(
            port, "POST", "/v1/keys/1/signals/approve?key_type=int", body={"value": "int"}
        )
        assert status == 202 and json.loads(body)["key_type"] == "int", body
        poll("the output", lambda: out.exists() and out.read_text())
        assert outputs(out) == [{"type": "int", "got": "int"}]
        # /v1/job has the worker's latest report, sent after a checkpoint: the output can be
        # in the file before the supervisor has read the report that follows it.
        left = poll("one wait left", lambda: len(get_json(port, "/v1/job")["waiting"]) == 1)
        assert left and [w["key"] for w in get_json(port, "/v1/job")["waiting"]] == ["1"]
    finally:
        err = stop(proc)
    assert "Traceback" not in err, err


INT_WAITS = """
from ratchet import Agent, InputEvent, OutputEvent, action

class IntWaits(Agent):
    @action(InputEvent)
    async def wait(self, event, ctx):
        got = await ctx.wait_for_signal("approve") if isinstance(ctx.key, int) else None
        ctx.send_event(OutputEvent(output={"type": type(ctx.key).__name__, "got": got}))
"""


@pytest.mark.parametrize("held", ["str key held", "no key held"])
def test_a_typed_signal_moves_with_its_own_key_when_the_workers_change(
    tmp_path: Path, held: str
) -> None:
    from ratchet.runtime._shards import shard_of

    assert shard_of("3", 2) != shard_of(3, 2)  # the two keys of the text live apart
    (tmp_path / "agent.py").write_text(INT_WAITS)
    inp, out, state = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "st"
    inp.write_text('{"key": "3"}\n' if held == "str key held" else '{"key": "a"}\n')
    run = ["run", f"{tmp_path / 'agent.py'}:IntWaits", "--input", str(inp), "--output", str(out),
           "--state", str(state)]  # fmt: skip
    assert cli(*run).returncode == 0
    ratchet.send_signal(state, 3, "approve", "for int")
    with inp.open("a") as fh:
        fh.write('{"key": 3}\n')
    # Moved by the text alone, the signal went to the string key's shard and the integer
    # key's run never got it (or, with no key of the text held, the change was refused).
    again = cli(*run, "--workers", "2")
    assert again.returncode == 0, again.stderr
    assert {"type": "int", "got": "for int"} in outputs(out), outputs(out)
