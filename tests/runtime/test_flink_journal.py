"""The Flink core with an external call journal (in memory here; PostgreSQL in
tests/connectors/test_call_journal.py): a call that returned is never made again after a
restore from a checkpoint that does not hold its record, a record is durable before the action
sees the result, a changed call is refused as on the embedded engine, and a journal that cannot
take a record fails the job instead of the action."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from ratchet import Agent, CheckpointError, InputEvent, OutputEvent, action
from ratchet._errors import IncompatibleChangeError
from ratchet.runtime._flink_core import MemoryKeyedState
from ratchet.store._call_journal import JournalledCall, MemoryCallJournal
from support.engines import FlinkSim


class Calls:
    """Real calls per name, and a gate the second call of an action blocks on."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.factor = 10
        self.journal: MemoryCallJournal | None = None
        self.seen_durable: list[bool] = []

    def count(self, name: str) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + 1


CALLS = Calls()


def quote(v: int) -> int:
    CALLS.count("quote")
    return v * 10


def parked(v: int) -> int:
    CALLS.count("parked")
    CALLS.entered.set()
    CALLS.gate.wait(30)
    return v + 1000


class TwoCalls(Agent):
    """A call that returns at once, then one that parks until the test opens the gate."""

    @action(InputEvent)
    async def handle(self, event: InputEvent, ctx: Any) -> None:
        v = event.input["v"]
        q = await ctx.durable_execute_async(quote, v * CALLS.factor // 10)
        journal = CALLS.journal
        if journal is not None:  # the result is in the journal before the action sees it
            CALLS.seen_durable.append(
                any(c.record.status == "ok" and c.record.fn.endswith("quote")
                    for c in journal.records())
            )  # fmt: skip
        t = await ctx.durable_execute_async(parked, v)
        ctx.short_term_memory.set("sum", ctx.short_term_memory.get("sum", 0) + q + t)
        ctx.send_event(OutputEvent(output={"v": v, "quote": q, "parked": t}))


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.counts.clear()
    CALLS.gate.clear()
    CALLS.entered.clear()
    CALLS.factor = 10
    CALLS.journal = None
    CALLS.seen_durable.clear()


def _crash_while_parked(sim: FlinkSim, key: str, v: int) -> None:
    sim.element(key, {"key": key, "v": v})
    assert CALLS.entered.wait(30), "the parked call never started"
    sim.close()  # the TaskManager is lost; its parked call is abandoned


def _restore(checkpoint: MemoryKeyedState, journal: Any, rows: Sequence[dict[str, Any]] = ()):
    CALLS.gate.set()
    sim = FlinkSim(TwoCalls(), journal=journal)
    sim.state = checkpoint
    for row in rows:  # the source replays the inputs after the checkpoint
        sim.element(row["key"], row)
    sim.end()
    sim.close()
    return sim


def test_a_call_that_returned_after_the_checkpoint_is_not_made_again() -> None:
    journal = MemoryCallJournal()
    CALLS.journal = journal
    sim = FlinkSim(TwoCalls(), journal=journal)
    checkpoint = sim.state.snapshot()  # before the input: the source will replay it
    _crash_while_parked(sim, "k", 1)
    assert CALLS.counts == {"quote": 1, "parked": 1}
    assert CALLS.seen_durable == [True]

    restored = _restore(checkpoint, journal, [{"key": "k", "v": 1}])
    assert [o["output"] for o in restored.outputs] == [{"v": 1, "quote": 10, "parked": 1001}]
    # quote returned before the crash: answered from the journal. parked had not returned.
    assert CALLS.counts == {"quote": 1, "parked": 2}
    assert restored.memory() == {"k": {"sum": 1011}}


def test_a_run_in_flight_in_the_checkpoint_takes_the_records_written_after_it() -> None:
    journal = MemoryCallJournal()
    sim = FlinkSim(TwoCalls(), journal=journal)
    sim.element("k", {"key": "k", "v": 2})
    checkpoint = sim.state.snapshot()  # the run is in flight, no call record in keyed state
    assert CALLS.entered.wait(30)
    sim.close()
    assert CALLS.counts == {"quote": 1, "parked": 1}

    restored = _restore(checkpoint, journal)
    assert [o["output"] for o in restored.outputs] == [{"v": 2, "quote": 20, "parked": 1002}]
    assert CALLS.counts == {"quote": 1, "parked": 2}


def test_without_a_journal_the_call_after_the_checkpoint_is_made_again() -> None:
    sim = FlinkSim(TwoCalls())
    checkpoint = sim.state.snapshot()
    _crash_while_parked(sim, "k", 1)
    _restore(checkpoint, None, [{"key": "k", "v": 1}])
    assert CALLS.counts == {"quote": 2, "parked": 2}  # today's documented window


def test_a_call_whose_arguments_changed_on_replay_is_refused_as_embedded() -> None:
    journal = MemoryCallJournal()
    sim = FlinkSim(TwoCalls(), journal=journal)
    checkpoint = sim.state.snapshot()
    _crash_while_parked(sim, "k", 1)
    CALLS.factor = 20  # the action now calls quote(2) where the journal recorded quote(1)
    with pytest.raises(IncompatibleChangeError, match=r"key 'k' input 0.*were not made again"):
        _restore(checkpoint, journal, [{"key": "k", "v": 1}])


def test_records_of_another_input_at_the_same_number_are_not_used() -> None:
    journal = MemoryCallJournal()
    sim = FlinkSim(TwoCalls(), journal=journal)
    checkpoint = sim.state.snapshot()
    _crash_while_parked(sim, "k", 1)
    # After the restore the key's first input is another one (e.g. files read in another
    # order): the journal's records of input 0 belong to the old one.
    restored = _restore(checkpoint, journal, [{"key": "k", "v": 3}])
    assert [o["output"] for o in restored.outputs] == [{"v": 3, "quote": 30, "parked": 1003}]
    assert CALLS.counts == {"quote": 2, "parked": 2}


def test_completed_runs_are_marked_and_pruned_in_flight_ones_are_kept() -> None:
    journal = MemoryCallJournal()
    CALLS.gate.set()
    sim = FlinkSim(TwoCalls(), journal=journal)
    sim.element("a", {"key": "a", "v": 1})
    sim.end()
    CALLS.gate.clear()
    CALLS.entered.clear()
    sim.element("b", {"key": "b", "v": 2})  # parks: in flight
    assert CALLS.entered.wait(30)
    sim.core._journal_writer.stop()  # flush the completion marks (the writer is one thread)
    sim.core._journal_writer = None
    keys = {c.key for c in journal.records()}
    assert keys == {"a", "b"}
    assert journal.prune(before=0.0) == 0  # nothing completed before the epoch
    assert journal.prune(before=float("inf")) == 2  # a's quote and parked records
    assert {(c.key, c.record.fn.rsplit(".", 1)[-1]) for c in journal.records()} == {
        ("b", "quote"),
        ("b", "parked"),
    }
    CALLS.gate.set()
    sim.close()


class Failing(MemoryCallJournal):
    def put(self, calls: Sequence[JournalledCall]) -> None:
        raise ConnectionError("journal server unreachable")


def test_a_journal_that_cannot_take_a_record_fails_the_job_not_the_action() -> None:
    CALLS.gate.set()
    sim = FlinkSim(TwoCalls(), journal=Failing(), journal_retry_s=0.2)
    sim.element("k", {"key": "k", "v": 1})
    with pytest.raises(CheckpointError, match="did not take durable-call records"):
        sim.end()
    sim.close()
    assert sim.outputs == []  # never an error output as if the tool had failed
    assert CALLS.counts == {}  # the intent was not durable, so the call was not made
