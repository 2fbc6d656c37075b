"""The pure run machine: ordering, FIFO commit, replay, restore order. No I/O, no clock."""

from __future__ import annotations

import pytest

from ratchet import NonDeterminismError
from ratchet.runtime._machine import Delta, Machine, RestoredRun, Task, TaskResult

# Events are plain tuples here: (type, payload). "out" events leave the agent.
GRAPH = {
    "in": ["a"],  # the input event is heard by action a
    "e": ["b", "c"],  # a emits e; b and c hear it, in that order
    "f": ["d"],
}


def listeners(event: tuple[str, object]) -> list[str]:
    return GRAPH.get(event[0], [])


def is_output(event: tuple[str, object]) -> bool:
    return event[0] == "out"


def machine(cap: int = 64) -> Machine:
    return Machine(listeners, is_output, max_concurrent_runs=cap)


def take(m: Machine) -> list[Task]:
    dispatched, _, _ = m.take_effects()
    return dispatched


def ok(*events: tuple[str, object], stm: list | None = None) -> TaskResult:
    return TaskResult(stm or [], [], list(events))


def test_runs_of_one_key_go_in_input_order_one_at_a_time() -> None:
    m = machine()
    m.admit("k", 0, ("in", 0))
    m.admit("k", 1, ("in", 1))
    m.admit("j", 2, ("in", 2))
    first = take(m)
    # k's second input waits; j runs concurrently with k.
    assert [(t.key, t.seq, t.task_id) for t in first] == [("k", 0, "r>a"), ("j", 2, "r>a")]
    m.finish(first[0], ok(("out", "k0")))
    second = take(m)
    assert [(t.key, t.seq) for t in second] == [("k", 1)]


def test_task_ids_and_dispatch_indexes_follow_the_event_graph() -> None:
    m = machine()
    m.admit("k", 0, ("in", None))
    (a,) = take(m)
    assert (a.task_id, a.dispatch_index) == ("r>a", 0)
    m.finish(a, ok(("e", 1)))
    b, c = take(m)
    assert (b.task_id, b.dispatch_index) == ("r>a.0>b", 1)
    assert (c.task_id, c.dispatch_index) == ("r>a.0>c", 2)
    # The next run of the key continues the key's dispatch counter.
    m.finish(b, ok())
    m.finish(c, ok())
    m.admit("k", 1, ("in", None))
    (a2,) = take(m)
    assert a2.dispatch_index == 3


def test_a_task_that_finishes_early_waits_for_the_fifo_head_before_committing() -> None:
    m = machine()
    m.admit("k", 0, ("in", None))
    (a,) = take(m)
    m.finish(a, ok(("e", 1)))
    b, c = take(m)
    m.finish(c, ok(("out", "from c"), stm=[("s", "c", 1)]))
    # c finished but b (dispatched first) did not: nothing of c is committed yet.
    _, outputs, _ = m.take_effects()
    assert outputs == []
    assert [e.task_id for e in m.in_flight()[0].journal] == ["r>a"]
    m.finish(b, ok(("out", "from b"), stm=[("s", "c", 0)]))
    _, outputs, completed = m.take_effects()
    assert [o.event[1] for o in outputs] == ["from b", "from c"]
    # Memory ops apply in dispatch order: c's write lands last.
    assert m.keys["k"].memory == {"c": 1}
    assert len(completed) == 1


def test_tasks_read_the_memory_as_of_their_dispatch() -> None:
    m = machine()
    m.admit("k", 0, ("in", None))
    (a,) = take(m)
    m.finish(a, ok(("e", 1), stm=[("s", "n", 5)]))
    b, c = take(m)
    assert b.stm == {"n": 5} and c.stm == {"n": 5}
    m.finish(b, ok(stm=[("s", "n", 6)]))
    # c was dispatched before b committed, so its snapshot does not move under it.
    assert c.stm == {"n": 5}


def test_memory_becomes_key_memory_only_when_the_run_completes() -> None:
    m = machine()
    m.admit("k", 0, ("in", None))
    (a,) = take(m)
    m.finish(a, ok(("e", 1), stm=[("s", "n", 5)]))
    assert m.keys["k"].memory == {}
    b, c = take(m)
    m.finish(b, ok())
    m.finish(c, ok())
    assert m.keys["k"].memory == {"n": 5}


