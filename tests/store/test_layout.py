"""The schema-8 layout (issue 19, workload 5): small pages, keys and meta WITHOUT ROWID, large
memories in `spilled`, keys indexed by text only when they are not strings, traces and ltm
made on first use; and databases of the previous layout (schema 7), which keep working.

The property: whatever keys (strings short and long, ints, tuples, bytes) and memories (small,
large, crossing the inline limit either way) a series of checkpoints and migrations writes,
every reader gives back exactly the last committed row of every key, on a new database and on
a schema-7 one migrated with rows in it, and `spilled` holds exactly the large ones.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ratchet import Agent, EngineConfig, InputEvent, OutputEvent, RunnerContext, action, run
from ratchet.store import _sqlite, codec
from ratchet.store._base import CheckpointRows
from ratchet.store._sqlite import DB_NAME, SCHEMA_VERSION, SqliteStore
from support import schema7

OWNER = ("t.Agent", "0123456789abcdef", ["act(ratchet.InputEvent)"])
LIMIT = _sqlite._INLINE_MEMORY

keys_st = st.one_of(
    st.text(max_size=3),
    st.text(min_size=30, max_size=40),  # past msgpack's fixstr: str 8
    st.integers(-300, 300),
    st.tuples(st.text(max_size=2), st.integers(0, 3)),
    st.binary(max_size=3),
)
# Sizes around the inline limit and well past it (overflow pages), and tiny ones.
sizes_st = st.sampled_from([1, 12, LIMIT - 1, LIMIT, LIMIT + 1, 400, 1500, 5000])


class Padded(Agent):
    """Counts a key's inputs and keeps a pad of the size the input names (small or large
    memory, crossing the inline limit either way); outputs the count and the size of the pad
    the previous run left (-1: none)."""

    @action(InputEvent, inline=True)
    def pad(self, event: InputEvent, ctx: RunnerContext) -> None:
        mem = ctx.short_term_memory
        n = mem.get("n", 0) + 1
        seen = len(mem.get("pad", "")) if mem.get("pad") is not None else -1
        mem.set("n", n)
        mem.set("pad", "p" * event.input["size"])
        ctx.send_event(OutputEvent(output={"id": event.input["id"], "n": n, "seen": seen}))


def schema_7_store(state: Path) -> None:
    """A schema-7 database with meta records, as the previous store created it."""
    state.mkdir()
    conn = schema7.build(state / DB_NAME)
    meta = SqliteStore._initial_meta(*OWNER, clock=_sqlite.SYSTEM_CLOCK)
    meta["schema_version"] = schema7.SCHEMA
    conn.executemany(
        "INSERT INTO meta(name, value) VALUES (?, ?)",
        [(k, codec.encode(v)) for k, v in meta.items()],
    )
    conn.execute("COMMIT")
    conn.close()


def check(store: SqliteStore, model: dict[bytes, tuple[str, int, bytes, int]]) -> None:
    want = sorted((k, nd, mem, v) for k, (_, nd, mem, v) in model.items())
    assert sorted(store.load().keys) == want
    assert sorted(store.key_rows()) == sorted((k, *row) for k, row in model.items())
    for k, (_text, nd, mem, v) in model.items():
        assert store.key_row(k) == (nd, mem, v)
    texts = {row[0] for row in model.values()}
    for text in texts:
        got = sorted(store.memories(text))
        assert got == sorted((k, row[2]) for k, row in model.items() if row[0] == text), text
    assert sorted(store.memories()) == sorted((k, row[2]) for k, row in model.items())
    c = store.conn
    spilled = dict(c.execute("SELECT key, memory FROM spilled").fetchall())
    assert spilled == {k: row[2] for k, row in model.items() if len(row[2]) > LIMIT}
    inline_nulls = c.execute("SELECT COUNT(*) FROM keys WHERE memory IS NULL").fetchone()[0]
    assert inline_nulls == len(spilled)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    old=st.booleans(),
    before=st.lists(st.tuples(keys_st, sizes_st), max_size=6),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["checkpoint", "checkpoint", "migrate", "reopen"]),
            st.lists(st.tuples(keys_st, sizes_st, st.integers(0, 2)), min_size=1, max_size=6),
        ),
        max_size=6,
    ),
)
def test_every_reader_gives_back_the_last_row_of_every_key(
    tmp_path_factory: pytest.TempPathFactory, old: bool, before: list[Any], steps: list[Any]
) -> None:
    state = tmp_path_factory.mktemp("layout") / "state"
    model: dict[bytes, tuple[str, int, bytes, int]] = {}
    counter = iter(range(1, 10**6))

    def memory(size: int) -> bytes:
        n = next(counter)
        return (n.to_bytes(4, "big") * (size // 4 + 1))[:size]

    if old:
        # Rows the previous store wrote, then a migration to schema 8 when it opens.
        schema_7_store(state)
        conn = sqlite3.connect(state / DB_NAME, isolation_level=None)
        for key, size in before:
            k, mem = codec.encode(key), memory(size)
            model[k] = (str(key), next(counter), mem, 1)
            conn.execute(_sqlite._UPSERT_KEY, (k, *model[k]))
        conn.close()
    store = SqliteStore.open(state, *OWNER)
    try:
        assert schema7.layout(state / DB_NAME)["keys_without_rowid"]
        check(store, model)
        for what, writes in steps:
            if what == "reopen":
                store.close()
                store = SqliteStore.open(state, *OWNER)
            elif what == "migrate":
                rows = []
                for key, size, _ in writes:
                    k = codec.encode(key)
                    if k in model:
                        text, nd, _mem, version = model[k]
                        rows.append((k, version, memory(size), version + 1))
                        model[k] = (text, nd, rows[-1][2], version + 1)
                store.put_migrated(rows)
            else:
                cp = CheckpointRows()
                for key, size, version in writes:  # a key may come twice: the last row wins
                    k = codec.encode(key)
                    model[k] = (str(key), next(counter), memory(size), version)
                    cp.keys.append((k, *model[k]))
                store.write_checkpoint(cp, 1.0)
            check(store, model)
    finally:
        store.close()


def test_a_new_database_has_the_small_layout(tmp_path: Path) -> None:
    SqliteStore.open(tmp_path / "s", *OWNER).close()
    got = schema7.layout(tmp_path / "s" / DB_NAME)
    assert got == {
        "schema_version": SCHEMA_VERSION,
        "page_size": _sqlite.PAGE_SIZE,
        "keys_without_rowid": True,
    }
    conn = sqlite3.connect(tmp_path / "s" / DB_NAME)
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        check_ok = conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()
    assert "traces" not in names and "ltm" not in names and "spilled" in names
    assert free == 0 and check_ok == "ok"


def test_a_key_by_text_finds_strings_and_others_that_read_the_same(tmp_path: Path) -> None:
    store = SqliteStore.open(tmp_path / "s", *OWNER)
    try:
        rows = [(codec.encode(k), str(k), 1, codec.encode({"k": repr(k)}), 1)
                for k in ("42", 42, ("a", 1), "x" * 40, "(a, 1)")]  # fmt: skip
        store.write_checkpoint(CheckpointRows(keys=rows), 1.0)
        assert {codec.decode(k) for k, _ in store.memories("42")} == {"42", 42}
        assert {codec.decode(k) for k, _ in store.memories("('a', 1)")} == {("a", 1)}
        assert {codec.decode(k) for k, _ in store.memories("x" * 40)} == {"x" * 40}
        assert store.memories("43") == []
        # Only the keys that are not strings are in keys_by_text.
        indexed = store.conn.execute(
            f"SELECT COUNT(*) FROM keys INDEXED BY keys_by_text WHERE key_text >= '' AND NOT "
            f"{_sqlite._KEY_IS_STR}"
        ).fetchone()[0]
        assert indexed == 2
    finally:
        store.close()


def test_traces_and_ltm_are_made_by_their_first_write_and_read_as_empty_before(
    tmp_path: Path,
) -> None:
    store = SqliteStore.open(tmp_path / "s", *OWNER)
    try:
        assert store.traces("k") == [] and store.ltm_rows("scope") == []
        trace = (
            "k", 3, 5.0, "completed",
            codec.encode([1.0, []]), "str",
        )  # fmt: skip
        store.write_checkpoint(CheckpointRows(traces=[trace], trace_retention=(20, None)), 5.0)
        assert store._has_table("traces") and not store._has_table("ltm")
        store.write_checkpoint(CheckpointRows(ltm_delete=[("scope", "nothing")]), 6.0)
        assert store._has_table("ltm") and store.ltm_rows("scope") == []
    finally:
        store.close()


def test_a_failed_checkpoint_that_made_a_table_leaves_no_table(tmp_path: Path) -> None:
    store = SqliteStore.open(tmp_path / "s", *OWNER)
    try:
        bad = CheckpointRows(
            keys=[(b"\xa1k", "k", 1, b"m" * 500, 1)],
            ltm_add=[("scope", "id", "text", b"m", b"v", 1.0)],  # makes ltm, then
            traces=[("k", 1, 1.0, None, b"t", "str")],  # type: ignore[list-item]  # fails in traces
        )
        with pytest.raises(sqlite3.IntegrityError):
            store.write_checkpoint(bad, 1.0)
        assert not store._has_table("ltm") and not store._has_table("traces")
        assert store.load().keys == []
        assert store.conn.execute("SELECT COUNT(*) FROM spilled").fetchone()[0] == 0
    finally:
        store.close()


def test_a_schema_7_state_resumes_its_job_and_migrates(tmp_path: Path) -> None:
    """A job's state written in the previous layout (rows copied from a real run's state),
    opened by this code: migrated to schema 8 in one transaction, the job goes on, every
    memory as it was (large ones included), every output once."""
    inputs = [{"key": f"k{i % 7}", "id": f"i{i}", "size": (i * 97) % 700} for i in range(60)]
    out = tmp_path / "out.jsonl"
    state = tmp_path / "state"
    run(Padded(), inputs=inputs[:40], output=out, state_dir=state,
        config=EngineConfig(trace_retention="5"))  # fmt: skip
    schema7.downgrade(state)
    assert schema7.layout(state / DB_NAME) == {
        "schema_version": 7, "page_size": 4096, "keys_without_rowid": False,
    }  # fmt: skip
    before = SqliteStore.open_readonly(state)
    try:
        memories = sorted(before.memories())
        traces = before.traces("k3")
    finally:
        before.close()
    assert any(len(m) > LIMIT for _, m in memories) and len(traces) == 5
    migrated = SqliteStore.open(state, *OWNER)  # what `run` does first: migrate, in one go
    try:
        assert sorted(migrated.memories()) == memories and migrated.traces("k3") == traces
    finally:
        migrated.close()

    run(Padded(), inputs=inputs, output=out, state_dir=state,
        config=EngineConfig(trace_retention="5"))  # fmt: skip

    assert schema7.layout(state / DB_NAME) == {
        "schema_version": SCHEMA_VERSION, "page_size": 4096, "keys_without_rowid": True,
    }  # fmt: skip
    outputs = [json.loads(line)["output"] for line in out.read_text().splitlines()]
    assert sorted(o["id"] for o in outputs) == sorted(r["id"] for r in inputs)
    last_size: dict[str, int] = {}
    for r in inputs:  # each run saw the memory its key's previous run left
        o = next(o for o in outputs if o["id"] == r["id"])
        assert (o["n"], o["seen"]) == (
            sum(1 for x in inputs[: inputs.index(r) + 1] if x["key"] == r["key"]),
            last_size.get(r["key"], -1),
        ), o
        last_size[r["key"]] = r["size"]
    after = SqliteStore.open_readonly(state)
    try:
        assert after.traces("k3")[0]["seq"] == 59  # k3's last input
        assert after.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        after.close()


def test_a_row_replaced_outside_the_store_takes_its_spilled_memory_with_it(
    tmp_path: Path,
) -> None:
    """INSERT OR REPLACE (a sqlite3 shell, say) deletes the old row without firing delete
    triggers: the row it inserts with its memory in it drops the spilled copy itself."""
    store = SqliteStore.open(tmp_path / "s", *OWNER)
    key = codec.encode("a")
    store.write_checkpoint(CheckpointRows(keys=[(key, "a", 1, b"x" * (LIMIT + 50), 1)]), 1.0)
    store.close()
    db = sqlite3.connect(tmp_path / "s" / DB_NAME, isolation_level=None)
    try:
        assert db.execute("SELECT COUNT(*) FROM spilled").fetchone() == (1,)
        db.execute(
            "INSERT OR REPLACE INTO keys(key, key_text, next_dispatch, memory, memory_version) "
            "VALUES (?, 'a', 2, ?, 1)",
            (key, b"small"),
        )
        assert db.execute("SELECT COUNT(*) FROM spilled").fetchone() == (0,)
        db.execute("DELETE FROM keys WHERE key = ?", (key,))
        assert db.execute("SELECT COUNT(*) FROM spilled").fetchone() == (0,)
    finally:
        db.close()


def test_a_reader_sees_one_schema_while_a_job_migrates_the_file(tmp_path: Path) -> None:
    """`ratchet inspect` reads which layout the file has, then the memories by it: a job that
    migrates the file in between (schema 7 -> 8 moves large memories out of their rows) must
    not make the reader see the new rows through the old layout (a None memory)."""
    state = tmp_path / "s"
    schema_7_store(state)
    big = b"m" * (LIMIT + 100)
    conn = sqlite3.connect(state / DB_NAME, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")  # as every store has kept its file since schema 1
    conn.execute(
        "INSERT INTO keys(key, key_text, next_dispatch, memory, memory_version) "
        "VALUES (?, 'big', 1, ?, 1)",
        (codec.encode("big"), big),
    )
    conn.close()
    reader = SqliteStore.open_readonly(state)
    migrated: list[int] = []

    def between(sql: str) -> None:
        # After the reader asked for the layout and before it reads the rows: a job starts.
        if "FROM keys" in sql and not migrated:
            migrated.append(1)
            SqliteStore.open(state, *OWNER).close()

    reader.conn.set_trace_callback(between)
    try:
        assert reader.memories() == [(codec.encode("big"), big)]
        assert reader.key_rows()[0][3] == big
    finally:
        reader.conn.set_trace_callback(None)
    assert migrated
    assert reader.memories() == [(codec.encode("big"), big)]  # the new layout, read as such
    reader.close()


def test_a_schema_8_state_gets_the_replace_trigger_when_a_job_opens_it(tmp_path: Path) -> None:
    store = SqliteStore.open(tmp_path / "s", *OWNER)
    store.close()
    db = sqlite3.connect(tmp_path / "s" / DB_NAME, isolation_level=None)
    db.execute("DROP TRIGGER spilled_replaced")
    db.execute("PRAGMA user_version = 8")  # as schema 8 left it
    db.execute("UPDATE meta SET value = ? WHERE name = 'schema_version'", (codec.encode(8),))
    db.close()
    SqliteStore.open(tmp_path / "s", *OWNER).close()
    db = sqlite3.connect(tmp_path / "s" / DB_NAME, isolation_level=None)
    try:
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='trigger'")}
        assert "spilled_replaced" in names
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 9
    finally:
        db.close()
