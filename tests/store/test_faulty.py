"""FaultyStore: faults at chosen calls or from a seed, recorded, and nothing half-applied."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ratchet import ConfigError
from ratchet.store._base import CallRecord, CheckpointRows, CheckpointStore
from ratchet.store._faulty import FaultyStore, Injected
from ratchet.store._memory import MemoryStore
from ratchet.store._sqlite import SqliteStore
from ratchet.testing import FakeClock

DISK_ERRORS = (OSError, sqlite3.OperationalError)


def keyed(n: int) -> CheckpointRows:
    return CheckpointRows(keys=[(b"k", "k", n, b"m%d" % n, 1)])


def test_it_is_a_checkpoint_store_and_a_fault_free_one_changes_nothing(tmp_path: Path) -> None:
    inner = SqliteStore.open(tmp_path, "a", "f", [])
    store = FaultyStore(inner, seed=1)
    assert isinstance(store, CheckpointStore)
    assert store.write_checkpoint(keyed(1), 5.0)["id"] == 1
    store.put_calls(iter([CallRecord(0, "t", 0, "f", "d", "ok", b"x")]))
    assert store.load() == inner.load() and store.stats() == inner.stats()
    assert store.injected == [] and store.calls["write_checkpoint"] == 1
    store.close()


def test_chosen_calls_fail_before_anything_is_applied() -> None:
    store = FaultyStore(MemoryStore(), seed=3).fail("write_checkpoint", calls=[2, 3])
    outcomes = []
    for n in range(1, 5):
        try:
            outcomes.append(store.write_checkpoint(keyed(n), float(n))["id"])
        except DISK_ERRORS as exc:
            outcomes.append(str(exc).split("(", 1)[1])
    assert outcomes == [
        1,
        "injected by FaultyStore(seed=3) into write_checkpoint call 2)",
        "injected by FaultyStore(seed=3) into write_checkpoint call 3)",
        2,
    ]
    assert store.injected == [("write_checkpoint", 2, "fail"), ("write_checkpoint", 3, "fail")]
    # The failed checkpoints left no trace: key k holds the 4th write, the 1st before it.
    assert store.load().keys == [(b"k", 4, b"m4", 1)]
    assert store.stats()["counts"]["completed"] == 2


def test_a_failure_after_the_call_applies_it_and_still_raises() -> None:
    store = FaultyStore(MemoryStore(), seed=0).fail("write_checkpoint", calls=[1], after=True)
    with pytest.raises(DISK_ERRORS):
        store.write_checkpoint(keyed(1), 1.0)
    assert store.inner.load().keys == [(b"k", 1, b"m1", 1)]  # it happened
    assert store.injected == [Injected("write_checkpoint", 1, "fail_after")]


def test_random_faults_are_a_function_of_the_seed_alone() -> None:
    def fates(seed: int, interleave: bool) -> list[Injected]:
        store = FaultyStore(MemoryStore(), seed=seed).fail("write_checkpoint", rate=0.3)
        store.fail("put_calls", rate=0.5)
        for n in range(60):
            if interleave and n % 3 == 0:
                for _ in range(n % 5):
                    try:
                        store.put_calls([])
                    except DISK_ERRORS:
                        pass
            try:
                store.write_checkpoint(keyed(n), 0.0)
            except DISK_ERRORS:
                pass
        return [i for i in store.injected if i.method == "write_checkpoint"]

    first = fates(11, interleave=False)
    assert 5 < len(first) < 35
    assert fates(11, interleave=False) == first
    # The n-th checkpoint's fate does not depend on how many other calls came between.
    assert fates(11, interleave=True) == first
    assert fates(12, interleave=False) != first


def test_both_kinds_of_disk_error_are_drawn() -> None:
    store = FaultyStore(MemoryStore(), seed=5).fail("load", rate=1.0)
    kinds = set()
    for _ in range(40):
        with pytest.raises(DISK_ERRORS) as info:
            store.load()
        kinds.add(type(info.value))
    assert kinds == {OSError, sqlite3.OperationalError}


def test_a_chosen_exception_is_raised() -> None:
    store = FaultyStore(MemoryStore(), seed=0)
    store.fail("record_restore", calls=[1], error=KeyError("boom"))
    store.fail("stats", calls=[2], error=lambda: SystemExit("crash"))
    with pytest.raises(KeyError, match="boom"):
        store.record_restore()
    store.stats()
    with pytest.raises(SystemExit, match="crash"):
        store.stats()
    assert store.injected == [("record_restore", 1, "fail"), ("stats", 2, "fail")]


def test_delays_sleep_on_the_injected_clock() -> None:
    clock = FakeClock(autojump=True)
    store = FaultyStore(MemoryStore(), seed=2, clock=clock)
    store.delay("put_calls", 2.5, calls=[1]).delay("forget_outputs", (1.0, 2.0), rate=1.0)
    store.put_calls([])
    assert clock.monotonic() == 2.5
    store.put_calls([])
    store.forget_outputs([])
    assert 3.5 <= clock.monotonic() <= 4.5
    assert store.injected == [("put_calls", 1, "delay"), ("forget_outputs", 1, "delay")]


def test_a_failed_count_of_a_failed_checkpoint_is_dropped_not_raised() -> None:
    store = FaultyStore(MemoryStore(), seed=0).fail("count_failed_checkpoint", calls=[1])
    store.count_failed_checkpoint()  # best effort by contract: no error
    store.count_failed_checkpoint()
    assert store.stats()["counts"]["failed"] == 1
    assert store.injected == [("count_failed_checkpoint", 1, "fail")]


def test_a_seed_is_drawn_when_none_is_given() -> None:
    store = FaultyStore(MemoryStore())
    assert isinstance(store.seed, int) and f"seed={store.seed}" in repr(store)


@pytest.mark.parametrize(
    ("configure", "message"),
    [
        (
            lambda s: s.fail("write", calls=[1]),
            r"cannot inject into 'write'; it wraps adopt, load, ",
        ),
        (lambda s: s.fail("load", rate=1.5), r"rate must be between 0 and 1, not 1.5"),
        (lambda s: s.fail("load", calls=[0, 2]), r"call numbers count from 1, got \[0, 2\]"),
        (lambda s: s.delay("load", (2.0, 1.0)), r"seconds must be >= 0 and low <= high"),
    ],
)
def test_a_wrong_configuration_is_refused(configure: object, message: str) -> None:
    store = FaultyStore(MemoryStore(), seed=0)
    with pytest.raises(ConfigError, match=message):
        configure(store)  # type: ignore[operator]
