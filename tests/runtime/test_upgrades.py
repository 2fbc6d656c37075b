"""Upgrading an agent, in process: what is compatible, pinned runs, memory migrations,
`ctx.patched`, and the refusals (the SIGKILL versions are in tests/kill/test_upgrade.py)."""

from __future__ import annotations

import concurrent.futures
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
    Event,
    InputEvent,
    MigrationError,
    OutputEvent,
    StateError,
    action,
    migration,
)
from ratchet.agents._memory import nested
from ratchet.runtime._dispatch import PATCH_FN, REPLAY_FN, TaskCalls
from ratchet.runtime._machine import JournalEntry, Machine, RestoredRun, Task, TaskResult
from ratchet.store._base import CallRecord
from ratchet.store._faulty import FaultyStore
from ratchet.store._memory import MemoryStore
from ratchet.testing import FakeClock
from support.engines import run_embedded, store_memory
from support.fakeclock import START, Drive

RATCHET = [sys.executable, "-m", "ratchet.cli"]


# -- the machine: a pinned run keeps its version's dispatch --------------------------------------


def take(m: Machine) -> list[Task]:
    return m.take_effects()[0]


def ok(*events: tuple[str, object]) -> TaskResult:
    return TaskResult([], [], list(events))


def test_a_pinned_run_dispatches_by_its_table_and_leaves_out_retired_actions() -> None:
    # v1: "in" -> a; "e" -> b, old. v2: "in" -> a; "e" -> new, b (old removed, new inserted).
    v1 = {"in": ["a"], "e": ["b", "old"]}
    v2 = {"in": ["a"], "e": ["new", "b"]}
    m = Machine(
        lambda ev: v2.get(ev[0], []),
        lambda ev: ev[0] == "out",
        known_actions=["a", "b", "new"],
    )
    journal = [JournalEntry("r>a", 0, (), (), (("e", 1),))]
    pinned = RestoredRun(
        "k", 0, ("in", 0), 0, journal, listeners=lambda ev: v1.get(ev[0], []), is_output=None
    )
    m.restore({}, [pinned], [(0, "k", ("in", 0)), (1, "k", ("in", 1))])
    # The recorded a is not run again; e goes to v1's b (index 1) and not to the retired old.
    (b,) = take(m)
    assert (b.task_id, b.dispatch_index, b.seq) == ("r>a.0>b", 1, 0)
    m.finish(b, ok(("out", "done")))
    # The next run started under v2: its e reaches new, then b.
    (a,) = take(m)
    m.finish(a, ok(("e", 2)))
    assert [t.task_id for t in take(m)] == ["r>a.0>new", "r>a.0>b"]


def test_a_retired_action_in_the_journal_is_replayed_not_dropped() -> None:
    v1 = {"in": ["a"], "e": ["old", "b"]}
    m = Machine(lambda ev: [], lambda ev: ev[0] == "out", known_actions=["a", "b"])
    journal = [
        JournalEntry("r>a", 0, (), (), (("e", 1),)),
        JournalEntry("r>a.0>old", 1, (("s", "seen", 1),), (), ()),
    ]
    pinned = RestoredRun("k", 0, ("in", 0), 0, journal, listeners=lambda ev: v1.get(ev[0], []))
    m.restore({}, [pinned], [(0, "k", ("in", 0))])
    (b,) = take(m)
    assert (b.task_id, b.dispatch_index) == ("r>a.0>b", 2)  # old kept its recorded index
    m.finish(b, ok())
    assert m.keys["k"].memory == {"seen": 1}


# -- compatible changes on the same state ----------------------------------------------------------


class Note(Event):
    n: int


class One(Agent):
    @action(InputEvent)
    def first(self, event: InputEvent, ctx: Any) -> None:
        m = ctx.short_term_memory
        m.set("n", m.get("n", 0) + 1)
        ctx.send_event(Note(n=event.input["i"]))

    @action(Note)
    def out(self, event: Note, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output={"i": event.n, "v": 1}))


