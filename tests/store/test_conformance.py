"""The semantics every `CheckpointStore` backend must have, run against each of them.

The backends are listed once, in `store_backends.py` (BACKENDS). The example tests below pin one
rule each; `test_backends_agree_with_the_model_in_lockstep` drives every backend and a plain
dict model through the same random sequences of writes, restarts and restores, and checks
after every step that each backend loads exactly what the model says.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from store_backends import FAKE_START, Stores

from ratchet._errors import StateError
from ratchet.store import codec
from ratchet.store._base import (
    REPLAY_FN,
    SIGNAL_FN,
    Adopted,
    AgentVersion,
    CallRecord,
    CheckpointRows,
    CheckpointStore,
    Loaded,
    Pinned,
    entry_signal,
)
from ratchet.testing import FakeClock


def rows(**fields: Any) -> CheckpointRows:
    return CheckpointRows(**fields)


def call(
    seq: int, task: str, idx: int, status: str = "ok", payload: bytes | None = b"p"
) -> CallRecord:
    return CallRecord(seq, task, idx, f"mod.fn{idx}", f"digest-{seq}-{idx}", status, payload)


# -- one rule per test ---------------------------------------------------------------------------


def test_a_fresh_store_loads_empty(stores: Stores) -> None:
    store = stores.open()
    empty = {
        "counts": {"completed": 0, "failed": 0, "restored": 0},
        "latest_completed": None,
        "latest_restored": None,
    }
    assert store.load() == Loaded([], [], [], [], [], {}, empty)
    assert store.stats() == empty
    store = stores.reopen(store)
    assert store.load() == Loaded([], [], [], [], [], {}, empty)


def test_a_checkpoint_comes_back_after_a_restart_in_order(stores: Stores) -> None:
    store = stores.open()
    store.write_checkpoint(
        rows(
            keys=[(b"kb", "kb", 3, b"mem-b", 1), (b"ka", "ka", 7, b"mem-a", 1)],
            new_inputs=[(5, b"kb", b"ev5"), (2, b"ka", b"ev2"), (9, b"ka", b"ev9")],
            runs=[(5, b"kb", 1, b"journal5"), (2, b"ka", 4, b"journal2")],
            outbox=[("z", 2, b"rz"), ("b", 5, b"rb"), ("a", 5, b"ra"), ("y", 1, b"ry")],
            source={"next_seq": 10, "position": {"offset": 120, "path": "in.jsonl"}},
        ),
        FAKE_START,
    )
    store = stores.reopen(store)
    loaded = store.load()
    assert loaded.keys == [(b"ka", 7, b"mem-a", 1), (b"kb", 3, b"mem-b", 1)]  # by key
    assert loaded.inputs == [(2, b"ka", b"ev2"), (5, b"kb", b"ev5"), (9, b"ka", b"ev9")]  # by seq
    assert loaded.runs == [(2, b"ka", 4, b"journal2"), (5, b"kb", 1, b"journal5")]  # by seq
    # by seq, then id
    # In the order first written (the order outputs were emitted), not by id: "r>a:10" is
    # emitted after "r>a:9".
    assert loaded.outbox == [("z", 2, b"rz"), ("b", 5, b"rb"), ("a", 5, b"ra"), ("y", 1, b"ry")]
    assert loaded.source == {"next_seq": 10, "position": {"offset": 120, "path": "in.jsonl"}}
    assert loaded.calls == []


def test_rows_are_upserted_by_their_natural_key(stores: Stores) -> None:
    store = stores.open()
    store.write_checkpoint(
        rows(
            keys=[(b"k", "k", 1, b"old", 1)],
            new_inputs=[(0, b"k", b"old")],
            runs=[(0, b"k", 0, b"old")],
            outbox=[("o", 0, b"old")],
        ),
        1.0,
    )
    store.write_checkpoint(
        rows(
            keys=[(b"k", "k", 2, b"new", 1)],
            new_inputs=[(0, b"k", b"new")],
            runs=[(0, b"k", 5, b"new")],
            outbox=[("o", 0, b"new")],
        ),
        2.0,
    )
    # Twice in one checkpoint: the later row wins.
    store.write_checkpoint(
        rows(keys=[(b"j", "j", 1, b"first", 1), (b"j", "j", 9, b"second", 1)]), 3.0
    )
    loaded = stores.reopen(store).load()
    assert loaded.keys == [(b"j", 9, b"second", 1), (b"k", 2, b"new", 1)]
    assert loaded.inputs == [(0, b"k", b"new")]
    assert loaded.runs == [(0, b"k", 5, b"new")]
    assert loaded.outbox == [("o", 0, b"new")]


def test_done_inputs_remove_their_input_and_run_rows(stores: Stores) -> None:
    store = stores.open()
    store.write_checkpoint(
        rows(
            new_inputs=[(0, b"k", b"e0"), (1, b"k", b"e1"), (2, b"j", b"e2")],
            runs=[(0, b"k", 0, b"j0"), (2, b"j", 0, b"j2")],
        ),
        1.0,
    )
    store.write_checkpoint(rows(done_inputs=[0, 2, 99]), 2.0)  # 99: never there, no error
    loaded = stores.reopen(store).load()
    assert loaded.inputs == [(1, b"k", b"e1")]
    assert loaded.runs == []
    # Admitted and done between two checkpoints: never seen again.
    store = stores.open()
    store.write_checkpoint(rows(new_inputs=[(3, b"k", b"e3")], done_inputs=[3]), 1.0)
    assert store.load().inputs == []


def test_completed_removes_the_call_records_of_that_seq_only(stores: Stores) -> None:
    store = stores.open()
    store.put_calls(
        [call(1, "r>a", 0), call(1, "r>a.0>b", 0), call(2, "r>a", 0), call(3, "r>a", 1)]
    )
    store.write_checkpoint(rows(completed=[1, 3]), 1.0)
    assert stores.reopen(store).load().calls == [call(2, "r>a", 0)]


def test_released_and_forgotten_outputs_leave_the_outbox(stores: Stores) -> None:
    store = stores.open()
    store.write_checkpoint(rows(outbox=[("a", 0, b"ra"), ("b", 1, b"rb"), ("c", 2, b"rc")]), 1.0)
    store.write_checkpoint(rows(released=["a", "gone"]), 2.0)
    store.forget_outputs(["c", "never"])
    store.forget_outputs([])
    assert stores.reopen(store).load().outbox == [("b", 1, b"rb")]


def test_an_empty_source_keeps_the_previous_one(stores: Stores) -> None:
    store = stores.open()
    position = {"next_seq": 4, "position": {"index": 4, "pair": (1, "a"), "raw": b"\x00"}}
    store.write_checkpoint(rows(source=position), 1.0)
    store.write_checkpoint(rows(keys=[(b"k", "k", 0, b"m", 1)]), 2.0)
    source = stores.reopen(store).load().source
    assert source == position
    assert type(source["position"]["pair"]) is tuple and type(source["position"]["raw"]) is bytes


def test_checkpoint_ids_count_up_by_one_and_stats_report_the_latest(
    stores: Stores, clock: FakeClock
) -> None:
    store = stores.open()
    infos = []
    for i in range(3):
        r = rows(keys=[(b"k", "k", i, b"m" * i, 1)], outbox=[(f"o{i}", i, b"rec")])
        infos.append(store.write_checkpoint(r, FAKE_START + i + 0.25))
        clock.advance(1.0)
    assert [i["id"] for i in infos] == [1, 2, 3]
    assert infos[-1] == {
        "id": 3,
        "trigger_timestamp": FAKE_START + 2.25,
        "duration_ms": 0.0,  # the fake clock did not move during the write
        "size_bytes": rows(keys=[(b"k", "k", 2, b"mm", 1)], outbox=[("o2", 2, b"rec")]).size(),
    }
    expected = {
        "counts": {"completed": 3, "failed": 0, "restored": 0},
        "latest_completed": infos[-1],
        "latest_restored": None,
    }
    assert store.stats() == expected
    store = stores.reopen(store)
    assert store.stats() == expected and store.load().stats == expected
    assert store.write_checkpoint(rows(), 5.0)["id"] == 4  # the counter survives the restart


def test_trigger_timestamps_are_stored_as_given(stores: Stores) -> None:
    store = stores.open()
    for stamp in (1712345678.123456789, 0.0, 2.5e-7, 4102444800.999999):
        store.write_checkpoint(rows(), stamp)
        store = stores.reopen(store)
        latest = store.stats()["latest_completed"]
        assert latest["trigger_timestamp"] == stamp and type(latest["trigger_timestamp"]) is float


def test_call_records_are_upserted_and_durable_without_a_checkpoint(stores: Stores) -> None:
    store = stores.open()
    store.put_calls([call(4, "r>b", 1, "intent", None), call(4, "r>b", 0, "intent", None)])
    store.put_calls(iter([call(4, "r>b", 0, "ok", b"\x00result")]))  # any iterable
    store.put_calls([call(4, "r>b", 0, "ok", b"\x00result")])  # a retried write: harmless
    store.put_calls([call(2, "r>\u00e9", 0, "error", b"err"), call(2, "r>z", 0)])
    store.put_calls([])
    loaded = stores.reopen(store).load()  # no checkpoint was written
    assert loaded.calls == [
        call(2, "r>z", 0),
        call(2, "r>\u00e9", 0, "error", b"err"),  # by seq, task id (code point order), idx
        call(4, "r>b", 0, "ok", b"\x00result"),
        call(4, "r>b", 1, "intent", None),
    ]
    assert loaded.stats["latest_completed"] is None


def test_record_restore_returns_the_latest_checkpoint_and_counts_it(
    stores: Stores, clock: FakeClock
) -> None:
    store = stores.open()
    assert store.record_restore() is None  # a fresh start restores nothing
    assert store.stats()["counts"]["restored"] == 0
    info = store.write_checkpoint(rows(keys=[(b"k", "k", 1, b"m", 1)]), FAKE_START + 1)
    clock.advance(42.5)
    store = stores.reopen(store)
    restored = store.record_restore()
    assert restored == dict(info, restored_at=FAKE_START + 42.5)
    clock.advance(1.0)
    store = stores.reopen(store)
    again = store.record_restore()
    assert again == dict(info, restored_at=FAKE_START + 43.5)
    store = stores.reopen(store)
    stats = store.stats()
    assert stats["counts"] == {"completed": 1, "failed": 0, "restored": 2}
    assert stats["latest_restored"] == again


def test_a_failed_checkpoint_is_counted(stores: Stores) -> None:
    store = stores.open()
    store.count_failed_checkpoint()
    store.count_failed_checkpoint()
    store = stores.reopen(store)
    assert store.stats()["counts"] == {"completed": 0, "failed": 2, "restored": 0}
    assert store.stats()["latest_completed"] is None


def test_a_checkpoint_that_fails_applies_nothing(stores: Stores) -> None:
    store = stores.open()
    first = rows(
        keys=[(b"k", "k", 1, b"m", 1)], new_inputs=[(0, b"k", b"e")], source={"next_seq": 1}
    )
    store.write_checkpoint(first, 1.0)
    before = store.load()
    bad = rows(
        keys=[(b"k", "k", 2, b"changed", 1), (b"j", "j", 0, b"new", 1)],
        done_inputs=[0],
        source={"next_seq": 2},
        outbox=[("broken", 0)],  # a malformed row (no record), last
    )
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever the backend raises
        store.write_checkpoint(bad, 2.0)
    assert store.load() == before
    assert stores.reopen(store).load() == before


def test_long_term_memories_are_added_replaced_and_deleted_with_their_checkpoint(
    stores: Stores,
) -> None:
    store = stores.open()
    store.write_checkpoint(
        rows(
            ltm_add=[
                ("key:a", "m2", "second", b"meta2", b"vec2", 2.0),
                ("key:a", "m1", "first", b"meta1", b"vec1", 1.0),
                ("shared:x", "m1", "other scope", b"m", b"v", 1.0),
            ]
        ),
        1.0,
    )
    store.write_checkpoint(
        rows(
            ltm_add=[("key:a", "m1", "first, replaced", b"meta1", b"vec1b", 1.0)],
            ltm_delete=[("key:a", "m2"), ("key:a", "never-added")],
        ),
        2.0,
    )
    store = stores.reopen(store)
    assert store.ltm_rows("key:a") == [("m1", "first, replaced", b"meta1", b"vec1b", 1.0)]
    assert store.ltm_rows("shared:x") == [("m1", "other scope", b"m", b"v", 1.0)]
    assert store.ltm_rows("key:nobody") == []
    bad = rows(
        ltm_add=[("key:a", "m3", "third", b"m", b"v", 3.0)],
        outbox=[("broken", 0)],  # a malformed row: the whole checkpoint fails
    )
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever the backend raises
        store.write_checkpoint(bad, 3.0)
    assert [r[0] for r in store.ltm_rows("key:a")] == ["m1"]


# -- signals a replay attempt took ---------------------------------------------------------------


def wait(idx: int, name: str, status: str = "intent", value: Any = None) -> CallRecord:
    payload = codec.encode(value) if status == "ok" else None
    return CallRecord(0, "r>a", idx, SIGNAL_FN, name, status, payload)


def marker(idx: int) -> CallRecord:
    return CallRecord(0, "r>a", idx, REPLAY_FN, "", "intent", None)


def test_a_signal_taken_where_no_replay_marker_covers_stays_taken(stores: Stores) -> None:
    store = stores.open()
    sid = stores.send_signal(store, "k", "go", 1)
    store.put_calls([wait(0, "go")])
    store.consume_signal(sid, wait(0, "go", "ok", 1))
    assert store.signals_after(0) == []
    assert store.release_signals(0, "r>a", [0]) == []  # a first execution's: for good
    store = stores.reopen(store)
    assert store.load().calls == [wait(0, "go", "ok", 1)]
    with pytest.raises(StateError, match="consumed already"):
        store.consume_signal(sid, wait(0, "go", "ok", 1))


def test_dropping_a_replay_attempt_puts_back_the_signals_it_took_as_sent(
    stores: Stores, clock: FakeClock
) -> None:
    store = stores.open()
    first = stores.send_signal(store, "k", "go", "a")
    sent = clock.now()
    clock.advance(5)
    second = stores.send_signal(store, "k", "go", "b")
    (later,) = store.signals_after(first)
    # The original attempt made a call (0); a replay attempt (its marker at -1) took the first
    # signal in a new wait (1).
    store.put_calls([call(0, "r>a", 0), marker(-1), wait(1, "go")])
    store.consume_signal(first, wait(1, "go", "ok", "a"))
    assert [row[0] for row in store.signals_after(0)] == [second]
    store = stores.reopen(store)  # killed before its end: nothing is dropped yet
    back = store.drop_calls(0, "r>a", 1)  # refused at the next attempt's end
    assert back == [(first, "k", "go", codec.encode("a"), sent, "str")]
    assert store.signals_after(0) == [*back, later]  # in its place: the first sent
    assert store.load().calls == [call(0, "r>a", 0)]
    assert store.drop_calls(0, "r>a", 1) == []  # nothing is put back twice
    store = stores.reopen(store)
    assert store.signals_after(0) == [*back, later]


def test_releasing_puts_back_only_the_signals_a_replay_marker_keeps(stores: Stores) -> None:
    store = stores.open()
    a = stores.send_signal(store, "k", "ok", 1)
    b = stores.send_signal(store, 7, "ok", 2)
    # `a` taken by the first execution (0); `b` by a replay attempt (marker -2) at 2.
    store.put_calls([wait(0, "ok")])
    store.consume_signal(a, wait(0, "ok", "ok", 1))
    store.put_calls([call(0, "r>a", 1), marker(-2), wait(2, "ok")])
    store.consume_signal(b, wait(2, "ok", "ok", 2))
    back = store.release_signals(0, "r>a", [0, 1, 2, 9])
    assert [(row[0], row[1], row[5]) for row in back] == [(b, "7", "int")]
    assert [c.idx for c in store.load().calls] == [-2, 0, 1]
    assert store.signals_after(0) == back
    assert store.release_signals(0, "r>a", [2]) == []


# -- signals a failed attempt took, given back before its retry ---------------------------------


def test_a_failed_attempt_gives_back_every_signal_it_took_as_sent(
    stores: Stores, clock: FakeClock
) -> None:
    """Attempt 1 of r>a (its records under "r>a") took "go" 1 and, under a replay marker (a
    kill, then a re-execution), "ok" of the integer key 7; attempt 2 ("r>a#2") took "go" 2.
    Attempt 1 fails and will be retried: its two signals go back with their ids and times
    (in their place: before "go" 3, sent later), its other records and attempt 2's stay."""
    store = stores.open()
    go1 = stores.send_signal(store, "k", "go", 1)
    go1_at = clock.now()
    clock.advance(2)
    ok = stores.send_signal(store, 7, "ok", "yes")
    ok_at = clock.now()
    go2 = stores.send_signal(store, "k", "go", 2)
    go3 = stores.send_signal(store, "k", "go", 3)
    store.put_calls([wait(0, "go")])
    store.consume_signal(go1, wait(0, "go", "ok", 1))
    store.put_calls([call(0, "r>a", 1), marker(-2), wait(2, "ok")])
    store.consume_signal(ok, wait(2, "ok", "ok", "yes"))
    second = CallRecord(0, "r>a#2", 0, SIGNAL_FN, "go", "ok", codec.encode(2))
    store.put_calls([dataclasses.replace(second, status="intent", payload=None)])
    store.consume_signal(go2, second)
    (later,) = store.signals_after(0)
    store = stores.reopen(store)
    clock.advance(5)
    back = store.release_attempt_signals(0, "r>a", "k")
    assert back == [
        (go1, "k", "go", codec.encode(1), go1_at, "str"),
        (ok, "7", "ok", codec.encode("yes"), ok_at, "int"),
    ]
    assert store.signals_after(0) == [*back, later] and later[0] == go3
    assert [(c.task_id, c.idx) for c in store.load().calls] == [
        ("r>a", -2), ("r>a", 1), ("r>a#2", 0)
    ]  # fmt: skip
    assert store.release_attempt_signals(0, "r>a", "k") == []  # nothing goes back twice
    store = stores.reopen(store)
    assert store.signals_after(0) == [*back, later]
    # The next attempt takes "go" 1 again, once.
    store.consume_signal(go1, CallRecord(0, "r>a#3", 0, SIGNAL_FN, "go", "ok", codec.encode(1)))
    with pytest.raises(StateError, match="consumed already"):
        store.consume_signal(go1, wait(0, "go", "ok", 1))


