"""The SQLite file follows the live data: pages the outbox and inputs leave free go back to
the file system, past a threshold while the job runs and all of them when it stops."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ratchet.store import _sqlite
from ratchet.store._base import CheckpointRows
from ratchet.store._sqlite import DB_NAME, SqliteStore


def free_pages(state: Path) -> int:
    with sqlite3.connect(state / DB_NAME) as db:
        return int(db.execute("PRAGMA freelist_count").fetchone()[0])


def test_a_stopped_store_keeps_no_free_pages(tmp_path: Path) -> None:
    store = SqliteStore.open(tmp_path, "agent", "fp", ["a"])
    blob = b"x" * (_sqlite.PAGE_SIZE * 3 // 4)
    outbox = [(f"o{i}", i, blob) for i in range(200)]  # about 200 pages of outbox rows
    store.write_checkpoint(CheckpointRows(outbox=outbox), 1.0)
    store.write_checkpoint(CheckpointRows(released=[o[0] for o in outbox]), 2.0)
    free = store.conn.execute("PRAGMA freelist_count").fetchone()[0]
    assert free > 100  # fewer than the writer's threshold: left while the job runs
    pages = store.conn.execute("PRAGMA page_count").fetchone()[0]
    store.close()
    assert free_pages(tmp_path) == 0
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        # Every free page went (and a pointer-map page with them, if they filled one).
        assert db.execute("PRAGMA page_count").fetchone()[0] <= pages - free
    reopened = SqliteStore.open(tmp_path, "agent", "fp", ["a"])  # and it opens as before
    assert reopened.load().outbox == []
    reopened.close()


def test_a_read_only_store_closes_without_writing(tmp_path: Path) -> None:
    SqliteStore.open(tmp_path, "agent", "fp", ["a"]).close()
    before = (tmp_path / DB_NAME).read_bytes()
    SqliteStore.open_readonly(tmp_path).close()
    assert (tmp_path / DB_NAME).read_bytes() == before