class Two(Agent):
    """Actions reordered, one added before `out`, `first`'s body changed, a new event type."""

    @action(Note)
    def out(self, event: Note, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output={"i": event.n, "v": 2}))

    @action(Note)
    def extra(self, event: Note, ctx: Any) -> None:
        ctx.send_event(Loud(n=event.n))

    @action(InputEvent)
    def first(self, event: InputEvent, ctx: Any) -> None:
        m = ctx.short_term_memory
        m.set("n", m.get("n", 0) + 1)
        m.set("seen_by_two", True)
        ctx.send_event(Note(n=event.input["i"]))


class Loud(Event):
    n: int


class Three(Agent):
    """`extra` removed again, `out` renamed by `name=`: a new action to the state."""

    @action(InputEvent)
    def first(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("n", ctx.short_term_memory.get("n", 0) + 1)
        ctx.send_event(Note(n=event.input["i"]))

    @action(Note, name="emit")
    def out(self, event: Note, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output={"i": event.n, "v": 3}))


def test_adding_removing_reordering_and_changing_actions_continue_on_the_same_state(
    tmp_path: Path,
) -> None:
    out, state = tmp_path / "o.jsonl", tmp_path / "s"
    rows = [{"key": f"k{i % 3}", "i": i} for i in range(9)]
    ratchet.run(One(), inputs=rows[:3], output=out, state_dir=state)
    ratchet.run(Two(), inputs=rows[:6], output=out, state_dir=state)
    ratchet.run(Three(), inputs=rows, output=out, state_dir=state)
    got = [json.loads(x)["output"] for x in out.read_text().splitlines()]
    assert sorted((g["i"], g["v"]) for g in got) == [(i, 1 + i // 3) for i in range(9)]
    status = subprocess.run(
        [*RATCHET, "status", "--state", str(state), "--json"], capture_output=True, text=True
    )
    summary = json.loads(status.stdout)
    assert summary["actions"] == ["first(ratchet.InputEvent)", f"emit({Note.event_name})"]
    memory = subprocess.run(
        [*RATCHET, "inspect", "--state", str(state), "--json"], capture_output=True, text=True
    )
    assert json.loads(memory.stdout) == {f"k{k}": {"n": 3, "seen_by_two": True} for k in range(3)}


# -- memory migrations -------------------------------------------------------------------------------

MIGRATED: list[Any] = []


class Count(Agent):
    @action(InputEvent)
    def count(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("count", ctx.short_term_memory.get("count", 0) + 1)
        ctx.send_event(OutputEvent(output={"v": ctx.memory_version}))


class CountV3(Agent):
    memory_version = 3

    @migration(1)
    def to_two(self, memory: Any) -> None:
        MIGRATED.append(("1->2", memory.get("count")))
        memory.set("tally", memory.get("count"))
        memory.delete("count")

    @migration(2)
    def to_three(self, memory: Any) -> None:
        MIGRATED.append(("2->3", memory.get("tally")))
        memory.new_object("stats").set("tally", memory.get("tally"))
        memory.delete("tally")

    @action(InputEvent)
    def count(self, event: InputEvent, ctx: Any) -> None:
        m = ctx.short_term_memory
        m.set("stats.tally", m.get("stats.tally", 0) + 1)
        ctx.send_event(OutputEvent(output={"v": ctx.memory_version}))


def test_a_key_is_migrated_once_through_every_version_when_its_next_run_starts() -> None:
    MIGRATED.clear()
    store = MemoryStore()
    first = [{"key": "a"}, {"key": "a"}, {"key": "b"}]
    run_embedded(Count(), first, store)
    # An iterable source resumes at its position: the same rows again, then the new ones.
    got, store, _ = run_embedded(
        CountV3(), first + [{"key": "a"}] * 3 + [{"key": "c"}] * 2, store.reopen()
    )
    # a (count 2) migrated once, in order, at its first run; b is untouched (no run); c is new.
    assert MIGRATED == [("1->2", 2), ("2->3", 2)]
    assert [g["output"] for g in got] == [{"v": 3}] * 5
    memory = {k: nested(v) for k, v in store_memory(store).items()}
    assert memory == {"a": {"stats": {"tally": 5}}, "b": {"count": 1}, "c": {"stats": {"tally": 2}}}
    versions = {k: v for k, (_t, _nd, _m, v) in store.keys.items()}
    assert sorted(versions.values()) == [1, 3, 3]  # b still at 1: migrated when it next runs


def test_a_missing_migration_stops_the_job_naming_the_key_and_version() -> None:
    class Skips(Count):
        memory_version = 3

        @migration(2)
        def only_two(self, memory: Any) -> None:
            pass

    store = MemoryStore()
    run_embedded(Count(), [{"key": "a"}], store)
    before = store.load()
    with pytest.raises(MigrationError, match=r"key 'a' has memory at version 1.*migration\(1\)"):
        run_embedded(Skips(), [{"key": "a"}, {"key": "a"}], store)
    assert store.load().keys == before.keys


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "memory_version = 2\n    @migration(2)\n    def m(self, memory): pass",
            "raise memory_version to 3",
        ),
        ("memory_version = 0", "memory_version must be an int >= 1"),
        (
            "memory_version = 3\n    @migration(1)\n    def m(self, memory): pass\n"
            "    @migration(1)\n    def n(self, memory): pass",
            "two migrations from memory version 1",
        ),
    ],
)
def test_wrong_migration_declarations_are_refused(body: str, message: str) -> None:
    namespace: dict[str, Any] = {"Count": Count, "migration": migration}
    exec(f"class Bad(Count):\n    {body}\n", namespace)  # noqa: S102 - a class body under test
    with pytest.raises(ConfigError, match=message):
        run_embedded(namespace["Bad"](), [])
    with pytest.raises(ConfigError, match="an int >= 1"):
        migration(0)


