"""Events are values (issue 11, items 1 and 2): every listener gets its own copy of the event as
it was sent, decoded from the stored form replay uses; mutations by the sender after sending,
by a sibling, or by the listener itself change nothing else; a field that would not come back
as it was sent is refused at send_event, naming the event and the field."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import ratchet
from ratchet import Agent, CodecError, Event, InputEvent, OutputEvent, action
from ratchet.agents._events import freeze
from ratchet.store import codec
from ratchet.store._sqlite import SqliteStore
from runtime.agents.values_agent import Basket, Mutating

AGENT = f"{Path(__file__).parent / 'agents' / 'values_agent.py'}:Mutating"


def memory(state: Path) -> dict[str, Any]:
    from ratchet.runtime._memops import from_wire

    store = SqliteStore.open_readonly(state)
    try:
        return {codec.decode(k): from_wire(codec.decode(m)) for k, m in store.memories()}
    finally:
        store.close()


def test_listeners_see_the_event_as_it_was_sent(tmp_path: Path) -> None:
    got: list[dict[str, Any]] = []
    ratchet.run(Mutating(), inputs=[{"key": "k", "v": 1}], output=got.append, state_dir=tmp_path)
    assert [r["output"] for r in got] == [{"items": [1], "meta": {"tags": ["a"]}}]
    assert memory(tmp_path) == {"k": {"sibling_saw": 1, "grab_saw": [1, 99]}}


def test_a_mutated_event_replays_as_it_was_sent_after_a_sigkill(tmp_path: Path) -> None:
    """`grab` commits (its mutation in the process) and `watch` is in flight at the kill; the
    restarted process replays the journaled Basket: `watch` must see what was sent."""
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(json.dumps({"key": "k", "v": 5}) + "\n")
    gate = tmp_path / "gate"
    cmd = [sys.executable, "-m", "ratchet.cli", "run", AGENT, "--input", str(inputs)]
    cmd += ["--output", str(tmp_path / "out.jsonl"), "--state", str(tmp_path / "s")]
    cmd += ["--checkpoint-interval", "10"]
    env = dict(os.environ, VALUES_GATE=str(gate))
    with open(tmp_path / "stderr.log", "wb") as err:
        proc = subprocess.Popen(cmd, env=env, stderr=err)
    deadline = time.monotonic() + 30
    while not Path(str(gate) + ".waiting").exists():
        assert time.monotonic() < deadline and proc.poll() is None, (
            tmp_path / "stderr.log"
        ).read_text()
        time.sleep(0.02)
    # Kill once a checkpoint holds the run with `grab` journaled (checkpoints every 10 ms).
    while True:
        assert time.monotonic() < deadline, "no checkpoint took the run in flight"
        store = SqliteStore.open_readonly(tmp_path / "s")
        try:
            runs = store.load().runs
        finally:
            store.close()
        if runs and b"grab" in runs[0][3]:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gate.write_text("open")
    done = subprocess.run(cmd, env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = [json.loads(x)["output"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out == [{"items": [5], "meta": {"tags": ["a"]}}]
    assert memory(tmp_path / "s") == {"k": {"sibling_saw": 5, "grab_saw": [5, 99]}}


class Point(BaseModel):
    x: int


codec.register(Point, name="tests.values.Point")


class Loose(Event):
    event_name = "values.Loose"
    payload: Any


class Typed(Event):
    event_name = "values.Typed"
    point: Point
    ratio: float


def test_a_field_that_would_not_come_back_as_sent_is_refused_naming_it() -> None:
    with pytest.raises(
        CodecError,
        match=r"event values\.Loose: field 'payload' holds Point .* comes back as dict",
    ):
        freeze(Loose(payload=Point(x=1)))
    # Declared with its type, the model round-trips; NaN is NaN after the round trip too.
    emitted = freeze(Typed(point=Point(x=2), ratio=math.nan))
    copy = emitted.thaw()
    assert copy.point == Point(x=2) and math.isnan(copy.ratio)


class SendsLoose(Agent):
    @action(InputEvent)
    def go(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(Loose(payload=Point(x=event.input["v"])))

    @action(Loose)
    def never(self, event: Loose, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output="unreachable"))


def test_the_refusal_is_the_actions_error_live_and_after_replay(tmp_path: Path) -> None:
    got: list[dict[str, Any]] = []
    ratchet.run(SendsLoose(), inputs=[{"key": "k", "v": 1}], output=got.append, state_dir=tmp_path)
    assert len(got) == 1 and got[0]["output"] is None
    assert got[0]["error"]["action"] == "go"
    assert "field 'payload' holds Point" in got[0]["error"]["message"]


def test_each_listener_thaws_its_own_copy() -> None:
    emitted = freeze(Basket(items=[1], meta={"a": [1]}))
    first, second = emitted.thaw(), emitted.thaw()
    assert first == second and first is not second
    first.items.append(2)
    first.meta["a"].append(2)
    assert second.items == [1] and second.meta == {"a": [1]}
    assert emitted.wire() == ("values.Basket", {"items": [1], "meta": {"a": [1]}})


def test_a_plain_copy_is_what_the_codec_round_trip_gives() -> None:
    from ratchet.agents._events import _NOT_PLAIN, _plain_copy

    plain = {"k": [1, 2.5, float("nan"), None, True, "\udc80", b"x", 2**80, {"a": [[]]}]}
    copied = _plain_copy(plain, 0)
    assert repr(copied) == repr(codec.decode(codec.encode(plain)))
    assert copied is not plain and copied["k"] is not plain["k"]
    assert copied["k"][8] is not plain["k"][8]
    for other in [{"t": (1,)}, {1: "int key"}, [bytearray(b"x")], {"s": {1}}]:
        assert _plain_copy(other, 0) is _NOT_PLAIN
    deep: Any = []
    for _ in range(codec.MAX_DEPTH + 5):
        deep = [deep]
    assert _plain_copy(deep, 0) is _NOT_PLAIN  # the codec refuses it, naming where


def test_an_input_too_deep_to_store_is_refused_when_thawed_as_before() -> None:
    from ratchet.agents._events import Emitted

    deep: Any = 1
    for _ in range(codec.MAX_DEPTH + 5):
        deep = {"d": deep}
    with pytest.raises(CodecError, match="nested"):
        Emitted(InputEvent, {"input": deep}).thaw()