def test_max_concurrent_runs_bounds_active_runs() -> None:
    m = machine(cap=2)
    for i in range(5):
        m.admit(f"k{i}", i, ("in", i))
    first = take(m)
    assert [t.key for t in first] == ["k0", "k1"]
    m.finish(first[1], ok())
    assert [t.key for t in take(m)] == ["k2"]


def _journal_after_b(m: Machine) -> RestoredRun:
    """Run the worked example of DESIGN.md up to: A and B committed, C in flight."""
    m.admit("k", 5, ("in", None))
    (a,) = take(m)
    m.finish(a, ok(("e", 1), stm=[("s", "n", 5)]))
    b, c = take(m)
    m.finish(b, ok(stm=[("s", "seen_b", True)]))
    delta = m.capture()
    return delta.runs[5]


def test_replay_skips_journaled_tasks_and_regenerates_the_child_graph() -> None:
    saved = _journal_after_b(machine())
    assert [e.task_id for e in saved.journal] == ["r>a", "r>a.0>b"]
    m = machine()
    m.restore({"k": ({"n": 4}, 0)}, [saved], [(5, "k", ("in", None))])
    dispatched = take(m)
    # Only C runs: A and B are journaled, and C keeps its id and dispatch index.
    assert [(t.task_id, t.dispatch_index) for t in dispatched] == [("r>a.0>c", 2)]
    assert m.tasks_replayed == 2 and m.tasks_executed == 1
    (c,) = dispatched
    assert c.stm == {"n": 5}
    m.finish(c, ok())
    assert m.keys["k"].memory == {"n": 5, "seen_b": True}


def test_replayed_tasks_do_not_emit_their_outputs_again() -> None:
    m = machine()
    m.admit("k", 0, ("in", None))
    (a,) = take(m)
    m.finish(a, ok(("out", "once"), ("f", None)))
    _, outputs, _ = m.take_effects()
    assert [o.id for o in outputs] == ["k:0:r>a:0"]
    saved = m.capture().runs[0]
    m2 = machine()
    m2.restore({}, [saved], [(0, "k", ("in", None))])
    (d,) = take(m2)
    assert d.task_id == "r>a.1>d"
    m2.finish(d, ok())
    _, outputs, completed = m2.take_effects()
    assert outputs == [] and len(completed) == 1


def test_restored_in_flight_runs_start_before_queued_inputs_in_dispatch_order() -> None:
    m = machine(cap=1)
    runs = [
        RestoredRun("y", 7, ("in", None), 10, []),
        RestoredRun("x", 3, ("in", None), 4, []),
    ]
    queued = [
        (1, "q", ("in", None)),
        (3, "x", ("in", None)),
        (7, "y", ("in", None)),
        (8, "x", ("in", None)),
    ]
    m.restore({}, runs, queued)
    started = take(m)
    # Both in-flight runs start (they held slots), x's first (lower dispatch index);
    # the queued input of q waits for a slot even though its seq is older.
    assert [(t.key, t.seq) for t in started] == [("x", 3), ("y", 7)]
    m.finish(started[0], ok())
    m.finish(started[1], ok())
    assert [(t.key, t.seq) for t in take(m)] == [("q", 1)]


def test_changed_agent_is_a_nondeterminism_error_on_replay() -> None:
    saved = _journal_after_b(machine())
    GRAPH["e"] = ["c", "b"]  # the agent's actions were reordered
    try:
        m = machine()
        with pytest.raises(NonDeterminismError, match="dispatched at index"):
            m.restore({"k": ({"n": 4}, 0)}, [saved], [(5, "k", ("in", None))])
    finally:
        GRAPH["e"] = ["b", "c"]


def test_a_failed_capture_is_folded_into_the_next() -> None:
    m = machine()
    m.admit("k", 0, ("in", None))
    m.admit("j", 1, ("in", None))
    first = m.capture()
    a_k, a_j = take(m)
    m.finish(a_k, ok())
    second = m.capture()
    first.absorb(second)
    # k's input was new in the failed capture and done in the next: neither is written.
    assert set(first.new_inputs) == {1}
    assert first.done_inputs == set()
    assert "k" in first.keys
    assert set(first.runs) == {1}


def test_empty_delta_when_nothing_happened() -> None:
    m = machine()
    assert m.capture().is_empty()
    assert isinstance(m.capture(), Delta)