def test_a_failed_attempt_gives_back_a_signal_taken_before_schema_13_as_a_new_one(
    stores: Stores, clock: FakeClock
) -> None:
    """A delivered signal's record that keeps nothing of the signal (written before state
    schema 13) gives back its name and value as a new signal for the run's key, sent now,
    as `ratchet runs restart` does."""
    store = stores.open()
    before = stores.send_signal(store, "k", "other", 0)
    store.put_calls([wait(0, "go", "ok", "old")])  # a record with no `taken`
    clock.advance(4)
    (back,) = store.release_attempt_signals(0, "r>a", 7)
    assert back[0] > before and back[1:] == ("7", "go", codec.encode("old"), clock.now(), "int")
    assert store.load().calls == []
    assert [row[0] for row in store.signals_after(0)] == [before, back[0]]


# -- signals a discarded run took (`ratchet runs restart`, `runs abandon`) -----------------------


def discard(store: CheckpointStore, seq: int, reason: str | None = None) -> dict[str, Any]:
    """`discard_run`: an operation on a stopped job's state, not on the engine's protocol."""
    found: dict[str, Any] = getattr(store, "discard_run")(seq, reason)  # noqa: B009
    return found


def run_that_took_two_signals(stores: Stores, clock: FakeClock) -> tuple[CheckpointStore, list]:
    """Input 0 of key "k" in flight: task r>a took "go" (no replay marker covers its record:
    taken for good, as far as a replay goes) and then, under a replay marker, "ok"; a second
    "go", sent later, is pending. Returns the store and the two taken signals as sent."""
    store = stores.open()
    store.write_checkpoint(
        rows(new_inputs=[(0, codec.encode("k"), b"ev")], runs=[(0, codec.encode("k"), 0, b"\x90")]),
        1.0,
    )
    go = stores.send_signal(store, "k", "go", "first")
    go_at = clock.now()
    clock.advance(3)
    ok = stores.send_signal(store, "k", "ok", 2)
    ok_at = clock.now()
    clock.advance(3)
    stores.send_signal(store, "k", "go", "second")
    store.put_calls([wait(0, "go")])
    store.consume_signal(go, wait(0, "go", "ok", "first"))
    store.put_calls([call(0, "r>a", 1), marker(-2), wait(2, "ok")])
    store.consume_signal(ok, wait(2, "ok", "ok", 2))
    store.write_checkpoint(rows(outbox=[("o", 0, b"out")]), 2.0)
    taken = [
        (go, "k", "go", codec.encode("first"), go_at, "str"),
        (ok, "k", "ok", codec.encode(2), ok_at, "str"),
    ]
    return stores.reopen(store), taken


