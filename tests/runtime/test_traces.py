"""Run traces: what each completed run did is kept in the state under a retention policy and
`ratchet trace` shows it; work answered from the journal after a restore says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ratchet
from ratchet import (
    Agent,
    ConfigError,
    EngineConfig,
    Event,
    InputEvent,
    OutputEvent,
    Retry,
    action,
)
from ratchet.store import codec
from ratchet.store._memory import MemoryStore
from ratchet.store._sqlite import SqliteStore
from ratchet.testing import FakeClock
from support.chat_agents import Asker
from support.fakeclock import START, Drive

RATCHET = [sys.executable, "-m", "ratchet.cli"]


class Found(Event):
    v: int


TRIES: list[int] = []


def lookup(n: int) -> int:
    return n * 2


class Traced(Agent):
    @action(InputEvent, retry=Retry(max_attempts=3, initial_delay=0.01))
    async def first(self, event: InputEvent, ctx: Any) -> None:
        v = await ctx.durable_execute_async(lookup, event.input["n"])
        TRIES.append(v)
        if event.input.get("flaky") and len(TRIES) == 1:
            raise RuntimeError("flaky")
        ctx.short_term_memory.set("v", v)
        ctx.send_event(Found(v=v))

    @action(Found)
    async def second(self, event: Found, ctx: Any) -> None:
        await ctx.sleep(event.v)
        ctx.trace_note("decision", chose="ship", why=event.v)
        ctx.send_event(OutputEvent(output=event.v))


def traces_of(state: Path, key: str) -> list[dict[str, Any]]:
    store = SqliteStore.open_readonly(state)
    try:
        return store.traces(key)
    finally:
        store.close()


def test_a_trace_holds_tasks_attempts_calls_notes_memory_and_events(tmp_path: Path) -> None:
    TRIES.clear()
    state = tmp_path / "s"
    ratchet.run(
        Traced(),
        inputs=[{"key": "a", "n": 0, "flaky": True}],
        output=tmp_path / "o.jsonl",
        state_dir=state,
    )
    (run,) = traces_of(state, "a")
    assert run["status"] == "ok" and run["seq"] == 0
    first, second = run["tasks"]
    assert (first["action"], first["on"], first["replayed"], first["attempts"]) == (
        "first", "ratchet.InputEvent", False, 2,
    )  # fmt: skip
    assert [c["fn"].rsplit(".", 1)[1] for c in first["calls"]] == ["lookup"]
    assert first["memory"] == [["s", "v", 0]] and first["events"] == ["Found"]
    assert first["duration"] >= 0 and second["started"] >= first["started"]
    assert second["notes"] == [{"kind": "decision", "chose": "ship", "why": 0}]
    assert "calls" not in second and second["events"] == ["ratchet.OutputEvent"]
    text = subprocess.run(
        [*RATCHET, "trace", "--state", str(state), "--key", "a"], capture_output=True, text=True
    )
    assert text.returncode == 0 and "2 attempts" in text.stdout and "decision" in text.stdout
    missing = subprocess.run(
        [*RATCHET, "trace", "--state", str(state), "--key", "zz"], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "holds no key 'zz'" in missing.stderr


def test_work_answered_from_the_journal_after_a_restore_is_marked_replayed() -> None:
    clock = FakeClock(START)
    store = MemoryStore(clock)
    rows = [{"key": "a", "n": 30}]  # `second` sleeps 60 s: stopped during it
    first = Drive(Traced(), rows, store)
    first.run(stop_at=START + 10, follow=True)
    again = Drive(Traced(), rows, store.reopen())
    again.run()
    ((_at, status, blob, key_type),) = again.store.traces.values()
    tasks = codec.decode(blob)["tasks"]
    assert status == "ok" and key_type == "str"
    assert [(t["action"], t["replayed"]) for t in tasks] == [("first", True), ("second", False)]
    assert "calls" not in tasks[0]  # nothing ran for it in this process


def test_retention_keeps_the_last_n_runs_per_key_or_none(tmp_path: Path) -> None:
    TRIES.clear()
    rows = [{"key": k, "n": 0} for k in ("a", "b", "a", "a", "a")]
    state = tmp_path / "s"
    ratchet.run(
        Traced(), inputs=rows, output=tmp_path / "o.jsonl", state_dir=state,
        config=EngineConfig(trace_retention="2"),
    )  # fmt: skip
    # The newest runs are kept; older ones are cut once a key has N new traces (so at most 2N).
    kept = [t["seq"] for t in traces_of(state, "a")]
    assert kept[:2] == [4, 3] and len(kept) <= 4
    assert [t["seq"] for t in traces_of(state, "b")] == [1]
    many = tmp_path / "many"
    rows = [{"key": "a", "n": 0}] * 40
    ratchet.run(
        Traced(), inputs=rows, output=tmp_path / "o3.jsonl", state_dir=many,
        config=EngineConfig(trace_retention="5"),
    )  # fmt: skip
    kept = [t["seq"] for t in traces_of(many, "a")]
    assert kept[:5] == [39, 38, 37, 36, 35] and len(kept) <= 10
    off = tmp_path / "off"
    ratchet.run(
        Traced(), inputs=rows, output=tmp_path / "o2.jsonl", state_dir=off,
        config=EngineConfig(trace_retention="off"),
    )  # fmt: skip
    assert traces_of(off, "a") == []
    for bad in ("x", "2,3", "7y"):
        with pytest.raises(ConfigError, match="trace retention"):
            EngineConfig(trace_retention=bad).validate()


def test_retention_holds_across_restarts_that_each_run_fewer_than_n_runs_of_a_key(
    tmp_path: Path,
) -> None:
    """Each start counted a key's new traces from 0, so a job restarted before a key had N
    new runs never cut it: 8 starts of 2 runs a key with N = 3 kept all 16."""
    TRIES.clear()
    state = tmp_path / "s"
    rows: list[dict[str, Any]] = []
    for start in range(8):
        rows += [{"key": k, "n": 0} for k in ("a", "b")]  # the same file, two lines more
        ratchet.run(
            Traced(), inputs=list(rows), output=tmp_path / "o.jsonl", state_dir=state,
            config=EngineConfig(trace_retention="3"),
        )  # fmt: skip
        for key in ("a", "b"):
            kept = [t["seq"] for t in traces_of(state, key)]
            assert len(kept) <= 6, f"start {start}: key {key} keeps {len(kept)} traces"
    newest = [t["seq"] for t in traces_of(state, "a")]
    assert newest[:3] == [14, 12, 10]


def test_model_calls_are_in_the_trace_with_their_tokens(tmp_path: Path) -> None:
    state = tmp_path / "s"
    ratchet.run(Asker(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=state)
    (run,) = traces_of(state, "a")
    notes = [n for t in run["tasks"] for n in t.get("notes", [])]
    (call,) = [n for n in notes if n["kind"] == "model_call"]
    assert call["model"] == "m" and call["output_tokens"] > 0 and call["replayed"] is False
    shown = subprocess.run(
        [*RATCHET, "trace", "--state", str(state), "--key", "a", "--json"],
        capture_output=True,
        text=True,
    )
    assert json.loads(shown.stdout)["tasks"][0]["action"] == "ask"


class Noted(Agent):
    @action(InputEvent, inline=True)
    def go(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("note", event.input["note"])
        ctx.send_event(OutputEvent(output=1))


def test_ratchet_trace_prints_square_brackets_as_they_were_stored(tmp_path: Path) -> None:
    """Keys and values are the user's text, not rich markup: `[/docs]` raised MarkupError
    (a traceback), `[bold]x` printed as `x`; a seq past 64 bits was an OverflowError."""
    state = tmp_path / "s"
    rows = [
        {"key": "plain", "note": "see [/docs] for help"},
        {"key": "user[/x]", "note": "[bold]x"},
    ]
    ratchet.run(Noted(), inputs=rows, output=tmp_path / "o.jsonl", state_dir=state)
    for key, note in (("plain", "see [/docs] for help"), ("user[/x]", "[bold]x")):
        proc = subprocess.run(
            [*RATCHET, "trace", "--state", str(state), "--key", key],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert f"key {key} input" in proc.stdout
        assert f"memory set note = {note!r}" in proc.stdout
    proc = subprocess.run(
        [*RATCHET, "trace", "--state", str(state), "--key", "plain", "--seq", str(1 << 63)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "is not an input seq" in proc.stderr, proc.stderr
