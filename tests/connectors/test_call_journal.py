"""The durable-call journal's conformance suite: the in-memory reference and PostgreSQL (a real
server on a free loopback port, started by `conftest.postgres`) behave the same; then the
PostgreSQL journal under the Flink core, and its errors (a bad DSN, an unreachable server)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ratchet import ConfigError
from ratchet.store._base import CallRecord
from ratchet.store._call_journal import CallJournalStore, JournalledCall, MemoryCallJournal


def _call(key: str, seq: int, task: str, idx: int, status: str = "ok", inp: str = "i0"):
    payload = None if status == "intent" else f"{key}:{seq}:{task}:{idx}:{status}".encode()
    return JournalledCall(key, inp, CallRecord(seq, task, idx, "m.fn", "d1", status, payload))


@pytest.fixture(params=["memory", "postgres"])
def journal(request: pytest.FixtureRequest) -> Iterator[CallJournalStore]:
    if request.param == "memory":
        yield MemoryCallJournal()
        return
    from ratchet.connectors._pg_journal import PostgresCallJournal

    server = request.getfixturevalue("postgres")
    j = PostgresCallJournal(server.dsn, f"test-{uuid.uuid4().hex[:8]}")
    try:
        yield j
    finally:
        j.clear()
        j.close()


def test_put_then_get_returns_a_keys_records_in_order(journal: CallJournalStore) -> None:
    journal.put([_call("k", 1, "t", 1), _call("k", 0, "t", 0), _call("other", 0, "t", 0)])
    got = journal.get("k")
    assert [(c.record.seq, c.record.idx) for c in got] == [(0, 0), (1, 1)]
    assert got[0] == _call("k", 0, "t", 0)  # bytes come back as bytes, every field intact
    assert journal.keys() == {"k", "other"}
    assert journal.get("nobody") == []


def test_an_intent_is_overwritten_a_terminal_record_never(journal: CallJournalStore) -> None:
    journal.put([_call("k", 0, "t", 0, "intent")])
    journal.put([_call("k", 0, "t", 0, "ok")])
    assert journal.get("k")[0].record.status == "ok"
    journal.put([_call("k", 0, "t", 0, "intent")])  # a zombie's late intent
    journal.put([_call("k", 0, "t", 0, "error")])
    assert journal.get("k")[0] == _call("k", 0, "t", 0, "ok")
    journal.put([_call("k", 0, "t", 0, "ok")])  # a retried write is harmless
    assert len(journal.get("k")) == 1


def test_prune_deletes_only_runs_completed_before_the_bound(journal: CallJournalStore) -> None:
    journal.put([_call("k", s, "t", 0) for s in range(4)] + [_call("j", 0, "t", 0)])
    journal.complete([("k", 1)], at=100.0)  # runs 0 and 1 of k
    journal.complete([("k", 2), ("j", 0)], at=200.0)
    assert journal.prune(before=100.0) == 0
    assert journal.prune(before=150.0) == 2
    assert [c.record.seq for c in journal.get("k")] == [2, 3]
    journal.complete([("k", 2)], at=50.0)  # a completion marked again keeps its first time
    assert journal.prune(before=150.0) == 0
    assert journal.prune(before=1e12) == 2
    assert [c.record.seq for c in journal.get("k")] == [3]  # in flight: never pruned
    journal.clear()
    assert journal.keys() == set()


def test_namespaces_do_not_see_each_other(postgres: Any) -> None:
    from ratchet.connectors._pg_journal import PostgresCallJournal

    a = PostgresCallJournal(postgres.dsn, "ns-a")
    b = PostgresCallJournal(postgres.dsn, "ns-b")
    try:
        a.put([_call("k", 0, "t", 0)])
        assert b.get("k") == [] and b.keys() == set()
        b.clear()
        assert a.count() == 1
    finally:
        a.clear()
        a.close()
        b.close()


def test_a_bad_dsn_and_an_unreachable_server_are_config_errors_without_the_password(
    postgres: Any,
) -> None:
    from connector_servers import free_port

    from ratchet.connectors._pg_journal import PostgresCallJournal

    with pytest.raises(ConfigError, match=r"--call-journal mysql://u:\*\*\*@h/db: give a Postgre"):
        PostgresCallJournal("mysql://u:secret@h/db", "ns")
    with pytest.raises(ConfigError, match="--call-journal postgresql://.*invalid") as bad:
        PostgresCallJournal("postgresql://u:secret@127.0.0.1/db?bogus_option=1", "ns")
    assert "secret" not in str(bad.value)
    dead = f"postgresql://u:secret@127.0.0.1:{free_port()}/db"
    with pytest.raises(ConfigError, match="cannot use PostgreSQL: .*refused") as down:
        PostgresCallJournal(dead, "ns", connect_timeout=2)
    assert "secret" not in str(down.value) and "secret" not in repr(down.value)


def test_the_flink_core_on_postgres_never_repeats_a_returned_call(postgres: Any) -> None:
    """tests/runtime/test_flink_journal.py's first scenario, on the real journal."""
    import journal_agent as agent

    from ratchet.connectors._pg_journal import PostgresCallJournal
    from support.engines import FlinkSim

    agent.reset()
    journal = PostgresCallJournal(postgres.dsn, f"core-{uuid.uuid4().hex[:8]}")
    try:
        sim = FlinkSim(agent.Parks(), journal=journal)
        checkpoint = sim.state.snapshot()
        sim.element("k", {"key": "k", "v": 1})
        assert agent.ENTERED.wait(30)
        sim.close()
        assert agent.COUNTS == {"quote": 1, "parked": 1}
        agent.GATE.set()
        restored = FlinkSim(agent.Parks(), journal=journal)
        restored.state = checkpoint
        restored.element("k", {"key": "k", "v": 1})
        restored.end()
        restored.close()
        assert [o["output"] for o in restored.outputs] == [{"quote": 10, "parked": 1001}]
        assert agent.COUNTS == {"quote": 1, "parked": 2}
    finally:
        journal.clear()
        journal.close()