def test_restarting_a_run_puts_back_every_signal_it_took_as_sent(
    stores: Stores, clock: FakeClock
) -> None:
    store, taken = run_that_took_two_signals(stores, clock)
    (later,) = store.signals_after(0)
    done = discard(store, 0)
    assert done == {
        "journaled_tasks": 0, "call_records": 3, "calls_returned": 3, "unreleased_outputs": 1,
        "signals_put_back": 2,
    }  # fmt: skip
    # In their place by id: the first "go" before the one sent after it, which the run,
    # starting again, would otherwise take first.
    assert store.signals_after(0) == sorted([*taken, later])
    loaded = store.load()
    assert loaded.calls == [] and loaded.runs == [] and loaded.outbox == []
    assert loaded.inputs == [(0, codec.encode("k"), b"ev")]  # it starts again from it
    store = stores.reopen(store)
    assert store.signals_after(0) == sorted([*taken, later])
    with pytest.raises(StateError, match="no run in flight"):
        discard(store, 0)


def test_abandoning_a_run_keeps_its_signals_with_the_dead_letter_until_its_redrive(
    stores: Stores, clock: FakeClock
) -> None:
    store, taken = run_that_took_two_signals(stores, clock)
    (later,) = store.signals_after(0)
    done = discard(store, 0, "stuck")
    assert done["signals_kept"] == 2 and "signals_put_back" not in done
    # Not handed to another input's run of the key meanwhile: only the later "go" is pending.
    assert store.signals_after(0) == [later]
    assert store.load().inputs == []
    assert store.redrive_signals([1]) == []  # not asked for: nothing goes back
    store = stores.reopen(store)
    stores.ask_redrive(store, 1)
    assert store.redrives() == [(1, codec.encode("k"), b"ev")]
    store = stores.reopen(store)
    assert store.redrive_signals([1]) == taken  # as sent, before the redriven run starts
    assert store.signals_after(0) == sorted([*taken, later])
    assert store.redrive_signals([1]) == []  # once: a second admission puts back nothing
    store = stores.reopen(store)
    assert store.redrive_signals([1]) == []
    assert store.signals_after(0) == sorted([*taken, later])