def test_memory_is_never_migrated_backwards(tmp_path: Path) -> None:
    store = MemoryStore()
    run_embedded(CountV3(), [{"key": "a"}], store)
    with pytest.raises(StateError, match="memory_version 3.*declares memory_version 1"):
        run_embedded(Count(), [{"key": "a"}], store.reopen())


def test_another_agents_state_is_refused_but_a_renamed_agent_sharing_actions_is_not() -> None:
    class Other(Agent):
        @action(InputEvent)
        def unrelated(self, event: InputEvent, ctx: Any) -> None:
            pass

    class Moved(Agent):  # another class name, the same action: a new version of Count
        @action(InputEvent)
        def count(self, event: InputEvent, ctx: Any) -> None:
            ctx.send_event(OutputEvent(output="moved"))

    store = MemoryStore()
    run_embedded(Count(), [{"key": "a"}], store)
    with pytest.raises(StateError, match="has none of those actions"):
        run_embedded(Other(), [{"key": "a"}], store.reopen())
    got, _, _ = run_embedded(Moved(), [{"key": "a"}, {"key": "a"}], store.reopen())
    assert [g["output"] for g in got] == ["moved"]


# -- ctx.patched -----------------------------------------------------------------------------------


class Writer:
    def __init__(self) -> None:
        self.records: list[CallRecord] = []

    def put_call(self, record: CallRecord) -> concurrent.futures.Future[None]:
        self.records.append(record)
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        fut.set_result(None)
        return fut


def rec(idx: int, fn: str, digest: str, status: str = "ok") -> CallRecord:
    return CallRecord(0, "r>a", idx, fn, digest, status, b"\xc0")


def test_patched_is_true_for_a_fresh_task_and_its_marker_goes_with_the_next_call() -> None:
    w = Writer()
    calls = TaskCalls(0, "r>a", "k", {}, w)
    assert calls.patched("x") is True
    assert calls.patched("x") is True  # decided once per execution
    assert w.records == []  # nothing to disagree with yet
    idx, _ = calls.claim("m.f", "d1")
    calls.write(idx, "m.f", "d1", "intent", None).result()
    assert [(r.fn, r.digest) for r in w.records] == [(PATCH_FN, "x"), ("m.f", "d1")]


def test_patched_is_false_when_an_earlier_attempt_got_past_it_without_the_patch() -> None:
    old = {0: rec(0, "m.f", "d1")}  # the old code made this call; the marker is missing
    calls = TaskCalls(0, "r>a", "k", old, Writer())
    assert calls.patched("x") is False
    assert calls.claim("m.f", "d1")[1] is not None  # the old branch finds its record


