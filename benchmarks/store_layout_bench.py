"""What the SQLite layout costs per checkpoint (issue 19, workload 5): CPU and bytes.

The store's checkpoints written straight through `SqliteStore.write_checkpoint` (no engine),
on a database of the previous layout (schema 7: 4 KiB pages, keys and meta with a rowid and a
separate primary-key index, every key indexed by its text) and of the current one (schema 8:
1 KiB pages unless `--pages` says otherwise, keys and meta WITHOUT ROWID, only keys that are
not strings indexed by text), alternated in one process. Each job shape writes `--checkpoints`
checkpoints of a real checkpoint's rows: the memory of `--touched` keys drawn from `keys`, as
many inputs admitted and completed, and their outputs into the outbox and released at the next
checkpoint. Printed per layout and shape: CPU per checkpoint (process_time, median of the
repetitions), bytes written to the WAL per checkpoint, and the file's bytes after a close.

    .venv/bin/python benchmarks/store_layout_bench.py [--repeat 5] [--pages 1024,512]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ratchet.store import _sqlite, codec
from ratchet.store._base import CheckpointRows
from ratchet.store._sqlite import DB_NAME, SqliteStore

OWNER = ("bench.Agent", "0123456789abcdef", ["act(ratchet.InputEvent)"])
# name, keys, memory bytes per key, keys touched per checkpoint
SHAPES = [
    ("1,000 keys, 12 B memory", 1_000, 12, 200),
    ("1,000 keys, 400 B memory", 1_000, 400, 200),
    ("1,000 keys, 4 KB memory", 1_000, 4_000, 200),
    ("100,000 keys, 40 B memory", 100_000, 40, 1_000),
]


def build_schema_7(state: Path) -> None:
    """A database as the store made it before schema 8: migrations 1-7, 4 KiB pages."""
    state.mkdir(parents=True)
    conn = sqlite3.connect(state / DB_NAME, isolation_level=None)
    conn.execute("PRAGMA page_size=4096")
    conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
    conn.execute("BEGIN")
    SqliteStore._apply(conn, 0, 7)
    meta = SqliteStore._initial_meta(*OWNER, clock=_sqlite.SYSTEM_CLOCK)
    meta["schema_version"] = 7
    conn.executemany(
        "INSERT INTO meta(name, value) VALUES (?, ?)",
        [(k, codec.encode(v)) for k, v in meta.items()],
    )
    conn.execute("COMMIT")
    conn.close()


def build_current(page: int) -> Callable[[Path], None]:
    def build(state: Path) -> None:
        old, _sqlite.PAGE_SIZE = _sqlite.PAGE_SIZE, page
        try:
            SqliteStore.open(state, *OWNER).close()
        finally:
            _sqlite.PAGE_SIZE = old

    return build


class Schema7Store(SqliteStore):
    """The store's writes as they were before schema 8: every memory in its key's row."""

    def _put_keys(
        self, c: sqlite3.Connection, rows: list[tuple[bytes, str, int, bytes, int]]
    ) -> None:
        c.executemany(_sqlite._UPSERT_KEY, rows)


def open_schema_7(state: Path) -> SqliteStore:
    # Not SqliteStore.open: it would migrate the database to schema 8.
    conn = SqliteStore._connect_checked(state / DB_NAME)
    store = Schema7Store(conn, state / DB_NAME)
    store._writable = True
    return store


def one_job(build: Callable[[Path], None], legacy: bool, shape: tuple[str, int, int, int],
            checkpoints: int, seed: int) -> tuple[float, float, int]:  # fmt: skip
    """(CPU seconds per checkpoint, WAL bytes per checkpoint, file bytes after close)."""
    _name, nkeys, mem_bytes, touched = shape
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-layout-"))
    try:
        state = tmp / "state"
        build(state)
        store = open_schema_7(state) if legacy else SqliteStore.open(state, *OWNER)
        store.conn.execute("PRAGMA wal_autocheckpoint=0")  # the WAL's growth is the figure
        keys = [f"user-{i}" for i in range(nkeys)]
        # The first checkpoint writes every key once (not timed), in input order.
        first = CheckpointRows(
            keys=[(codec.encode(k), k, 1, os.urandom(mem_bytes), 1) for k in keys]
        )
        store.write_checkpoint(first, 0.0)
        store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        wal = state / f"{DB_NAME}-wal"
        seq, released, cpu = 0, [], 0.0
        for c in range(checkpoints):
            rows = CheckpointRows(released=released)
            released = []
            for k in rng.sample(keys, touched):
                seq += 1
                rows.keys.append((codec.encode(k), k, seq, os.urandom(mem_bytes), 1))
                rows.new_inputs.append((seq, codec.encode(k), b"e" * 40))
                rows.done_inputs.append(seq)
                rows.outbox.append((f"o{seq}", seq, b"r" * 60))
                released.append(f"o{seq}")
            t = time.process_time()
            store.write_checkpoint(rows, float(c))
            cpu += time.process_time() - t
        wal_bytes = wal.stat().st_size if wal.exists() else 0
        store.close()
        size = (state / DB_NAME).stat().st_size
        return cpu / checkpoints, wal_bytes / checkpoints, size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--checkpoints", type=int, default=50)
    ap.add_argument("--pages", default="1024", help="page sizes of the current layout to try")
    a = ap.parse_args()
    layouts: list[tuple[str, Callable[[Path], None], bool]] = [
        ("schema 7, 4 KiB pages", build_schema_7, True)
    ]
    for p in (int(x) for x in a.pages.split(",")):
        layouts.append((f"schema 8, {p} B pages", build_current(p), False))
    print(
        f"load {os.getloadavg()[0]:.2f}; {a.repeat} repetitions, {a.checkpoints} checkpoints each"
    )
    print("| job | layout | CPU per checkpoint | WAL bytes per checkpoint | file bytes |")
    print("|---|---|---|---|---|")
    for shape in SHAPES:
        results: dict[str, list[tuple[float, float, int]]] = {name: [] for name, _, _ in layouts}
        for r in range(a.repeat):
            for name, build, legacy in layouts:  # alternated, the same seed per repetition
                results[name].append(one_job(build, legacy, shape, a.checkpoints, seed=r))
        for name, _, _ in layouts:
            got = results[name]
            cpu = statistics.median(g[0] for g in got) * 1e3
            walb = statistics.median(g[1] for g in got)
            size = statistics.median(g[2] for g in got)
            print(f"| {shape[0]} | {name} | {cpu:.2f} ms | {walb:,.0f} | {size:,.0f} |")


if __name__ == "__main__":
    main()