def failed(key: Any, seq: int, detail: dict[str, Any]) -> CheckpointRows:
    """The checkpoint that completes run `seq` in error, as the engine writes it: its input
    and call records go, and a `failed-run` dead letter holds the input and `detail`."""
    letter = (
        codec.encode(key), str(key), seq, b"ev", "ValueError: boom", 5.0, "failed-run",
        codec.encode(detail),
    )  # fmt: skip
    return rows(done_inputs=[seq], completed=[seq], dead_letters=[letter])


ERRORS = {"errors": [{"action": "a", "type": "ValueError", "message": "boom"}], "trace": ["r>a"]}


def test_a_failed_run_keeps_its_signals_with_the_dead_letter_until_its_redrive(
    stores: Stores, clock: FakeClock
) -> None:
    # An action took two signals and then raised: the run ended in error. The checkpoint that
    # writes its dead letter deletes its records, the only place the signals were.
    store, taken = run_that_took_two_signals(stores, clock)
    (later,) = store.signals_after(0)
    store.write_checkpoint(failed("k", 0, ERRORS), 3.0)
    loaded = store.load()
    assert loaded.calls == [] and loaded.runs == [] and loaded.inputs == []
    assert store.signals_after(0) == [later]  # not another run's to take meanwhile
    detail = stores.dead_detail(store, 1)
    assert {k: v for k, v in detail.items() if k != "signals"} == ERRORS  # kept as written
    assert [entry_signal(e) for e in detail["signals"]] == taken  # as abandon keeps them
    assert store.redrive_signals([1]) == []  # not asked for: nothing goes back
    store = stores.reopen(store)
    stores.ask_redrive(store, 1)
    assert store.redrives() == [(1, codec.encode("k"), b"ev")]
    assert store.redrive_signals([1]) == taken  # as sent, before the redriven run starts
    # In their place by id: the first "go" before the one sent after it.
    assert store.signals_after(0) == sorted([*taken, later])
    assert store.redrive_signals([1]) == []  # once
    store = stores.reopen(store)
    assert store.redrive_signals([1]) == []
    assert store.signals_after(0) == sorted([*taken, later])
    detail = stores.dead_detail(store, 1)
    assert "signals" not in detail
    assert [entry_signal(e) for e in detail["signals_put_back"]] == taken


