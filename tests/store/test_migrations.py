"""SQLite schema versions: recorded, migrated forward in one transaction, newer ones refused.

`data/schema_v1/ratchet.db` was written by the schema-1 store, SIGKILLed with a run in
flight (see data/README.md); opening it with this code must migrate it and resume the job.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

from ratchet import StateError, run
from ratchet.agents._run import load_agent
from ratchet.runtime._memops import from_wire
from ratchet.store import _sqlite, codec
from ratchet.store._sqlite import DB_NAME, SCHEMA_VERSION, SqliteStore
from ratchet.store._traces import pack_trace

DATA = Path(__file__).with_name("data")
AGENT = f"{DATA / 'schema_v1_agent.py'}:SchemaV1Agent"
OWNER = ("t.Agent", "0123456789abcdef", ["act(ratchet.InputEvent)"])


def v1_state(tmp_path: Path) -> Path:
    """A copy of the schema-1 state (and its input file) to open and change."""
    state = tmp_path / "state"
    state.mkdir()
    shutil.copyfile(DATA / "schema_v1" / DB_NAME, state / DB_NAME)
    shutil.copyfile(DATA / "schema_v1" / "in.jsonl", tmp_path / "in.jsonl")
    return state


def raw(state: Path) -> dict[str, Any]:
    """What the file says, read with plain sqlite3 (no ratchet code in between)."""
    conn = sqlite3.connect(state / DB_NAME)
    try:
        (meta,) = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
        return {
            "schema_version": codec.decode(meta),
            "user_version": conn.execute("PRAGMA user_version").fetchone()[0],
            "indexes": {
                r[0]
                for r in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
                )
            },
            "schema": sorted(
                " ".join(r[0].split())
                for r in conn.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL")
            ),
        }
    finally:
        conn.close()


def test_the_checked_in_state_is_schema_1() -> None:
    # The fixture must stay old; if this fails, it was overwritten by newer code.
    conn = sqlite3.connect(f"file:{DATA / 'schema_v1' / DB_NAME}?mode=ro&immutable=1", uri=True)
    try:
        (meta,) = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
        assert codec.decode(meta) == 1
        assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 1
    finally:
        conn.close()


def test_a_new_state_has_every_migration_and_records_the_version(tmp_path: Path) -> None:
    SqliteStore.open(tmp_path / "new", *OWNER).close()
    state = v1_state(tmp_path)
    SqliteStore.open(state, "x", "23089098ff38160f", []).close()
    new, migrated = raw(tmp_path / "new"), raw(state)
    assert new["schema_version"] == new["user_version"] == SCHEMA_VERSION
    assert "keys_by_text" in new["indexes"]
    # A new state makes traces and ltm when it first writes them: not there yet.
    assert not any(" traces(" in s or " ltm(" in s for s in new["schema"])
    store = SqliteStore.open(tmp_path / "new", *OWNER)
    store.ensure_tables()
    store.close()
    # Created in one go or migrated step by step: the same schema.
    assert raw(tmp_path / "new") == migrated


def test_a_schema_1_state_is_migrated_and_its_job_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = v1_state(tmp_path)
    assert raw(state)["schema_version"] == 1 and raw(state)["user_version"] == 0
    agent = load_agent(AGENT)
    priced = sys.modules[type(agent).__module__].PRICED
    priced.clear()
    monkeypatch.chdir(tmp_path)  # the checkpointed source position names "in.jsonl"

    result = run(agent, inputs="in.jsonl", output="out.jsonl", state_dir="state")

    after = raw(state)
    assert after["schema_version"] == after["user_version"] == SCHEMA_VERSION  # 2 today
    assert "keys_by_text" in after["indexes"]
    # The in-flight run came back and completed; its recorded call was not made again.
    assert result.restored_runs == 1 and result.inputs == 0 and result.runs_completed == 1
    assert result.metrics == {"durable_calls.replayed": 1} and priced == []
    outputs = [json.loads(line) for line in Path("out.jsonl").read_text().splitlines()]
    assert [(o["key"], o["seq"], o["output"]) for o in outputs] == [
        ("bob", 4, {"value": 2, "price": 21})
    ]
    store = SqliteStore.open_readonly(state)
    try:
        memories = {codec.decode(k): dict(from_wire(codec.decode(m))) for k, m in store.memories()}
        # What store.memories(text) asks: a string key by its primary key, any other key by
        # keys_by_text.
        plan = store.conn.execute(
            f"EXPLAIN QUERY PLAN SELECT key FROM keys WHERE key = ? AND key_text = ? UNION "
            f"ALL SELECT key FROM keys WHERE key_text = ? AND NOT {_sqlite._KEY_IS_STR}",
            (codec.encode("bob"), "bob", "bob"),
        ).fetchall()
    finally:
        store.close()
    assert memories == {
        "alice": {"count": 2, "total": 7, "last_price": 41},
        "bob": {"count": 2, "total": 7, "last_price": 21},  # tally's write applied once
        "carol": {"count": 1, "total": 1, "last_price": 11},
    }
    # `inspect --key` does not scan the table
    assert "USING PRIMARY KEY" in str(plan) and "INDEX keys_by_text" in str(plan)


def test_reading_an_old_state_does_not_migrate_it(tmp_path: Path) -> None:
    state = v1_state(tmp_path)
    store = SqliteStore.open_readonly(state)
    try:
        assert store.summary()["in_flight_runs"] == 1
        assert sorted(str(codec.decode(k)) for k, _ in store.memories()) == [
            "alice",
            "bob",
            "carol",
        ]
    finally:
        store.close()
    assert raw(state)["schema_version"] == 1


def test_a_failed_migration_leaves_the_state_at_its_old_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = v1_state(tmp_path)
    broken = ("CREATE TABLE later(x INTEGER)", "CREATE INDEX nowhere ON missing(x)")
    monkeypatch.setattr(_sqlite, "_MIGRATIONS", [*_sqlite._MIGRATIONS, broken])
    monkeypatch.setattr(_sqlite, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(
        StateError,
        match=rf"could not be migrated from state schema 1 to {SCHEMA_VERSION + 1} \(no such "
        r"table: main.missing\); nothing was changed, it is still at schema 1",
    ):
        SqliteStore.open(state, "x", "23089098ff38160f", [])
    after = raw(state)
    # All or nothing: not even migration 2 (which would have succeeded) was kept.
    assert (after["schema_version"], after["user_version"]) == (1, 0)
    assert "keys_by_text" not in after["indexes"] and not any("later" in s for s in after["schema"])
    monkeypatch.undo()
    SqliteStore.open(state, "x", "23089098ff38160f", []).close()  # the real migrations work
    assert raw(state)["schema_version"] == SCHEMA_VERSION


def test_a_state_from_a_newer_ratchet_is_refused_and_left_untouched(tmp_path: Path) -> None:
    store = SqliteStore.open(tmp_path / "s", *OWNER)
    store._set_meta("schema_version", SCHEMA_VERSION + 1)
    store.close()
    newer, ours = SCHEMA_VERSION + 1, SCHEMA_VERSION
    message = (
        rf"{tmp_path / 's' / DB_NAME} was written with state schema {newer}; this ratchet reads "
        rf"schema {ours} \(and migrates older ones\).*upgrade ratchet to a version that reads "
        rf"schema {newer}, or point --state at a new directory"
    )
    with pytest.raises(StateError, match=message):
        SqliteStore.open(tmp_path / "s", *OWNER)
    with pytest.raises(StateError, match=message):
        SqliteStore.open_readonly(tmp_path / "s")  # `status` and `inspect` refuse it too
    assert raw(tmp_path / "s")["schema_version"] == newer


@pytest.mark.parametrize("version", [0, "2", None])
def test_a_schema_version_no_ratchet_writes_is_refused(tmp_path: Path, version: Any) -> None:
    store = SqliteStore.open(tmp_path / "s", *OWNER)
    store._set_meta("schema_version", version)
    store.close()
    with pytest.raises(StateError, match=rf"records state schema {version!r}, which no ratchet"):
        SqliteStore.open(tmp_path / "s", *OWNER)


def _schema_11_state(state: Path, traced_table: bool) -> None:
    """A state as the schema-11 store made it: every migration up to 11, with (or without,
    as a new state has until its first trace) a traces table holding one untyped trace."""
    state.mkdir()
    conn = sqlite3.connect(state / DB_NAME, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        SqliteStore._apply(conn, 0, 11)
        if not traced_table:
            conn.execute("DROP TABLE traces")
        else:
            conn.execute(
                "INSERT INTO traces(key_text, seq, at, status, trace) VALUES ('1', 0, 1.0, 'ok', ?)",
                (pack_trace(1.0, []),),
            )
        meta = SqliteStore._initial_meta(*OWNER, _sqlite.SYSTEM_CLOCK)
        conn.executemany(
            "INSERT INTO meta(name, value) VALUES (?, ?)",
            [(k, codec.encode(11 if k == "schema_version" else v)) for k, v in meta.items()],
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


@pytest.mark.parametrize("traced_table", [True, False], ids=["traces", "no-traces-yet"])
def test_a_schema_11_state_gets_the_traces_key_type_and_keeps_its_traces_for_either_key(
    tmp_path: Path, traced_table: bool
) -> None:
    state = tmp_path / "s"
    _schema_11_state(state, traced_table)
    store = SqliteStore.open(state, *OWNER)  # migrates to 12 (and on)
    try:
        assert store.meta("schema_version") == SCHEMA_VERSION == 13
        store.ensure_tables()
        cols = [r[1] for r in store.conn.execute("PRAGMA table_info(traces)")]
        assert cols[-1] == "key_type"
        if traced_table:  # kept before types were: either key's, and it says no type
            for key_type in (None, "str", "int"):
                (old,) = store.traces("1", key_type=key_type)
                assert old["seq"] == 0 and "key_type" not in old
    finally:
        store.close()
    # Created in one go or migrated from 11: the same schema.
    SqliteStore.open(tmp_path / "new", *OWNER).close()
    fresh = SqliteStore.open(tmp_path / "new", *OWNER)
    fresh.ensure_tables()
    fresh.close()
    assert raw(state)["schema"] == raw(tmp_path / "new")["schema"]


def test_a_schema_12_state_keeps_signals_with_their_records_and_restarts_give_old_ones_back(
    tmp_path: Path,
) -> None:
    # Schema 12: a run in flight (of the integer key 7) whose record of a signal it took
    # keeps nothing of the signal. Migrated to 13, `runs restart` (discard_run) gives that
    # signal back for the run's key, as a new one: its id and time were not kept.
    state = tmp_path / "s"
    state.mkdir()
    conn = sqlite3.connect(state / DB_NAME, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        SqliteStore._apply(conn, 0, 12)
        meta = SqliteStore._initial_meta(*OWNER, _sqlite.SYSTEM_CLOCK)
        conn.executemany(
            "INSERT INTO meta(name, value) VALUES (?, ?)",
            [(k, codec.encode(12 if k == "schema_version" else v)) for k, v in meta.items()],
        )
        key = codec.encode(7)
        conn.execute("INSERT INTO inputs(seq, key, event) VALUES (0, ?, x'00')", (key,))
        conn.execute("INSERT INTO runs VALUES (0, ?, 0, ?)", (key, codec.encode([])))
        conn.execute(
            "INSERT INTO calls VALUES (0, 'r>a', 0, 'ratchet.signal', 'go', 'ok', ?)",
            (codec.encode("v"),),
        )
        conn.execute("COMMIT")
    finally:
        conn.close()
    store = SqliteStore.open(state, *OWNER)
    try:
        assert store.meta("schema_version") == SCHEMA_VERSION == 13
        assert [r[1] for r in store.conn.execute("PRAGMA table_info(calls)")][-1] == "taken"
        assert store.discard_run(0, None)["signals_put_back"] == 1
        ((_id, text, name, value, _at, key_type),) = store.signals_after(0)
        assert (text, name, codec.decode(value), key_type) == ("7", "go", "v", "int")
    finally:
        store.close()