def test_patched_is_true_when_the_earlier_attempt_recorded_the_marker_or_stopped_before() -> None:
    marked = {0: rec(0, PATCH_FN, "x"), 1: rec(1, "m.g", "d2")}
    calls = TaskCalls(0, "r>a", "k", marked, Writer())
    assert calls.patched("x") is True
    assert calls.claim("m.g", "d2")[1] is not None
    assert calls.unclaimed() == []
    before = {0: rec(0, "m.f", "d1")}  # this call comes before the patch point
    calls = TaskCalls(0, "r>a", "k", before, Writer())
    calls.claim("m.f", "d1")
    assert calls.patched("x") is True
    # A patch removed from the code later leaves markers behind: they are not calls.
    retired = TaskCalls(0, "r>a", "k", {0: rec(0, PATCH_FN, "old-patch")}, Writer())
    assert retired.unclaimed() == []


class DroppingWriter(Writer):
    def __init__(self) -> None:
        super().__init__()
        self.dropped: list[tuple[int, str, int]] = []

    def drop_calls(self, seq: int, task_id: str, idx: int) -> concurrent.futures.Future[None]:
        self.dropped.append((seq, task_id, idx))
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        fut.set_result(None)
        return fut


def test_a_replayed_task_marks_what_it_adds_and_a_refusal_deletes_only_that() -> None:
    w = DroppingWriter()
    calls = TaskCalls(0, "r>a", "k", {0: rec(0, "m.f", "d1"), 1: rec(1, "m.f", "d2")}, w)
    assert calls.claim("m.f", "d1")[1] is not None
    idx, found = calls.claim("m.g", "d3")  # a changed body's new call
    assert found is None and idx == 2
    calls.write(idx, "m.g", "d3", "ok", None).result()
    assert [(r.idx, r.fn) for r in w.records] == [(-2, REPLAY_FN), (2, "m.g")]
    assert [r.idx for r in calls.unclaimed()] == [1]
    calls.discard_new()
    assert w.dropped == [(0, "r>a", 2)]  # from the marker on: the records before stay
    untouched = TaskCalls(0, "r>a", "k", {0: rec(0, "m.f", "d1")}, w)
    untouched.discard_new()  # it added nothing
    assert w.dropped == [(0, "r>a", 2)]


def test_records_after_a_replay_marker_answer_calls_but_are_not_required() -> None:
    # A kill in an attempt that re-executed the task (and might have been refused at its end).
    left = {0: rec(0, "m.f", "d1"), -1: rec(-1, REPLAY_FN, "", "intent"), 1: rec(1, "m.g", "d3")}
    rollback = TaskCalls(0, "r>a", "k", left, Writer())  # the previous version
    assert rollback.patched("x") is False  # its record before the marker is the old path's
    assert rollback.claim("m.f", "d1")[1] is not None
    assert rollback.unclaimed() == []
    again = TaskCalls(0, "r>a", "k", left, Writer())  # the attempt's version, once more
    assert again.claim("m.g", "d3")[1] is not None  # answered, not called again
    assert [r.idx for r in again.unclaimed()] == [0]


# -- a signal a refused or killed attempt took goes back ----------------------------------------


def charge(key: str, n: int, currency: str = "USD") -> str:
    return f"{n} {currency}"


async def pay_then_go(event: InputEvent, ctx: Any) -> None:
    paid = await ctx.durable_execute_async(charge, ctx.key, event.input["n"])
    go = await ctx.wait_for_signal("go")
    ctx.send_event(OutputEvent(output={"n": event.input["n"], "paid": paid, "go": go}))


class PaysThenGo(Agent):
    @action(InputEvent)
    async def gate(self, event: InputEvent, ctx: Any) -> None:
        await pay_then_go(event, ctx)