def test_a_failed_run_that_took_no_signal_keeps_its_detail_as_written(stores: Stores) -> None:
    store = stores.open()
    store.write_checkpoint(
        rows(new_inputs=[(0, codec.encode("k"), b"ev")], runs=[(0, codec.encode("k"), 0, b"\x90")]),
        1.0,
    )
    stores.send_signal(store, "k", "go", 1)  # sent, never taken
    store.put_calls([call(0, "r>a", 0)])
    store.write_checkpoint(failed("k", 0, ERRORS), 2.0)
    assert stores.dead_detail(store, 1) == ERRORS
    stores.ask_redrive(store, 1)
    assert store.redrive_signals([1]) == []
    assert [s[2] for s in store.signals_after(0)] == ["go"]


def test_a_signal_taken_before_records_kept_it_comes_back_as_a_new_one(
    stores: Stores, clock: FakeClock
) -> None:
    # A delivered signal's record written as a state before schema 13 holds it: no replay
    # marker and nothing kept of the signal. Restarting the run gives it back for the run's
    # key, as a new signal sent now (its id and time are not known).
    store = stores.open()
    store.write_checkpoint(
        rows(new_inputs=[(0, codec.encode(7), b"ev")], runs=[(0, codec.encode(7), 0, b"\x90")]),
        1.0,
    )
    stores.send_signal(store, "x", "other", 0)
    store.put_calls([wait(0, "go", "ok", "v")])
    clock.advance(10)
    assert discard(store, 0)["signals_put_back"] == 1
    assert store.signals_after(1) == [(2, "7", "go", codec.encode("v"), clock.now(), "int")]


# -- every backend and a model, in lockstep ------------------------------------------------------

KEYS = [b"\x00", b"a", b"b", b"k\xff"]
TASKS = ["r>a", "r>a.0>b", "r>\u00e9", "r>Z"]
OUT_IDS = ["a", "B", "k:0:r>a:0", "k:1:r>a:0"]
seqs = st.integers(0, 6)
blobs = st.binary(max_size=6)
ints = st.integers(-(2**40), 2**40)
stamps = st.floats(allow_nan=False, allow_infinity=False, width=64)
sources: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.just({}),
    st.fixed_dictionaries(
        {
            "next_seq": ints,
            "position": st.dictionaries(
                st.sampled_from(["offset", "line", "path"]), ints | st.text(max_size=4), max_size=3
            ),
        }
    ),
)
key_rows = st.sampled_from(KEYS).flatmap(
    lambda k: st.tuples(st.just(k), st.just(repr(k)), ints, blobs, st.integers(1, 5))
)
checkpoint_rows = st.builds(
    CheckpointRows,
    keys=st.lists(key_rows, max_size=3),
    new_inputs=st.lists(st.tuples(seqs, st.sampled_from(KEYS), blobs), max_size=3),
    done_inputs=st.lists(seqs, max_size=2),
    completed=st.lists(seqs, max_size=2),
    runs=st.lists(st.tuples(seqs, st.sampled_from(KEYS), ints, blobs), max_size=2),
    outbox=st.lists(st.tuples(st.sampled_from(OUT_IDS), seqs, blobs), max_size=3),
    released=st.lists(st.sampled_from(OUT_IDS), max_size=2),
    source=sources,
)
call_records = st.builds(
    CallRecord,
    seq=seqs,
    task_id=st.sampled_from(TASKS),
    idx=st.integers(-2, 2),
    fn=st.sampled_from(["m.f", "m.g"]),
    digest=st.text("0123456789abcdef", max_size=4),
    status=st.sampled_from(["intent", "ok", "error"]),
    payload=st.none() | blobs,
)


