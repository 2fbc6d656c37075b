"""State databases in the layout the store wrote before schema 8, built from the schema's own
statements (no binary fixture).

Schema 7 is what `_MIGRATIONS[:7]` creates (the list is append-only, so these are the exact
statements the previous store ran), in a file with SQLite's default 4 KiB pages: keys and
meta with a rowid and a primary-key index, every memory in its key's row, every key indexed
by its text, traces and ltm created with the database.

`downgrade(state)` rewrites a state directory the current code wrote as that layout, row for
row: what the previous store would hold after the same work. Opening it with the current
code must migrate it to schema 8 and resume its job.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from ratchet.store import _sqlite, codec
from ratchet.store._sqlite import DB_NAME

SCHEMA = 7


def build(db: Path) -> sqlite3.Connection:
    """An empty schema-7 database at `db` (no meta records), open in a transaction."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA page_size=4096")
    conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
    conn.execute("BEGIN IMMEDIATE")
    for migration in _sqlite._MIGRATIONS[:SCHEMA]:
        for stmt in migration:
            conn.execute(stmt)
    conn.execute(f"PRAGMA user_version = {SCHEMA}")
    return conn


def downgrade(state: Path) -> None:
    """Rewrite the (stopped) state in `state` as a schema-7 database of the same rows."""
    src_path = state / DB_NAME
    src = sqlite3.connect(src_path, isolation_level=None)
    src.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    tmp = state / f"{DB_NAME}.schema7"
    tmp.unlink(missing_ok=True)
    dst = build(tmp)
    try:
        tables = [
            r[0]
            for r in src.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND "
                "substr(name, 1, 7) != 'sqlite_' AND name != 'spilled'"
            )
        ]
        for table in tables:
            cols = [r[1] for r in src.execute(f"PRAGMA table_info({table})")]
            if table == "keys":
                select = (
                    "SELECT key, key_text, next_dispatch, COALESCE(memory, (SELECT s.memory "
                    "FROM spilled s WHERE s.key = keys.key)), memory_version FROM keys"
                )
                cols = ["key", "key_text", "next_dispatch", "memory", "memory_version"]
            else:
                # Columns later schemas added (signals.key_type) are not in schema 7's table.
                have = {r[1] for r in dst.execute(f"PRAGMA table_info({table})")}
                cols = [c for c in cols if c in have]
                select = f"SELECT {', '.join(cols)} FROM {table}"
            rows = src.execute(select).fetchall()
            if table == "meta":
                rows = [(n, codec.encode(SCHEMA) if n == "schema_version" else v) for n, v in rows]
            marks = ", ".join("?" for _ in cols)
            dst.executemany(f"INSERT INTO {table}({', '.join(cols)}) VALUES ({marks})", rows)
        dst.execute("COMMIT")
    finally:
        dst.close()
        src.close()
    for suffix in ("-wal", "-shm"):
        (state / f"{DB_NAME}{suffix}").unlink(missing_ok=True)
    os.replace(tmp, src_path)


def layout(db: Path) -> dict[str, object]:
    """What a database's layout is: its schema version, page size, and whether keys has a
    rowid (read with plain sqlite3)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        (version,) = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
        (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'keys'").fetchone()
        return {
            "schema_version": codec.decode(version),
            "page_size": conn.execute("PRAGMA page_size").fetchone()[0],
            "keys_without_rowid": "WITHOUT ROWID" in sql.upper(),
        }
    finally:
        conn.close()
