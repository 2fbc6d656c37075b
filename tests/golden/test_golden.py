"""Golden journals: checkpoints recorded from real `ratchet run` processes SIGKILLed with runs in
flight (see make_golden.py), replayed through both engines — the embedded engine over the
reference store, and the Flink core over in-memory keyed state. Both must reach the outputs and
memory of a crash-free run, without calling again what had returned; a changed agent that no
longer fits the journal raises NonDeterminismError naming the run and the task."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from golden.golden_agent import ChangedCallAgent, GoldenAgent, NoEnrichAgent
from ratchet import Agent, NonDeterminismError
from ratchet.agents._context import AgentBinding, install_task_factory
from ratchet.runtime._engine import Engine, EngineConfig
from ratchet.runtime._flink_core import MemoryKeyedState
from ratchet.runtime._io import CallbackSink, JsonlSource
from ratchet.runtime._journal import (
    decode_call,
    decode_journal,
    decode_memory,
    encode_call,
    encode_run,
)
from ratchet.runtime._machine import RestoredRun
from ratchet.store import codec
from ratchet.store._base import CallRecord, CheckpointRows
from ratchet.store._memory import MemoryStore
from support.engines import FlinkSim, per_key

HERE = Path(__file__).parent
GOLDEN = sorted(HERE.glob("*.golden"))


def load(path: Path) -> dict[str, Any]:
    dump = codec.decode(path.read_bytes())
    assert dump["format"] == 1, f"{path.name}: unknown dump format {dump['format']}"
    return dump


def calls_of(dump: dict[str, Any]) -> list[CallRecord]:
    return [CallRecord(*c) for c in dump["rows"]["calls"]]


def replay_embedded(
    dump: dict[str, Any], agent: Agent, tmp: Path
) -> tuple[list[dict[str, Any]], dict[Any, dict[str, Any]]]:
    rows = dump["rows"]
    store = MemoryStore()
    store.write_checkpoint(
        CheckpointRows(
            # Dumps made before memory versions hold (key, next dispatch, memory): version 1.
            keys=[(k, str(codec.decode(k)), nd, m, (v or [1])[0]) for k, nd, m, *v in rows["keys"]],
            new_inputs=list(rows["inputs"]),
            runs=list(rows["runs"]),
            outbox=list(rows["outbox"]),
            source=rows["source"],
        ),
        0.0,
    )
    store.put_calls(calls_of(dump))
    inputs = tmp / "in.jsonl"
    inputs.write_text(dump["input_text"])
    got: list[dict[str, Any]] = []
    engine = Engine(
        AgentBinding(agent),
        store,
        JsonlSource(inputs),
        CallbackSink(got.append),
        EngineConfig(checkpoint_interval=0.01),
    )

    async def main() -> None:
        install_task_factory(asyncio.get_running_loop())
        await engine.run()

    asyncio.run(main())
    memory = {codec.decode(k): decode_memory(m) for k, (_t, _nd, m, _v) in store.keys.items()}
    return got, memory


def to_keyed_state(dump: dict[str, Any], agent: Agent) -> MemoryKeyedState:
    """The same checkpoint as Flink keyed state holds it (the layout `_flink_core` writes)."""
    binding = AgentBinding(agent)
    rows = dump["rows"]
    state = MemoryKeyedState()
    events = {seq: (codec.decode(k), ev) for seq, k, ev in rows["inputs"]}
    next_seq = max(events, default=0) + 1
    for k, nd, memory in rows["keys"]:
        view = state.view(codec.decode(k))
        view.put_key(codec.encode({"m": memory, "d": nd, "n": next_seq}))
    running = set()
    for seq, k, base, journal in rows["runs"]:
        key = codec.decode(k)
        event = binding.event_from_wire(codec.decode(events[seq][1]))
        run = RestoredRun(key, seq, event, base, decode_journal(binding, journal))
        state.view(key).put_run(encode_run(binding, run))
        running.add(seq)
        for rec in calls_of(dump):
            if rec.seq == seq:
                state.view(key).put_call(f"{rec.task_id}#{rec.idx}", encode_call(rec))
    for seq, (key, ev) in events.items():
        if seq not in running:
            state.view(key).put_input(seq, ev)
    return state


def remaining_inputs(dump: dict[str, Any]) -> list[dict[str, Any]]:
    offset = dump["rows"]["source"]["position"]["offset"]
    rest = dump["input_text"].encode()[offset:].decode()
    return [json.loads(line) for line in rest.splitlines() if line.strip()]


def replay_flink_core(
    dump: dict[str, Any], agent: Agent
) -> tuple[list[dict[str, Any]], dict[Any, dict[str, Any]]]:
    sim = FlinkSim(agent, to_keyed_state(dump, agent))
    try:
        for row in remaining_inputs(dump):
            sim.element(row["key"], row)
            sim.poll()
        sim.end()
        return sim.outputs, sim.memory()
    finally:
        sim.close()


def outbox_records(dump: dict[str, Any]) -> list[dict[str, Any]]:
    return [codec.decode(rec) for _id, _seq, rec in dump["rows"]["outbox"]]


def test_there_are_golden_journals_with_runs_in_flight() -> None:
    assert len(GOLDEN) >= 2
    for path in GOLDEN:
        dump = load(path)
        assert dump["rows"]["runs"], f"{path.name} has no run in flight"
        statuses = Counter(rec.status for rec in calls_of(dump))
        assert statuses["ok"] >= 1 and statuses["intent"] >= 1, (path.name, statuses)


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_the_embedded_engine_replays_a_golden_journal(path: Path, tmp_path: Path) -> None:
    dump = load(path)
    got, memory = replay_embedded(dump, GoldenAgent(), tmp_path)
    everything = dump["delivered"] + got
    assert per_key(everything) == per_key(dump["expected_outputs"])
    assert sorted(r["id"] for r in everything) == sorted(r["id"] for r in dump["expected_outputs"])
    assert memory == {k: decode_memory(m) for k, m in dump["expected_memory"].items()}


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_the_flink_core_replays_a_golden_journal(path: Path) -> None:
    dump = load(path)
    got, memory = replay_flink_core(dump, GoldenAgent())
    everything = dump["delivered"] + outbox_records(dump) + got
    assert per_key(everything) == per_key(dump["expected_outputs"])
    assert memory == {k: decode_memory(m) for k, m in dump["expected_memory"].items()}


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_a_returned_call_is_answered_from_the_journal(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recorded `screen` result is used, not recomputed: a replay with `screen` giving a
    different answer still outputs the recorded band for the run that was in flight."""
    dump = load(path)
    in_flight = {seq for seq, *_ in dump["rows"]["runs"]}
    recorded = [
        decode_call(encode_call(r))
        for r in calls_of(dump)
        if r.status == "ok" and r.fn.endswith(".screen")
    ]
    assert recorded and all(r.seq in in_flight for r in recorded)
    monkeypatch.setenv("GOLDEN_SCREEN", "recomputed")
    got, _ = replay_embedded(dump, GoldenAgent(), tmp_path)
    by_seq = {r["seq"]: r["output"] for r in got}
    for seq in in_flight:
        assert by_seq[seq]["band"] != "recomputed", f"input {seq}: screen ran again"
    assert any(o["band"] == "recomputed" for o in by_seq.values() if o), "control: new runs call"


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_a_changed_durable_call_is_refused_on_both_engines(path: Path, tmp_path: Path) -> None:
    dump = load(path)
    pattern = (
        r"key '\w+' input \d+, task r>start\.0>enrich\.0>decide: recorded durable "
        r"call\(s\) #0 golden\.golden_agent\.screen"
    )
    with pytest.raises(NonDeterminismError, match=pattern):
        replay_embedded(dump, ChangedCallAgent(), tmp_path)
    with pytest.raises(NonDeterminismError, match=r"task r>start\.0>enrich\.0>decide"):
        replay_flink_core(dump, ChangedCallAgent())


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_a_removed_journaled_action_is_refused_on_both_engines(path: Path, tmp_path: Path) -> None:
    dump = load(path)
    seq, k, *_ = dump["rows"]["runs"][0]
    key = codec.decode(k)
    pattern = rf"replay of key {key!r} input {seq} finished without reaching journaled task"
    with pytest.raises(NonDeterminismError, match=pattern):
        replay_embedded(dump, NoEnrichAgent(), tmp_path)
    with pytest.raises(NonDeterminismError, match="finished without reaching journaled task"):
        replay_flink_core(dump, NoEnrichAgent())