class Model:
    """The spec, as plain dicts: what any store must load after the same operations."""

    def __init__(self) -> None:
        self.keys: dict[bytes, tuple[int, bytes, int]] = {}
        self.inputs: dict[int, tuple[bytes, bytes]] = {}
        self.runs: dict[int, tuple[bytes, int, bytes]] = {}
        self.outbox: dict[str, tuple[int, bytes]] = {}
        self.calls: dict[tuple[int, str, int], CallRecord] = {}
        self.source: dict[str, Any] = {}
        self.counts = {"completed": 0, "failed": 0, "restored": 0}
        self.latest: dict[str, Any] | None = None
        self.restored: dict[str, Any] | None = None
        # Signals not consumed: id -> (id, key text, name, value, sent at, key type).
        self.signals: dict[int, tuple[int, str, str, bytes, float, str | None]] = {}
        self.next_signal = 1
        # What a delivered signal's record keeps of the signal: (seq, task, idx) -> [id, key
        # text, sent at, key type]; gone with the record (or when it is written again).
        self.kept: dict[tuple[int, str, int], list[Any]] = {}
        # Dead letters of failed and abandoned runs: id -> {key, event, signals kept, asked}
        self.dead: dict[int, dict[str, Any]] = {}

    def put_calls(self, records: list[CallRecord]) -> None:
        for r in records:
            self.calls[(r.seq, r.task_id, r.idx)] = r
            self.kept.pop((r.seq, r.task_id, r.idx), None)

    def forget(self, keys: list[tuple[int, str, int]]) -> None:
        for k in keys:
            self.calls.pop(k, None)
            self.kept.pop(k, None)

    def send(self, key: Any, name: str, value: Any, now: float) -> int:
        sid, self.next_signal = self.next_signal, self.next_signal + 1
        kind = "int" if isinstance(key, int) else "str"
        self.signals[sid] = (sid, str(key), name, codec.encode(value), now, kind)
        return sid

    def _cover(self, seq: int, task: str, idx: int) -> tuple[int, str, int] | None:
        """The replay marker whose attempt wrote the record at idx: -F with the largest F."""
        marks = [
            i
            for (s, t, i), r in self.calls.items()
            if s == seq and t == task and i < 0 and -i <= idx and r.fn == REPLAY_FN
        ]
        return (seq, task, min(marks)) if marks else None

    def consume(self, sid: int, r: CallRecord) -> None:
        _sid, key_text, _name, _value, sent_at, kind = self.signals.pop(sid)
        self.calls[(r.seq, r.task_id, r.idx)] = r
        self.kept[(r.seq, r.task_id, r.idx)] = [sid, key_text, sent_at, kind]
        mark = self._cover(r.seq, r.task_id, r.idx)
        if mark is not None:
            m = self.calls[mark]
            taken = dict(codec.decode(m.payload)) if m.payload else {}
            taken[r.idx] = [sid, key_text, sent_at, kind]
            self.calls[mark] = dataclasses.replace(m, payload=codec.encode(taken))

    def put_back(self, seq: int, task: str, idxs: list[int]) -> dict[int, Any]:
        back = {}
        for idx in idxs:
            r = self.calls.get((seq, task, idx))
            mark = self._cover(seq, task, idx)
            if r is None or mark is None or r.fn != SIGNAL_FN or r.status != "ok":
                continue
            m = self.calls[mark]
            taken = dict(codec.decode(m.payload)) if m.payload else {}
            if idx not in taken or r.payload is None:
                continue
            sid, key_text, sent_at, kind = taken[idx]
            back[idx] = self.insert((sid, key_text, r.digest, r.payload, sent_at, kind))
        return back

    def insert(self, row: tuple[Any, ...]) -> tuple[int, str, str, bytes, float, str | None]:
        """A signal put back: its own id unless another signal holds it."""
        sid, key_text, name, value, sent_at, kind = row
        if sid in self.signals:
            sid, self.next_signal = self.next_signal, self.next_signal + 1
        self.signals[sid] = (sid, key_text, name, value, sent_at, kind)
        return self.signals[sid]

    def run_signals(self, seq: int) -> list[tuple[Any, ...]]:
        """Every signal run `seq` took, as sent (a replay marker's copy, else the record's
        own), in the order sent."""
        found = []
        for (s, task, idx), r in sorted(self.calls.items()):
            if s != seq or r.fn != SIGNAL_FN or r.status != "ok" or r.payload is None:
                continue
            found.append(self.taken_row((s, task, idx)))
        return sorted(found)

    def taken_row(self, where: tuple[int, str, int]) -> tuple[Any, ...]:
        """The signal a delivered signal's record took, as sent (a replay marker's copy, else
        the record's own)."""
        r = self.calls[where]
        mark = self._cover(*where)
        m = self.calls[mark] if mark is not None else None
        taken = dict(codec.decode(m.payload)) if m is not None and m.payload else {}
        sid, key_text, sent_at, kind = taken.get(where[2]) or self.kept[where]
        return (sid, key_text, r.digest, r.payload, sent_at, kind)

    def discard_run(self, seq: int, abandon: bool, now: float) -> dict[str, Any]:
        key, _base, journal = self.runs.pop(seq)
        mine = sorted(k for k in self.calls if k[0] == seq)
        calls = [self.calls[k] for k in mine if k[2] >= 0]  # a replay marker is not a call
        outputs = [i for i, (s, _rec) in self.outbox.items() if s == seq]
        try:
            tasks = len(codec.decode(journal, unknown="generic"))
        except (codec.CorruptDataError, TypeError):
            tasks = None
        counts: dict[str, Any] = {
            "journaled_tasks": tasks,
            "call_records": len(calls),
            "calls_returned": sum(1 for r in calls if r.status != "intent"),
            "unreleased_outputs": len(outputs),
        }
        taken = self.run_signals(seq)
        if abandon:
            _key, event = self.inputs.pop(seq)
            letter = {"key": key, "event": event, "signals": taken, "asked": False}
            self.dead[max(self.dead, default=0) + 1] = letter
            counts["signals_kept"] = len(taken)
        else:
            counts["signals_put_back"] = len([self.insert(row) for row in taken])
        self.forget(mine)
        for out_id in outputs:
            del self.outbox[out_id]
        return counts

    def write_checkpoint(self, r: CheckpointRows, triggered_at: float) -> dict[str, Any]:
        for key, _text, nd, mem, version in r.keys:
            self.keys[key] = (nd, mem, version)
        for seq, key, ev in r.new_inputs:
            self.inputs[seq] = (key, ev)
        for seq in r.done_inputs:
            self.inputs.pop(seq, None)
            self.runs.pop(seq, None)
        for key, _text, seq, event, _reason, _at, kind, _detail in r.dead_letters:
            # A failed run's letter keeps the signals its run took: its records go now.
            taken = self.run_signals(seq) if kind == "failed-run" and seq in r.completed else []
            letter = {"key": key, "event": event, "signals": taken, "asked": False}
            self.dead[max(self.dead, default=0) + 1] = letter
        self.forget([k for k in self.calls if k[0] in r.completed])
        for seq, key, base, journal in r.runs:
            self.runs[seq] = (key, base, journal)
        for out_id, seq, rec in r.outbox:
            self.outbox[out_id] = (seq, rec)
        for out_id in r.released:
            self.outbox.pop(out_id, None)
        if r.source:
            self.source = r.source
        checkpoint_id = self.latest["id"] + 1 if self.latest else 1
        self.latest = {
            "id": checkpoint_id,
            "trigger_timestamp": triggered_at,
            "duration_ms": 0.0,
            "size_bytes": r.size(),
        }
        self.counts["completed"] += 1
        return dict(self.latest)

    def stats(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "latest_completed": self.latest,
            "latest_restored": self.restored,
        }

    def loaded(self, lazy_keys: bool = False) -> Loaded:
        busy = {k for k, _ev in self.inputs.values()}
        return Loaded(
            keys=[
                (k, nd, mem, v)
                for k, (nd, mem, v) in sorted(self.keys.items())
                if not lazy_keys or k in busy
            ],
            inputs=[(s, k, ev) for s, (k, ev) in sorted(self.inputs.items())],
            runs=[(s, k, b, j) for s, (k, b, j) in sorted(self.runs.items())],
            outbox=[(i, s, rec) for i, (s, rec) in self.outbox.items()],
            calls=[self.calls[k] for k in sorted(self.calls)],
            source=self.source,
            stats=self.stats(),
            stored_keys=len(self.keys),
        )


few_seqs = st.integers(0, 1)
few_tasks = st.sampled_from(TASKS[:2])