class ApprovesFirst(PaysThenGo):
    """A changed body: a new wait, then a payment in EUR (a run recorded by PaysThenGo is
    refused at the end). With `hold`, it waits for "never" after taking the approval (the
    engine then stops with it in flight: what a kill there leaves)."""

    hold = False

    @action(InputEvent)
    async def gate(self, event: InputEvent, ctx: Any) -> None:
        approval = await ctx.wait_for_signal("approve")
        if self.hold:
            await ctx.wait_for_signal("never")
        paid = await ctx.durable_execute_async(charge, ctx.key, event.input["n"], "EUR")
        ctx.send_event(OutputEvent(output={"n": event.input["n"], "paid": paid, "a": approval}))


class ApprovesIfPatched(PaysThenGo):
    @action(InputEvent)
    async def gate(self, event: InputEvent, ctx: Any) -> None:
        if not ctx.patched("approve-first"):
            await pay_then_go(event, ctx)
            return
        approval = await ctx.wait_for_signal("approve")
        ctx.send_event(OutputEvent(output={"n": event.input["n"], "a": approval}))


def pending_signals(store: MemoryStore) -> list[tuple[str, str]]:
    return [(k, n) for _i, (k, n, _v, _t, _kt) in sorted(store.signals.items())]


@pytest.mark.parametrize("killed", [False, True], ids=["refused", "killed-then-refused"])
def test_a_signal_a_refused_attempt_took_goes_back_once(killed: bool) -> None:
    clock = FakeClock(START)
    store = MemoryStore(clock)
    first = Drive(PaysThenGo(), [{"key": "k", "n": 0}], store)
    assert first.run().stopped_by == "1 run(s) waiting for signals"
    store.add_signal("k", "approve", "yes")
    if killed:  # it takes the approval, then stops in flight (as a kill would leave it)
        held = ApprovesFirst()
        held.hold = True
        stopped = Drive(held, [{"key": "k", "n": 0}], store := store.reopen())
        assert stopped.run().stopped_by == "1 run(s) waiting for signals"
        assert pending_signals(store) == []  # the record that took it stays (not required)
    refused = Drive(ApprovesFirst(), [{"key": "k", "n": 0}], store := store.reopen())
    with pytest.raises(ratchet.IncompatibleChangeError, match="input 0"):
        refused.run()
    # Refused: what it added is dropped; a signal it took in a new wait is back (a record
    # from the killed attempt, which answered its wait, stays until an attempt is accepted).
    assert pending_signals(store) == ([] if killed else [("k", "approve")])
    store.add_signal("k", "go", 1)
    rows = [{"key": "k", "n": n} for n in range(3)]
    last = Drive(ApprovesIfPatched(), rows, store := store.reopen())
    assert last.run().stopped_by == "1 run(s) waiting for signals"  # input 2: no approval
    assert sorted(last.outputs(), key=lambda o: o["n"]) == [
        {"n": 0, "paid": "0 USD", "go": 1},
        {"n": 1, "a": "yes"},
    ]
    assert pending_signals(store) == []