class Lockstep(RuleBasedStateMachine):
    def __init__(self, backends: list[Stores], clock: FakeClock) -> None:
        super().__init__()
        self.backends = backends
        self.clock = clock
        self.model = Model()
        self.stores = [b.open() for b in backends]

    def each(self) -> list[tuple[str, CheckpointStore]]:
        return [(b.name, s) for b, s in zip(self.backends, self.stores)]

    @rule(r=checkpoint_rows, triggered_at=stamps)
    def write_checkpoint(self, r: CheckpointRows, triggered_at: float) -> None:
        expected = self.model.write_checkpoint(r, triggered_at)
        for name, store in self.each():
            assert store.write_checkpoint(dataclasses.replace(r), triggered_at) == expected, name

    @rule(records=st.lists(call_records, max_size=4))
    def put_calls(self, records: list[CallRecord]) -> None:
        self.model.put_calls(records)
        for _name, store in self.each():
            store.put_calls([dataclasses.replace(r) for r in records])

    # The rules about signals work on fewer tasks, so that a signal is often taken under a
    # replay marker and then dropped or released.
    @rule(seq=few_seqs, task=few_tasks, from_idx=st.integers(0, 3))
    def drop_calls(self, seq: int, task: str, from_idx: int) -> None:
        m = self.model
        dropped = sorted(i for s, t, i in m.calls if s == seq and t == task and i >= from_idx)
        expected = list(m.put_back(seq, task, dropped).values())
        m.forget([(seq, task, i) for i in [*dropped, -from_idx]])
        for name, store in self.each():
            assert sorted(store.drop_calls(seq, task, from_idx)) == sorted(expected), name

    @rule(seq=few_seqs, task=few_tasks, idxs=st.lists(st.integers(-1, 3), max_size=3))
    def release_signals(self, seq: int, task: str, idxs: list[int]) -> None:
        back = self.model.put_back(seq, task, sorted(set(idxs)))
        self.model.forget([(seq, task, i) for i in back])
        for name, store in self.each():
            got = store.release_signals(seq, task, sorted(set(idxs)))
            assert sorted(got) == sorted(back.values()), name

    # A failed attempt (its records under `task`) to be retried gives back what it took.
    @rule(seq=few_seqs, task=few_tasks)
    def release_attempt_signals(self, seq: int, task: str) -> None:
        m = self.model
        mine = [
            k
            for k, r in sorted(m.calls.items())
            if k[:2] == (seq, task) and r.fn == SIGNAL_FN and r.status == "ok"
        ]
        expected = [m.insert(row) for row in sorted(m.taken_row(k) for k in mine)]
        m.forget(mine)
        for name, store in self.each():
            assert store.release_attempt_signals(seq, task, "k") == expected, name

    @rule(key=st.sampled_from(["k", 7]), name=st.sampled_from(["go", "ok"]), value=ints)
    def send_signal(self, key: Any, name: str, value: int) -> None:
        sid = self.model.send(key, name, value, self.clock.now())
        for b, store in zip(self.backends, self.stores):
            assert b.send_signal(store, key, name, value) == sid, b.name

    @rule(seq=few_seqs, task=few_tasks, first=st.integers(1, 2))
    def replay_marker(self, seq: int, task: str, first: int) -> None:
        self.put_calls([CallRecord(seq, task, -first, REPLAY_FN, "", "intent", None)])

    @rule(data=st.data(), seq=few_seqs, task=few_tasks, idx=st.integers(0, 3))
    def consume_signal(self, data: st.DataObject, seq: int, task: str, idx: int) -> None:
        if not self.model.signals:
            return
        self.take(data.draw(st.sampled_from(sorted(self.model.signals))), seq, task, idx)

    def take(self, sid: int, seq: int, task: str, idx: int) -> None:
        _i, _k, name, value, _t, _kt = self.model.signals[sid]
        record = CallRecord(seq, task, idx, SIGNAL_FN, name, "ok", value)
        self.model.consume(sid, record)
        for _name, store in self.each():
            store.consume_signal(sid, dataclasses.replace(record))
            with pytest.raises(StateError):  # once only
                store.consume_signal(sid, dataclasses.replace(record))

    def some_seq(self, data: st.DataObject) -> int:
        """Mostly the input of a run in flight (if there is one)."""
        runs = sorted(self.model.runs)
        return data.draw(st.sampled_from(runs) if runs else few_seqs | seqs)

    # A signal sent and taken at once by a run in flight: runs often hold signals when they
    # are discarded.
    @rule(data=st.data(), task=few_tasks, idx=st.integers(0, 3), key=st.sampled_from(["k", 7]))
    def send_and_take(self, data: st.DataObject, task: str, idx: int, key: Any) -> None:
        self.send_signal(key, "go", idx)
        self.take(max(self.model.signals), self.some_seq(data), task, idx)

    @rule(seq=few_seqs, key=st.sampled_from(KEYS), journal=blobs, takes=st.integers(0, 2))
    def start_run(self, seq: int, key: bytes, journal: bytes, takes: int) -> None:
        """An input and its run in flight, which takes `takes` signals."""
        r = rows(new_inputs=[(seq, key, b"ev%d" % seq)], runs=[(seq, key, 0, journal)])
        self.write_checkpoint(r, self.clock.now())
        for idx in range(takes):
            self.send_signal("k", "go", idx)
            self.take(max(self.model.signals), seq, TASKS[0], idx)

    # `ratchet runs restart` (abandon False) and `runs abandon` of the run of input `seq`.
    @rule(data=st.data(), abandon=st.booleans())
    def discard_run(self, data: st.DataObject, abandon: bool) -> None:
        m = self.model
        seq = self.some_seq(data)
        if seq not in m.runs or (abandon and seq not in m.inputs):
            for name, store in self.each():
                with pytest.raises(StateError):
                    discard(store, seq, "abandoned" if abandon else None)
                assert store.load() == m.loaded(), name  # nothing of it was done
            return
        if abandon:
            try:  # the dead letter names the key by its text
                codec.decode(m.runs[seq][0])
            except codec.CorruptDataError:
                return
        expected = m.discard_run(seq, abandon, self.clock.now())
        for name, store in self.each():
            assert discard(store, seq, "abandoned" if abandon else None) == expected, name

    # A run in flight ends in error: the checkpoint that completes it writes its dead letter
    # (the engine's detail: errors and trace) and deletes its records. `took_none`: a run
    # that took no signal (or a letter for no run of that seq) keeps its detail as written.
    @rule(data=st.data(), took_none=st.integers(0, 3).map(lambda n: n == 0))
    def fail_run(self, data: st.DataObject, took_none: bool) -> None:
        seq = self.some_seq(data)
        key = self.model.runs[seq][0] if seq in self.model.runs else KEYS[1]
        try:  # the dead letter names the key by its text
            text = str(codec.decode(key))
        except codec.CorruptDataError:
            return
        if took_none:
            self.write_checkpoint(rows(completed=[seq]), self.clock.now())
        detail = codec.encode(ERRORS)
        letter = (key, text, seq, b"ev%d" % seq, "E: x", self.clock.now(), "failed-run", detail)
        r = rows(done_inputs=[seq], completed=[seq], dead_letters=[letter])
        self.write_checkpoint(r, self.clock.now())

    # A redrive admits a failed or abandoned run's dead letter: asked for (`ratchet redrive`),
    # then its signals go back, once, before the engine starts the new run.
    @precondition(lambda self: self.model.dead)
    @rule(data=st.data(), ask=st.integers(0, 3).map(bool))  # mostly asked for
    def redrive(self, data: st.DataObject, ask: bool) -> None:
        m = self.model
        dead_id = data.draw(st.sampled_from(sorted(m.dead)))
        letter = m.dead[dead_id]
        if ask and not letter["asked"]:
            letter["asked"] = True
            for b, store in zip(self.backends, self.stores):
                b.ask_redrive(store, dead_id)
        expected = []
        if letter["asked"]:
            expected = [m.insert(row) for row in letter["signals"]]
            letter["signals"] = []
        for name, store in self.each():
            assert store.redrive_signals([dead_id]) == expected, name

    @invariant()
    def every_backend_lists_the_redrives_the_model_asked_for(self) -> None:
        asked = [
            (i, d["key"], d["event"]) for i, d in sorted(self.model.dead.items()) if d["asked"]
        ]
        for name, store in self.each():
            assert [tuple(r) for r in store.redrives()] == asked, name

    @invariant()
    def every_backend_keeps_with_dead_letters_the_signals_the_model_keeps(self) -> None:
        for i, letter in self.model.dead.items():
            for b, store in zip(self.backends, self.stores):
                detail = b.dead_detail(store, i) or {}
                kept = [entry_signal(e) for e in detail.get("signals", [])]
                assert kept == letter["signals"], (b.name, i)

    @invariant()
    def every_backend_holds_the_signals_the_model_holds(self) -> None:
        expected = [self.model.signals[i] for i in sorted(self.model.signals)]
        for name, store in self.each():
            assert store.signals_after(0) == expected, name

    @rule(ids=st.lists(st.sampled_from(OUT_IDS), max_size=3))
    def forget_outputs(self, ids: list[str]) -> None:
        for out_id in ids:
            self.model.outbox.pop(out_id, None)
        for _name, store in self.each():
            store.forget_outputs(list(ids))

    @rule()
    def count_failed_checkpoint(self) -> None:
        self.model.counts["failed"] += 1
        for _name, store in self.each():
            store.count_failed_checkpoint()

    @rule()
    def record_restore(self) -> None:
        expected = None
        if self.model.latest is not None:
            self.model.counts["restored"] += 1
            expected = self.model.restored = dict(self.model.latest, restored_at=self.clock.now())
        for name, store in self.each():
            assert store.record_restore() == expected, name

    @rule()
    def restart(self) -> None:
        self.stores = [b.reopen(s) for b, s in zip(self.backends, self.stores)]

    @rule(seconds=st.floats(0, 1e6))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def every_backend_loads_what_the_model_holds(self) -> None:
        expected = self.model.loaded()
        lazy = self.model.loaded(lazy_keys=True)
        for name, store in self.each():
            assert store.load() == expected, name
            # A lazy restore reads the keys with inputs now and every other key by key_row.
            assert store.load(lazy_keys=True) == lazy, name
            for k, (nd, mem, v) in self.model.keys.items():
                assert store.key_row(k) == (nd, mem, v), (name, k)
            assert store.key_row(b"\xa9not a key") is None, name

    def teardown(self) -> None:
        for b, s in zip(self.backends, self.stores):
            b.close(s)