@pytest.mark.parametrize("after", [False, True], ids=["not-applied", "applied-unanswered"])
def test_a_drop_that_fails_leaves_the_signal_taken_once_and_the_next_end_gives_it_back(
    after: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The refusal's drop fails (a full disk; or it committed and the answer was lost, as a
    kill right after the commit leaves it): the signal is held exactly once, by the record
    that stays or back in the state, and goes once to the next wait for it."""
    clock = FakeClock(START)
    store = MemoryStore(clock)
    assert Drive(PaysThenGo(), [{"key": "k", "n": 0}], store).run().stopped_by
    store.add_signal("k", "approve", "yes")
    store = store.reopen()
    faulty = FaultyStore(store, seed=11, clock=clock).fail("drop_calls", calls=[1], after=after)
    refused = Drive(ApprovesFirst(), [{"key": "k", "n": 0}], store)
    refused.store = faulty  # type: ignore[assignment]
    with pytest.raises(ratchet.IncompatibleChangeError):
        refused.run()
    assert "could not be deleted" in caplog.text
    taken = [r for r in store.calls.values() if r.digest == "approve" and r.status == "ok"]
    assert len(taken) + len(pending_signals(store)) == 1, (faulty.injected, taken)
    store.add_signal("k", "go", 1)
    rows = [{"key": "k", "n": n} for n in range(3)]
    last = Drive(ApprovesIfPatched(), rows, store := store.reopen())
    assert last.run().stopped_by == "1 run(s) waiting for signals"
    assert sorted(last.outputs(), key=lambda o: o["n"])[1] == {"n": 1, "a": "yes"}
    assert pending_signals(store) == []


# -- runs abandon / list / restart refusals ------------------------------------------------------


def test_runs_abandon_moves_the_input_to_the_dead_letters(tmp_path: Path) -> None:
    agents = Path(__file__).parents[1] / "kill" / "upgrade_agents.py"
    state, inputs = tmp_path / "s", tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"key": f"k{i}", "n": i}) + "\n" for i in range(3)))
    # A run parked forever in slow (UPGRADE_STUCK), stopped with SIGTERM: saved in flight.
    (tmp_path / "stuck").write_text("k1")
    env = {"UPGRADE_STUCK": str(tmp_path / "stuck"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(
        [*RATCHET, "run", f"{agents}:V1", "--input", str(inputs), "--output",
         str(tmp_path / "o.jsonl"), "--state", str(state), "--follow"],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out = tmp_path / "o.jsonl"
    for _ in range(3000):
        if out.exists() and len(out.read_text().splitlines()) == 2:
            break
        subprocess.run(["sleep", "0.01"], check=True)
    busy = subprocess.run(
        [*RATCHET, "runs", "restart", "--state", str(state), "--key", "k1"],
        capture_output=True,
        text=True,
    )
    assert busy.returncode == 2 and "in use by pid" in busy.stderr
    proc.terminate()
    proc.communicate(timeout=60)
    listed = json.loads(
        subprocess.run(
            [*RATCHET, "runs", "list", "--state", str(state), "--json"],
            capture_output=True,
            text=True,
        ).stdout
    )
    assert [(str(r["key"]), r["seq"]) for r in listed["in_flight"]] == [("k1", 1)]
    wrong = subprocess.run(
        [*RATCHET, "runs", "abandon", "--state", str(state), "--key", "nope"],
        capture_output=True,
        text=True,
    )
    assert wrong.returncode == 2 and "no run in flight for key 'nope'" in wrong.stderr
    assert "k1 (input 1)" in wrong.stderr and "Traceback" not in wrong.stderr
    done = subprocess.run(
        [*RATCHET, "runs", "abandon", "--state", str(state), "--key", "k1", "--reason", "bad"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "key k1 input 1: abandoned" in done.stdout
    listed = json.loads(
        subprocess.run(
            [*RATCHET, "runs", "list", "--state", str(state), "--json"],
            capture_output=True,
            text=True,
        ).stdout
    )
    assert listed["in_flight"] == []
    assert [(d["key"], d["seq"], d["reason"]) for d in listed["dead_letters"]] == [("k1", 1, "bad")]


def test_the_flink_core_refuses_a_versioned_memory_it_cannot_migrate() -> None:
    from ratchet.agents._context import AgentBinding
    from ratchet.runtime._flink_core import AgentCore

    with pytest.raises(ConfigError, match="Flink engine does not version keyed memory"):
        AgentCore(AgentBinding(CountV3()))


def test_a_pinned_run_sends_an_event_type_new_code_introduced_to_its_new_listeners() -> None:
    from ratchet.agents._context import AgentBinding
    from ratchet.agents._events import Emitted

    class Brand(Event):
        n: int

    class Now(Agent):
        @action(InputEvent)
        def a(self, event: InputEvent, ctx: Any) -> None:
            pass

        @action(Brand)
        def b(self, event: Brand, ctx: Any) -> None:
            pass

    listeners, is_output = AgentBinding(Now()).pinned([("a", ["ratchet.InputEvent"])])
    assert listeners(Emitted(InputEvent, {"input": 1})) == ["a"]
    assert listeners(Emitted(Brand, {"n": 1})) == ["b"]  # no old listener: the new one
    assert not is_output(Emitted(Brand, {"n": 1}))