def test_backends_agree_with_the_model_in_lockstep(
    all_stores: list[Stores], clock: FakeClock
) -> None:
    run_state_machine_as_test(
        lambda: Lockstep(all_stores, clock),  # type: ignore[arg-type]  # a factory is allowed
        settings=settings(max_examples=80, stateful_step_count=30, deadline=None),
    )


# -- adopting an agent version -------------------------------------------------------------------

V1 = AgentVersion("conformance.Agent", "0123456789abcdef", [("act", ["ratchet.InputEvent"])])
V2 = AgentVersion(
    "conformance.Agent", "fedcba9876543210", [("new", ["x.E"]), ("act", ["ratchet.InputEvent"])], 2
)


def test_adopting_a_new_version_pins_the_runs_in_flight_until_they_complete(stores: Stores) -> None:
    store = stores.open()
    assert store.adopt(V1) == Adopted({}, None)
    store.write_checkpoint(
        rows(new_inputs=[(3, b"k", b"e3"), (4, b"j", b"e4")], runs=[(3, b"k", 0, b"j3")]), 1.0
    )
    pinned_v1 = Adopted({3: Pinned(V1.table, 1)}, "0123456789abcdef.m1")
    assert store.adopt(V2, dry_run=True) == pinned_v1
    store = stores.reopen(store)
    assert store.adopt(V2, dry_run=True) == pinned_v1, "a dry run records nothing"
    assert store.adopt(V2) == pinned_v1
    store = stores.reopen(store)
    # Still pinned after a restart; a run that starts under v2 is not.
    store.write_checkpoint(rows(runs=[(4, b"j", 0, b"j4")]), 2.0)
    assert store.adopt(V2) == Adopted({3: Pinned(V1.table, 1)}, None)
    store.write_checkpoint(rows(done_inputs=[3], completed=[3]), 3.0)
    store = stores.reopen(store)
    assert store.adopt(V2) == Adopted({}, None), "a completed run's pin goes"
    # Back to v1 while v2's run 4 is in flight: that run keeps v2.
    assert store.adopt(V1) == Adopted({4: Pinned(V2.table, 2)}, "fedcba9876543210.m2")


def test_adoption_refuses_memory_newer_than_the_agent_and_another_agent(stores: Stores) -> None:
    store = stores.open()
    store.adopt(V2)
    store.write_checkpoint(rows(keys=[(b"k", "k", 1, b"m", 2)]), 1.0)
    with pytest.raises(StateError, match="memory_version 2.*declares memory_version 1"):
        store.adopt(V1)
    other = AgentVersion(
        "other.Agent", "1111111111111111", [("unrelated", ["ratchet.InputEvent"])], 2
    )
    with pytest.raises(StateError, match="has none of those actions"):
        store.adopt(other)
    store = stores.reopen(store)
    assert store.adopt(V2) == Adopted({}, None), "the refusals changed nothing"
