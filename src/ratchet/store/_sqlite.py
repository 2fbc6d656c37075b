"""The embedded `CheckpointStore`: one SQLite database in WAL mode, written by one thread.

It stores bytes and plain values only; what they mean belongs to the engine. Rows are keyed
naturally (key, input sequence, task id, call index) so a retried write is harmless.

Schema versions: `_MIGRATIONS` is append-only; `_MIGRATIONS[i]` takes schema i to i + 1, so
a new database applies all of them in order (then drops the empty tables it makes on first
use, `_LAZY_TABLES`) and an older one the ones it lacks, in one transaction, when a writer
opens it. The version is recorded in meta `schema_version` (what
ratchet reads) and in `PRAGMA user_version` (what `sqlite3 ratchet.db 'PRAGMA user_version'`
shows). A database from a newer ratchet is refused, never guessed at.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import RatchetError, StateError, StateInUseError, StateWriteError
from ratchet.store import codec
from ratchet.store._base import (
    FAILED_RUN,
    KEEPS_SIGNALS,
    REPLAY_FN,
    SIGNAL_FN,
    Adopted,
    AgentVersion,
    CallRecord,
    CheckpointRows,
    DispatchTable,
    Loaded,
    Pinned,
    SignalRow,
    adopt_pins,
    check_adoption,
    covering_marker,
    entry_signal,
    int_text,
    journal_tasks,
    ltm_key_scope,
    run_signals,
    signal_entry,
    signals_taken,
    taken_signal,
    taken_signals,
    version_id,
    with_run_signals,
)
from ratchet.store._files import fsync_dir, state_write_error
from ratchet.store._traces import unpack_trace

DB_NAME = "ratchet.db"
LOCK_NAME = "ratchet.lock"
# Held by `ratchet run --supervise` for as long as it lives, between its workers too.
SUPERVISOR_LOCK_NAME = "supervisor.lock"

# Append-only: _MIGRATIONS[i] takes schema i to i + 1 (0 is an empty database). Never edit a
# shipped entry: databases in the field were made by it. One statement per string.
_MIGRATIONS: list[tuple[str, ...]] = [
    (  # 1: the tables
        "CREATE TABLE meta(name TEXT PRIMARY KEY, value BLOB NOT NULL)",
        """CREATE TABLE keys(
            key BLOB PRIMARY KEY, key_text TEXT NOT NULL,
            next_dispatch INTEGER NOT NULL, memory BLOB NOT NULL)""",
        "CREATE TABLE inputs(seq INTEGER PRIMARY KEY, key BLOB NOT NULL, event BLOB NOT NULL)",
        """CREATE TABLE runs(
            seq INTEGER PRIMARY KEY, key BLOB NOT NULL,
            base_dispatch INTEGER NOT NULL, journal BLOB NOT NULL)""",
        "CREATE TABLE outbox(id TEXT PRIMARY KEY, seq INTEGER NOT NULL, record BLOB NOT NULL)",
        """CREATE TABLE checkpoints(
            id INTEGER PRIMARY KEY, triggered_at REAL NOT NULL,
            duration_ms REAL NOT NULL, size_bytes INTEGER NOT NULL)""",
        """CREATE TABLE calls(
            seq INTEGER NOT NULL, task_id TEXT NOT NULL, idx INTEGER NOT NULL,
            fn TEXT NOT NULL, digest TEXT NOT NULL, status TEXT NOT NULL, payload BLOB,
            PRIMARY KEY(seq, task_id, idx))""",
    ),
    (  # 2: `ratchet inspect --key` looks keys up by their text (it scanned the table)
        "CREATE INDEX keys_by_text ON keys(key_text)",
    ),
    (  # 3: per-key memory versions (memory migrations); runs abandoned by `ratchet runs abandon`
        "ALTER TABLE keys ADD COLUMN memory_version INTEGER NOT NULL DEFAULT 1",
        """CREATE TABLE dead_letters(
            id INTEGER PRIMARY KEY, key BLOB NOT NULL, key_text TEXT NOT NULL,
            seq INTEGER NOT NULL, event BLOB NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL)""",
    ),
    (  # 4: signals for runs that wait (`ratchet signal`, REST, `ratchet.send_signal`)
        """CREATE TABLE signals(
            id INTEGER PRIMARY KEY AUTOINCREMENT, key_text TEXT NOT NULL, name TEXT NOT NULL,
            value BLOB NOT NULL, sent_at REAL NOT NULL)""",
    ),
    (  # 5: dead letters of every kind (bad lines, failed runs), and their redrive
        "ALTER TABLE dead_letters ADD COLUMN kind TEXT NOT NULL DEFAULT 'abandoned'",
        "ALTER TABLE dead_letters ADD COLUMN detail BLOB",
        "ALTER TABLE dead_letters ADD COLUMN redrive_requested REAL",
        "ALTER TABLE dead_letters ADD COLUMN redriven_as INTEGER",
    ),
    (  # 6: traces of completed runs (`ratchet trace`), kept under a retention policy
        """CREATE TABLE traces(
            key_text TEXT NOT NULL, seq INTEGER NOT NULL, at REAL NOT NULL,
            status TEXT NOT NULL, trace BLOB NOT NULL, PRIMARY KEY(key_text, seq))""",
        "CREATE INDEX traces_by_time ON traces(at)",
    ),
    (  # 7: long-term memory (`ctx.long_term_memory`): texts, metadata and embedding vectors
        """CREATE TABLE ltm(
            scope TEXT NOT NULL, id TEXT NOT NULL, text TEXT NOT NULL, metadata BLOB NOT NULL,
            vector BLOB NOT NULL, at REAL NOT NULL, PRIMARY KEY(scope, id))""",
    ),
    (  # 8: a smaller file (issue 19, workload 5). keys and meta become WITHOUT ROWID tables
        # (a row lives in its primary key's tree: the separate key index goes); a memory
        # larger than 160 bytes moves to `spilled` (keys.memory NULL), a table with a rowid,
        # where an update of a large value is written in place; keys are indexed by text only
        # when they are not strings (a string key's text is the string: its primary key finds
        # it; the WHERE is _KEY_IS_STR's). New databases get traces and ltm on first use.
        """CREATE TABLE keys8(
            key BLOB PRIMARY KEY, key_text TEXT NOT NULL, next_dispatch INTEGER NOT NULL,
            memory BLOB, memory_version INTEGER NOT NULL DEFAULT 1) WITHOUT ROWID""",
        "CREATE TABLE spilled(key BLOB PRIMARY KEY, memory BLOB NOT NULL)",
        "INSERT INTO keys8(key, key_text, next_dispatch, memory, memory_version) SELECT key, "
        "key_text, next_dispatch, CASE WHEN length(memory) > 160 THEN NULL ELSE memory END, "
        "memory_version FROM keys",
        "INSERT INTO spilled(key, memory) SELECT key, memory FROM keys WHERE length(memory) > 160",
        "DROP TABLE keys",
        "ALTER TABLE keys8 RENAME TO keys",
        "CREATE INDEX keys_by_text ON keys(key_text) WHERE NOT (key >= x'a0' AND key < x'c0' "
        "OR key >= x'd9' AND key < x'dc')",
        # A memory that moves back into its row, or a key that goes, takes its spilled value
        # with it (whoever writes: the store, `ratchet fork --key`, a plain sqlite3 shell).
        "CREATE TRIGGER spilled_back AFTER UPDATE OF memory ON keys WHEN OLD.memory IS NULL "
        "AND NEW.memory IS NOT NULL BEGIN DELETE FROM spilled WHERE key = OLD.key; END",
        "CREATE TRIGGER spilled_gone AFTER DELETE ON keys WHEN OLD.memory IS NULL "
        "BEGIN DELETE FROM spilled WHERE key = OLD.key; END",
        "CREATE TABLE meta8(name TEXT PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID",
        "INSERT INTO meta8(name, value) SELECT name, value FROM meta",
        "DROP TABLE meta",
        "ALTER TABLE meta8 RENAME TO meta",
    ),
    (
        # 9: an INSERT OR REPLACE (a sqlite3 shell's) deletes the old row without firing
        # delete triggers (unless recursive_triggers): a row inserted with its memory in it
        # drops any spilled copy.
        "CREATE TRIGGER IF NOT EXISTS spilled_replaced AFTER INSERT ON keys WHEN NEW.memory "
        "IS NOT NULL BEGIN DELETE FROM spilled WHERE key = NEW.key; END",
    ),
    (),  # 10: long-term memory of a key that is not a string: its own scope (_typed_ltm_scopes)
    (),  # 11: the type of the key a signal is for (_typed_signals)
    (),  # 12: the type of the key a trace is of (_typed_traces)
    (),  # 13: the signal a delivered signal's record took, kept with it (_kept_signals)
]


# Whether a stored key (its codec bytes) is a string: msgpack's str forms (fixstr a0-bf, str
# 8/16/32 d9-db) and nothing else start with these bytes, and the codec writes only exact
# `str` values so. Frozen: it is keys_by_text's WHERE, and SQLite uses a partial index only
# for a query that repeats its WHERE.
def _dead_key_type(blob: bytes) -> str | None:
    """A dead letter's key type ('str' or 'int', as signals and traces record it); None for a
    bad line's (it has no key) or a key that does not decode (the listing still shows it)."""
    try:
        key = codec.decode(bytes(blob), unknown="generic")
    except (codec.CorruptDataError, TypeError, ValueError):
        return None
    if isinstance(key, bool) or not isinstance(key, str | int):
        return None
    return "int" if isinstance(key, int) else "str"


_KEY_IS_STR = "(key >= x'a0' AND key < x'c0' OR key >= x'd9' AND key < x'dc')"


def _readable_detail(detail: Any) -> Any:
    """A dead letter's detail as listings show it: the signals a failed or abandoned run took
    (kept, or put back by its redrive) with their values decoded, not as the bytes kept."""
    if isinstance(detail, dict):
        for name in ("signals", "signals_put_back"):
            for entry in detail.get(name) or []:
                if isinstance(entry, dict) and isinstance(entry.get("value"), bytes):
                    entry["value"] = codec.decode(entry["value"], unknown="generic")
    return detail


def _typed_ltm_scopes(c: sqlite3.Connection) -> None:
    """Migration 10: the long-term memories of a key that is not a string move from `key:<text>`
    to its own scope (`ltm_key_scope`). Where a string key of the same text exists too, the two
    shared one scope and their rows cannot be told apart: they stay with the string key."""
    if c.execute("SELECT 1 FROM sqlite_master WHERE name = 'ltm'").fetchone() is None:
        return  # made on first use: none kept yet
    rows = c.execute(f"SELECT key, key_text FROM keys WHERE NOT {_KEY_IS_STR}").fetchall()
    for blob, text in rows:
        if c.execute("SELECT 1 FROM keys WHERE key = ?", (codec.encode(str(text)),)).fetchone():
            continue
        try:
            key = codec.decode(bytes(blob), unknown="generic")
        except (codec.CorruptDataError, TypeError):
            continue  # damaged: the usual checks name it when the key is read
        c.execute("UPDATE ltm SET scope = ? WHERE scope = ?", (ltm_key_scope(key), f"key:{text}"))


def signals_typed(conn: sqlite3.Connection) -> bool:
    """Whether the signals table records key types (schema 11): a read-only reader of an
    older state that no job has opened since sees it without."""
    return any(row[1] == "key_type" for row in conn.execute("PRAGMA table_info(signals)"))


def _typed_signals(c: sqlite3.Connection) -> None:
    """Migration 11: signals record the type of the key they are for ('str' or 'int'): the
    text "1" names two keys. NULL (a signal stored before): either key of its text, as then.
    A column added only where it is missing (a state a test or a tool put back to an older
    schema version may have it already)."""
    if not signals_typed(c):
        c.execute("ALTER TABLE signals ADD COLUMN key_type TEXT")


def traces_typed(conn: sqlite3.Connection) -> bool:
    """Whether the traces table records key types (schema 12): a read-only reader of an
    older state that no job has opened since sees it without."""
    return any(row[1] == "key_type" for row in conn.execute("PRAGMA table_info(traces)"))


_ADD_TRACE_KEY_TYPE = "ALTER TABLE traces ADD COLUMN key_type TEXT"


def _typed_traces(c: sqlite3.Connection) -> None:
    """Migration 12: traces record the type of their run's key ('str' or 'int'): the text "1"
    names two keys, and `ratchet trace --key 1` showed the runs of both. NULL (a trace kept
    before): either key of its text. Added only where the table exists (a new state makes it
    on first use, with the column) and lacks it (a state a test or a tool put back to an
    older schema version may have it)."""
    exists = c.execute("SELECT 1 FROM sqlite_master WHERE name = 'traces'").fetchone()
    if exists is not None and not traces_typed(c):
        c.execute(_ADD_TRACE_KEY_TYPE)


def _kept_signals(c: sqlite3.Connection) -> None:
    """Migration 13: a delivered signal's call record keeps the signal it took as it was sent
    (`calls.taken`, `taken_signal`), so that `ratchet runs restart` and `runs abandon`, which
    delete the run's records, can put it back. NULL: any other record, or one delivered
    before (`run_signals` gives that signal back as a new one). Added only where missing."""
    if not any(row[1] == "taken" for row in c.execute("PRAGMA table_info(calls)")):
        c.execute("ALTER TABLE calls ADD COLUMN taken BLOB")


# Python steps of migrations whose work SQL alone cannot do, by the version they reach.
_PY_MIGRATIONS = {
    10: _typed_ltm_scopes,
    11: _typed_signals,
    12: _typed_traces,
    13: _kept_signals,
}
# Tables a new database creates when first written (an empty table still takes a page), with
# the statements that created them in older databases (and added to them since: a table made
# on first use has the same schema as one migrated).
_LAZY_TABLES = {"traces": (*_MIGRATIONS[5], _ADD_TRACE_KEY_TYPE), "ltm": _MIGRATIONS[6]}
# A memory longer than this (encoded) is kept in `spilled`, not in its key's row.
_INLINE_MEMORY = 160
_UPSERT_KEY = (
    "INSERT INTO keys(key, key_text, next_dispatch, memory, memory_version) "
    "VALUES (?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET "
    "key_text = excluded.key_text, next_dispatch = excluded.next_dispatch, "
    "memory = excluded.memory, memory_version = excluded.memory_version"
)
SCHEMA_VERSION = len(_MIGRATIONS)
# The page size of a new database (SQLite's default is 4096). Every table and index takes at
# least one page, and a job's state is mostly small rows: 1 KiB pages hold the same rows in
# about a third of the bytes at this size (docs/benchmarks.md, workload 5). Databases made
# with another page size keep theirs (it is fixed when the first table is created).
PAGE_SIZE = 1024
_KEEP_CHECKPOINT_ROWS = 100
# In bytes, whatever the page size (these were 256 and SQLite's 1000 pages of 4 KiB): free
# pages are given back once 1 MiB of them is free, and the WAL is copied into the database
# once it holds 4 MiB (SQLite counts both in pages: with 1 KiB pages its default would copy
# the WAL four times as often).
_VACUUM_FREE_BYTES = 1 << 20
_WAL_AUTOCHECKPOINT_BYTES = 4 << 20


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    return conn


def _sidecars(path: Path) -> list[Path]:
    """A database file and the journal files SQLite keeps beside it."""
    return [path, *(path.with_name(path.name + suffix) for suffix in ("-journal", "-wal", "-shm"))]


def state_dir_error(state_dir: Path, exc: OSError) -> StateError:
    """Why `--state DIR` could not be made or locked, in one line (a file there, a read-only
    file system): every command that makes a state directory says it so."""
    why = (
        "it is a file, not a directory; point --state at a directory (a new one for a new job)"
        if state_dir.exists() and not state_dir.is_dir()
        else f"{exc} (it must be a directory this process can write to, and its lock files, "
        f"{LOCK_NAME} and {SUPERVISOR_LOCK_NAME}, plain files)"
    )
    return StateError(f"--state {state_dir} cannot be used as a state directory: {why}")


def wal_files_blocked(path: Path) -> StateError | None:
    """Why a reader cannot open the WAL-mode database `path`, when that is the reason: its
    `-wal` or `-shm` file is missing and its directory is not writable by this process, so
    SQLite cannot create them (reading a WAL database needs both, even read-only). None if
    that is not why (the file is not in WAL mode, both files are there, or the directory is
    writable).

    `?immutable=1` (or `nolock=1`) would read it without them, but also without locks: a job
    that starts meanwhile (its owner may write where this process cannot) could change the
    file under the reader. So the reader is told what to do instead."""
    try:
        with path.open("rb") as fh:
            header = fh.read(20)
    except OSError:
        return None
    if len(header) < 20 or header[:16] != b"SQLite format 3\x00" or header[18:20] != b"\x02\x02":
        return None  # not a database in WAL mode: a read-only one needs no other file
    missing = [p.name for p in _sidecars(path)[2:] if not p.exists()]
    if not missing or os.access(path.parent, os.W_OK | os.X_OK):
        return None
    return StateError(
        f"{path} cannot be opened: the state database is in WAL mode, and SQLite needs "
        f"{' and '.join(missing)} beside it, which it cannot create because this process "
        f"cannot write to {path.parent}; make that directory writable for this user (a command "
        f"that only reads can also read a writable copy: cp -r DIR COPY && chmod -R u+w COPY, "
        f"then --state COPY)"
    )


class StateLock:
    """Exclusive ownership of a state directory; the OS drops it when the process dies."""

    def __init__(
        self,
        state_dir: Path,
        name: str = LOCK_NAME,
        busy: Callable[[str], RatchetError] | None = None,
    ) -> None:
        self.path = Path(state_dir) / name
        self._fd: int | None = None
        self._busy = busy  # the error when another process holds it, given the holder

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if self._busy is not None:
                raise self._busy(holder) from None
            raise StateInUseError(
                f"state directory {self.path.parent} is in use by {holder} ({self.path.name}); only "
                f"one engine may own a state directory (stop it first, or use another --state)",
                holder,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SqliteStore:
    """The SQLite state of one job. Open with `open()`; call methods from one thread at a time."""

    def __init__(self, conn: sqlite3.Connection, path: Path, clock: Clock = SYSTEM_CLOCK) -> None:
        self.conn = conn
        self.path = path
        self.clock = clock
        self._reader: sqlite3.Connection | None = None  # key_row's, opened on first use
        self._writable = False  # opened by open(): close() may vacuum
        self._spilled = False  # known to have the `spilled` table (a writer's, migrated)
        self._page_size = 4096  # a writer's is read when it opens
        self._reader_lock = threading.Lock()

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        state_dir: str | os.PathLike[str],
        agent_name: str,
        agent_fingerprint: str,
        actions: list[str],
        synchronous: str = "NORMAL",
        clock: Clock = SYSTEM_CLOCK,
        rebuild: bool = False,
    ) -> SqliteStore:
        """Open or create the state of `agent_name` (a new state records it as its agent).

        Whether the state belongs to the agent, and what an upgrade changes, is `adopt`'s.
        `rebuild`: the caller builds the database of a directory that has run (re-sharding
        back to one worker), so a missing one beside `job.json` is expected, not a loss."""
        sdir = Path(state_dir)
        if sdir.exists() and not sdir.is_dir():
            raise StateError(f"--state {sdir} exists and is not a directory")
        sdir.mkdir(parents=True, exist_ok=True)
        if synchronous.upper() not in ("NORMAL", "FULL"):
            raise StateError(f"synchronous must be NORMAL or FULL, not {synchronous!r}")
        path = sdir / DB_NAME
        meta = cls._initial_meta(agent_name, agent_fingerprint, actions, clock)
        if not path.exists() or path.stat().st_size == 0:
            # Nothing there yet, or the empty file an interrupted first start of an older
            # ratchet left: nothing is in it. Unless the directory has run before: every
            # ratchet that writes the job file (`runtime._io.JOB_FILE`) writes it after the
            # database is built whole, so a missing or empty database beside it was lost or
            # truncated, and starting afresh would redo every input and repeat every call.
            if not rebuild and (sdir / "job.json").exists():
                what = "is empty" if path.exists() else "is missing"
                raise StateError(
                    f"{path} {what}, but {sdir} has run before (its job.json exists): the "
                    f"database was truncated or removed, and a new one would redo every input "
                    f"and repeat every durable call; restore the state directory from a backup "
                    f"(or continue from a savepoint in a new one: ratchet run ... --state NEW "
                    f"--from-savepoint PATH), or remove {sdir} to start the job over"
                )
            cls._build(path, meta)
        conn = cls._connect_checked(path)
        if cls._uninitialised(conn):
            # A first start killed while it created the database (an older ratchet created it
            # in place): a WAL-mode file with no tables, or an empty meta table. It holds no
            # state, and refusing it would fail every restart of a supervised job.
            conn.close()
            cls._build(path, meta)
            conn = cls._connect_checked(path)
        store = cls(conn, path, clock)
        store._writable = True
        conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
        store._page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
        conn.execute(f"PRAGMA wal_autocheckpoint={_WAL_AUTOCHECKPOINT_BYTES // store._page_size}")
        try:
            # Refuse a newer ratchet's state before changing anything.
            store._schema_version()
            store._migrate()
            store._spilled = True
        except BaseException:
            conn.close()
            raise
        return store

    @classmethod
    def open_readonly(cls, state_dir: str | os.PathLike[str]) -> SqliteStore:
        """Open existing state for `status` and `inspect`, without writing to it."""
        path = Path(state_dir) / DB_NAME
        if not path.exists():
            raise StateError(f"no ratchet state in {state_dir} ({path} does not exist)")
        try:
            # As a URI (quoted: a path may hold '#', '?' or '%'), so mode=ro applies.
            conn = sqlite3.connect(
                f"{path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None
            )
            store = cls(conn, path)
            try:
                conn.execute("PRAGMA schema_version").fetchone()  # the first read of the file
            except sqlite3.DatabaseError as exc:
                blocked = wal_files_blocked(path)
                if blocked is not None:
                    raise blocked from exc
                # Otherwise the schema check below says what it is (not a database, say).
            # An older schema reads the same (a writer migrates it when it next opens it).
            store._schema_version()
        except sqlite3.DatabaseError as exc:
            raise StateError(f"{path} is not a readable ratchet state database: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        return store

    @staticmethod
    def _connect_checked(path: Path) -> sqlite3.Connection:
        try:
            conn = _connect(path)
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise StateError(f"{path}: could not switch to WAL mode (got {mode})")
            result = conn.execute("PRAGMA quick_check").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            failed = state_write_error(path.parent, exc, "opened")
            if failed is not None:  # opening a WAL database writes its -wal and -shm files
                raise failed from exc
            raise StateError(
                f"{path} is corrupted or not a ratchet state database ({exc}); it was left "
                f"untouched; restore it from a backup or point --state at a new directory"
            ) from exc
        if result != "ok":
            conn.close()
            raise StateError(
                f"{path} failed SQLite's integrity check ({result}); it was left untouched; "
                f"restore it from a backup or point --state at a new directory"
            )
        return conn

    @contextlib.contextmanager
    def _transaction(self, commit: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed if the block returns (rolled back instead with
        `commit=False`), rolled back if it raises."""
        c = self.conn
        try:
            c.execute("BEGIN IMMEDIATE")
            try:
                yield c
                c.execute("COMMIT" if commit else "ROLLBACK")
            except BaseException:
                # A failed COMMIT (or an I/O error) may have rolled back already.
                if c.in_transaction:
                    c.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            # A full or failing disk is not damage: said here, at the store's boundary, so
            # that no caller reports it as a damaged database (whose fix loses work).
            failed = state_write_error(self.path.parent, exc)
            if failed is None:
                raise
            raise failed from exc

    @staticmethod
    def _apply(c: sqlite3.Connection, start: int, stop: int) -> None:
        """Run migrations start+1 .. stop and record `stop` (inside the caller's transaction)."""
        for version, migration in enumerate(_MIGRATIONS[start:stop], start + 1):
            for stmt in migration:
                c.execute(stmt)
            step = _PY_MIGRATIONS.get(version)
            if step is not None:
                step(c)
        # Not a bound parameter: PRAGMA takes none. `stop` is an int from this module.
        c.execute(f"PRAGMA user_version = {int(stop)}")

    @staticmethod
    def _initial_meta(
        agent_name: str, fingerprint: str, actions: list[str], clock: Clock
    ) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "agent_name": agent_name,
            "agent_fingerprint": fingerprint,
            "actions": actions,
            "created_at": clock.now(),
            "source": {},
            "counts": {"completed": 0, "failed": 0, "restored": 0},
            "latest_restored": None,
            "next_checkpoint_id": 1,
        }

    @classmethod
    def _build(cls, path: Path, meta: dict[str, Any]) -> None:
        """Create the database at `path` atomically: whole and initialised, or not at all.

        It is built in `<name>.init` beside it and renamed into place, so a kill at any moment
        leaves either no database (or the uninitialised one this replaces) or a complete one;
        an interrupted build's leftovers are removed by the next. The caller owns the state
        directory and has made sure `path` holds no state.
        """
        tmp = path.with_name(path.name + ".init")
        wal = path.with_name(path.name + "-wal")
        if not path.exists() or path.stat().st_size == 0:
            with contextlib.suppress(FileNotFoundError):
                if wal.stat().st_size > 0:
                    # Not something ratchet leaves: the WAL of a database that was removed.
                    raise StateError(
                        f"{wal} exists but its database {path} is missing or empty; it may "
                        f"hold state, so it was left untouched; move it away (with any "
                        f"{path.name}-shm) or point --state at a new directory"
                    )
        for leftover in _sidecars(tmp):
            leftover.unlink(missing_ok=True)
        try:
            conn = sqlite3.connect(tmp, isolation_level=None)
            try:
                # Outbox and input rows come and go at every checkpoint: let the file give their
                # pages back (only settable before the first table, and before WAL mode, which
                # the first real open turns on). The rollback journal and synchronous=FULL make
                # the commit durable before the rename.
                conn.execute(f"PRAGMA page_size={int(PAGE_SIZE)}")
                conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
                conn.execute("PRAGMA synchronous=FULL")
                conn.execute("BEGIN IMMEDIATE")
                cls._apply(conn, 0, SCHEMA_VERSION)
                # The same schema as an older database migrated, less the tables made on
                # first use.
                for name in _LAZY_TABLES:
                    conn.execute(f"DROP TABLE {name}")
                conn.executemany(
                    "INSERT INTO meta(name, value) VALUES (?, ?)",
                    [(k, codec.encode(v)) for k, v in meta.items()],
                )
                conn.execute("COMMIT")
                conn.execute("VACUUM")  # the pages the migrations left free
            finally:
                conn.close()
            # Journal files of the database being replaced describe what it held (nothing):
            # left beside the new file, SQLite would apply them to it.
            for stale in _sidecars(path)[1:]:
                stale.unlink(missing_ok=True)
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except (sqlite3.Error, OSError) as exc:
            raise StateError(
                f"could not create the state database {path} ({exc}); fix the cause (disk "
                f"space, permissions) and run again"
            ) from exc

    @staticmethod
    def _uninitialised(conn: sqlite3.Connection) -> bool:
        """True if the database holds nothing at all: no table, or only a meta table with no
        schema_version record. Anything else (e.g. a keys table without meta) is not ours to
        replace: the usual checks refuse it, naming what is wrong."""
        try:
            names = [
                row[0]
                for row in conn.execute(
                    "SELECT name FROM sqlite_master WHERE substr(name, 1, 7) != 'sqlite_'"
                )
            ]
            if names != ["meta"]:
                return not names
            row = conn.execute("SELECT 1 FROM meta WHERE name = 'schema_version'").fetchone()
        except sqlite3.DatabaseError:
            return False  # e.g. a meta table that is not ratchet's: refused by the usual checks
        return row is None

    def _schema_version(self) -> int:
        """The recorded schema version; a newer one than this code knows is refused."""
        try:
            version = self.meta("schema_version")
        except sqlite3.DatabaseError as exc:
            raise StateError(
                f"{self.path} is not a ratchet state database ({exc}); it was left untouched"
            ) from exc
        if type(version) is not int or version < 1:
            raise StateError(
                f"{self.path} records state schema {version!r}, which no ratchet writes; it was "
                f"left untouched; restore it from a backup or point --state at a new directory"
            )
        if version > SCHEMA_VERSION:
            raise StateError(
                f"{self.path} was written with state schema {version}; this ratchet reads schema "
                f"{SCHEMA_VERSION} (and migrates older ones), so a newer ratchet wrote it; it was "
                f"left untouched; upgrade ratchet to a version that reads schema {version}, or "
                f"point --state at a new directory"
            )
        return version

    def _migrate(self) -> None:
        """Bring an older state up to `SCHEMA_VERSION` in one transaction (all or nothing)."""
        version = self._schema_version()
        if version == SCHEMA_VERSION:
            return
        try:
            with self._transaction() as c:
                version = self._schema_version()  # again, under the write lock
                if version < SCHEMA_VERSION:
                    self._apply(c, version, SCHEMA_VERSION)
                    self._set_meta("schema_version", SCHEMA_VERSION)
        except sqlite3.DatabaseError as exc:
            raise StateError(
                f"{self.path} could not be migrated from state schema {version} to "
                f"{SCHEMA_VERSION} ({exc}); nothing was changed, it is still at schema "
                f"{version}; fix the cause (disk space, permissions) and run again, or use the "
                f"ratchet version that wrote it"
            ) from exc

    def _meta_or(self, name: str, default: Any) -> Any:
        row = self.conn.execute("SELECT 1 FROM meta WHERE name = ?", (name,)).fetchone()
        return default if row is None else self.meta(name)

    def stored_table(self) -> DispatchTable | None:
        """The dispatch table of the agent last recorded (states before schema 3 kept only
        `actions`, as 'name(Event, ...)' strings; the table is read back from those)."""
        table = self._meta_or("dispatch_table", None)
        if table is not None:
            return [(str(n), [str(e) for e in evs]) for n, evs in table]
        described = self._meta_or("actions", None)
        if not isinstance(described, list):
            return None
        out: DispatchTable = []
        for text in described:
            name, _, rest = str(text).partition("(")
            events = [e.strip() for e in rest.rstrip(")").split(",") if e.strip()]
            out.append((name, sorted(events)))
        return out

    def adopt(self, agent: AgentVersion, dry_run: bool = False) -> Adopted:
        """Record `agent` as this state's agent; pin runs in flight to the version they started
        under when it changes. One transaction (see `CheckpointStore.adopt`)."""
        try:
            with self._transaction(commit=not dry_run) as c:
                name = self._meta_or("agent_name", None)
                fingerprint = self._meta_or("agent_fingerprint", None)
                table = self.stored_table()
                memory_version = self._meta_or("memory_version", 1)
                highest = c.execute("SELECT MAX(memory_version) FROM keys").fetchone()[0] or 0
                check_adoption(str(self.path), name, table, agent, highest)
                versions = {
                    vid: Pinned([(n, list(e)) for n, e in v["table"]], v["memory_version"])
                    for vid, v in self._meta_or("agent_versions", {}).items()
                }
                previous = None
                if fingerprint is not None and table is not None:
                    previous = version_id(fingerprint, memory_version)
                    versions.setdefault(previous, Pinned(table, memory_version))
                current = version_id(agent.fingerprint, agent.memory_version)
                pins, adopted = adopt_pins(
                    {int(s): v for s, v in self._meta_or("pinned_runs", {}).items()},
                    {row[0] for row in c.execute("SELECT seq FROM runs")},
                    previous,
                    current,
                    versions,
                )
                if adopted.upgraded_from is not None:
                    history = list(self._meta_or("upgrades", []))[-19:]
                    history.append({"from": previous, "to": current, "at": self.clock.now()})
                    self._set_meta("upgrades", history)
                self._set_meta("agent_name", agent.name)
                self._set_meta("agent_fingerprint", agent.fingerprint)
                self._set_meta("actions", describe_table(agent.table))
                self._set_meta("dispatch_table", agent.table)
                self._set_meta("memory_version", agent.memory_version)
                used = set(pins.values())
                self._set_meta(
                    "agent_versions",
                    {
                        vid: {"table": p.table, "memory_version": p.memory_version}
                        for vid, p in versions.items()
                        if vid in used
                    },
                )
                self._set_meta("pinned_runs", {str(s): v for s, v in pins.items()})
        except sqlite3.DatabaseError as exc:
            raise StateError(f"{self.path} could not be updated ({exc})") from exc
        return adopted

    # -- reading ----------------------------------------------------------------------------

    def meta(self, name: str) -> Any:
        row = self.conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise StateError(
                f"{self.path} has no {name!r} record; it is not a ratchet state database"
            )
        try:
            return codec.decode(row[0])
        except (codec.CorruptDataError, codec.UnknownTypeError) as exc:
            raise StateError(
                f"{self.path}: the meta record {name!r} cannot be decoded ({exc}); it was left "
                f"untouched; restore the state from a backup or point --state at a new directory"
            ) from exc

    def load(self, lazy_keys: bool = False) -> Loaded:
        c = self.conn
        # With lazy_keys, the keys of input rows only (queued inputs and runs in flight, whose
        # rows have inputs too): an indexed lookup per input, not a read of every key.
        which = " WHERE key IN (SELECT key FROM inputs)" if lazy_keys else ""
        try:
            return Loaded(
                keys=c.execute(
                    f"SELECT key, next_dispatch, {self._memory_sql()}, memory_version FROM keys"
                    f"{which} ORDER BY key"
                ).fetchall(),
                inputs=c.execute("SELECT seq, key, event FROM inputs ORDER BY seq").fetchall(),
                runs=c.execute(
                    "SELECT seq, key, base_dispatch, journal FROM runs ORDER BY seq"
                ).fetchall(),
                outbox=c.execute("SELECT id, seq, record FROM outbox ORDER BY rowid").fetchall(),
                calls=[
                    CallRecord(*row)
                    for row in c.execute(
                        "SELECT seq, task_id, idx, fn, digest, status, payload FROM calls "
                        "ORDER BY seq, task_id, idx"
                    )
                ],
                source=self.meta("source"),
                stats=self.stats(),
                stored_keys=c.execute("SELECT COUNT(*) FROM keys").fetchone()[0],
            )
        except sqlite3.DatabaseError as exc:
            raise StateError(
                f"{self.path} could not be read ({exc}); it was left untouched"
            ) from exc

    def key_row(self, key: bytes) -> tuple[int, bytes, int] | None:
        # Its own read-only connection: the writer thread owns `conn` (a read there could see
        # a checkpoint half-written). A key's row changes only by a checkpoint that holds the
        # key, and the engine reads a key before it takes part in any, so the last committed
        # state is the one it restored.
        try:
            with self._reader_lock:
                if self._reader is None:
                    self._reader = sqlite3.connect(
                        f"{self.path.resolve().as_uri()}?mode=ro",
                        uri=True, isolation_level=None, check_same_thread=False,
                    )  # fmt: skip
                # The writer's memory SQL (it knows its schema: no query on `conn`, which the
                # writer thread owns).
                memory = self._memory_sql()
                rows = self._reader.execute(
                    f"SELECT next_dispatch, {memory}, memory_version FROM keys WHERE key = ?",
                    (key,),
                ).fetchall()  # fetchall: no statement (and no read snapshot) is left open
        except sqlite3.DatabaseError as exc:
            raise StateError(
                f"{self.path} could not be read ({exc}); it was left untouched"
            ) from exc
        return rows[0] if rows else None

    def stats(self) -> dict[str, Any]:
        counts = self.meta("counts")
        row = self.conn.execute(
            "SELECT id, triggered_at, duration_ms, size_bytes FROM checkpoints ORDER BY id DESC LIMIT 1"
        ).fetchone()
        latest = None
        if row is not None:
            latest = {
                "id": row[0],
                "trigger_timestamp": row[1],
                "duration_ms": row[2],
                "size_bytes": row[3],
            }
        return {
            "counts": counts,
            "latest_completed": latest,
            "latest_restored": self.meta("latest_restored"),
        }

    def summary(self) -> dict[str, Any]:
        c = self.conn
        return {
            "state_db": str(self.path),
            "agent": self.meta("agent_name"),
            "actions": self.meta("actions"),
            "checkpoints": self.stats(),
            "keys": c.execute("SELECT COUNT(*) FROM keys").fetchone()[0],
            "in_flight_runs": c.execute("SELECT COUNT(*) FROM runs").fetchone()[0],
            "queued_inputs": c.execute(
                "SELECT COUNT(*) FROM inputs WHERE seq NOT IN (SELECT seq FROM runs)"
            ).fetchone()[0],
            "unreleased_outputs": c.execute("SELECT COUNT(*) FROM outbox").fetchone()[0],
            "source": self.meta("source"),
            "memory_version": self._meta_or("memory_version", 1),
            # Pins go at the next adopt; a pin whose run completed since is not counted.
            "runs_on_earlier_versions": sum(
                1
                for s in self._meta_or("pinned_runs", {})
                if c.execute("SELECT 1 FROM runs WHERE seq = ?", (int(s),)).fetchone()
            ),
            "dead_letters": len(letters := self.dead_letters()),
            "runs_failed": sum(1 for d in letters if d["kind"] == "failed-run"),
            "waiting": self.waits(),
            "paused": self._meta_or("report.paused", []),
            "pending_signals": self.pending_signals(),
            "upgrades": self._meta_or("upgrades", []),
        }

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        """Reads that see one committed state: a reader (`ratchet inspect`) asks which schema
        the file has, then reads by it, while a job may migrate the file in between."""
        c = self.conn
        if c.in_transaction:
            yield c
            return
        c.execute("BEGIN")
        try:
            yield c
        finally:
            if c.in_transaction:
                c.execute("COMMIT")  # nothing written: it only ends the snapshot

    def memories(self, key_text: str | None = None) -> list[tuple[bytes, bytes]]:
        """(key, memory) of every key, in text order, or of the keys whose text is `key_text`
        (the string key itself, and any other key that reads so, like the integer 42)."""
        with self._snapshot() as c:
            memory = self._memory_sql()
            if key_text is None:
                return c.execute(f"SELECT key, {memory} FROM keys ORDER BY key_text").fetchall()
            # Two indexed reads: the string key by its primary key, any other by keys_by_text
            # (from schema 8 it holds only keys that are not strings; before, every key).
            return c.execute(
                f"SELECT key, {memory} FROM keys WHERE key = ? AND key_text = ? UNION ALL "
                f"SELECT key, {memory} FROM keys WHERE key_text = ? AND NOT {_KEY_IS_STR}",
                (codec.encode(key_text), key_text, key_text),
            ).fetchall()

    def key_rows(self) -> list[tuple[bytes, str, int, bytes, int]]:
        """Every key row as `CheckpointRows.keys` holds it (re-sharding moves them)."""
        with self._snapshot() as c:
            return c.execute(
                f"SELECT key, key_text, next_dispatch, {self._memory_sql()}, memory_version "
                "FROM keys"
            ).fetchall()

    # -- writing ----------------------------------------------------------------------------

    def _has_table(self, name: str) -> bool:
        row = self.conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
        ).fetchone()
        return row is not None

    def _ensure_table(self, name: str) -> None:
        """Create a table new databases make on first use (inside the caller's transaction)."""
        if not self._has_table(name):
            for stmt in _LAZY_TABLES[name]:
                self.conn.execute(stmt)

    def ensure_tables(self) -> None:
        """Create every table made on first use, for a writer that copies rows in with SQL
        (re-sharding)."""
        with self._transaction():
            for name in _LAZY_TABLES:
                self._ensure_table(name)

    def _memory_sql(self) -> str:
        """The SQL of a key row's memory: in the row, or in `spilled` (schema 8 on)."""
        if self._spilled or self._has_table("spilled"):
            return "COALESCE(memory, (SELECT s.memory FROM spilled s WHERE s.key = keys.key))"
        return "memory"

    def _put_keys(
        self, c: sqlite3.Connection, rows: list[tuple[bytes, str, int, bytes, int]]
    ) -> None:
        """Upsert key rows; a memory larger than _INLINE_MEMORY goes to `spilled` (a memory
        that fits again comes back into its row, and the trigger drops its spilled copy)."""
        if all(len(r[3]) <= _INLINE_MEMORY for r in rows):
            c.executemany(_UPSERT_KEY, rows)
            return
        last = {r[0]: r for r in rows}  # a key written twice: its last row, as upserts in turn
        c.executemany(
            "INSERT INTO spilled(key, memory) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET "
            "memory = excluded.memory",
            [(k, r[3]) for k, r in last.items() if len(r[3]) > _INLINE_MEMORY],
        )
        c.executemany(
            _UPSERT_KEY,
            [
                (k, t, nd, None if len(mem) > _INLINE_MEMORY else mem, v)
                for k, (_, t, nd, mem, v) in last.items()
            ],
        )

    def _set_meta(self, name: str, value: Any) -> None:
        self.conn.execute(
            "INSERT INTO meta(name, value) VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET value = excluded.value",
            (name, codec.encode(value)),
        )

    def write_checkpoint(self, rows: CheckpointRows, triggered_at: float) -> dict[str, Any]:
        """Apply one checkpoint in one transaction; on any error nothing of it is applied."""
        started = self.clock.monotonic()
        with self._transaction() as c:
            checkpoint_id = self.meta("next_checkpoint_id")
            if rows.keys:
                self._put_keys(c, rows.keys)
            if rows.new_inputs:
                c.executemany(
                    "INSERT OR REPLACE INTO inputs(seq, key, event) VALUES (?, ?, ?)",
                    rows.new_inputs,
                )
            if rows.done_inputs:
                done = [(s,) for s in rows.done_inputs]
                c.executemany("DELETE FROM inputs WHERE seq = ?", done)
                c.executemany("DELETE FROM runs WHERE seq = ?", done)
            # Before the records go: the signals a failed run took stay with its dead letter.
            dead_letters = self._failed_runs_keep_signals(c, rows)
            if rows.completed:
                c.executemany("DELETE FROM calls WHERE seq = ?", [(s,) for s in rows.completed])
            if rows.runs:
                c.executemany(
                    "INSERT OR REPLACE INTO runs(seq, key, base_dispatch, journal) VALUES (?, ?, ?, ?)",
                    rows.runs,
                )
            if rows.outbox:
                c.executemany(
                    # An upsert keeps the row where it was first written (emission order).
                    "INSERT INTO outbox(id, seq, record) VALUES (?, ?, ?) ON CONFLICT(id) DO "
                    "UPDATE SET seq = excluded.seq, record = excluded.record",
                    rows.outbox,
                )
            if rows.released:
                c.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in rows.released])
            if dead_letters:
                c.executemany(
                    "INSERT INTO dead_letters(key, key_text, seq, event, reason, at, kind, detail) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    dead_letters,
                )
            if rows.redriven:
                c.executemany(
                    "UPDATE dead_letters SET redriven_as = ? WHERE id = ? AND redriven_as IS NULL",
                    [(seq, i) for i, seq in rows.redriven],
                )
            if rows.ltm_add or rows.ltm_delete:
                self._ensure_table("ltm")
            if rows.ltm_add:
                c.executemany(
                    "INSERT OR REPLACE INTO ltm(scope, id, text, metadata, vector, at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    rows.ltm_add,
                )
            if rows.ltm_delete:
                c.executemany("DELETE FROM ltm WHERE scope = ? AND id = ?", rows.ltm_delete)
            if rows.source:
                self._set_meta("source", rows.source)
            for name, value in rows.report.items():
                self._set_meta(f"report.{name}", value)
            if rows.traces:
                self._ensure_table("traces")
                c.executemany(
                    "INSERT OR REPLACE INTO traces(key_text, seq, at, status, trace, key_type) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    rows.traces,
                )
                keep, age = rows.trace_retention
                if keep is not None and rows.trace_prune:
                    # A key's last N: its own traces and those kept before types were (either
                    # key's), not the other key's of the same text.
                    mine = "key_text = ?1 AND (key_type = ?2 OR key_type IS NULL)"
                    c.executemany(
                        f"DELETE FROM traces WHERE {mine} AND seq NOT IN (SELECT seq FROM "
                        f"traces WHERE {mine} ORDER BY seq DESC LIMIT ?3)",
                        [(k, t, keep) for k, t in rows.trace_prune],
                    )
                if age is not None:
                    c.execute("DELETE FROM traces WHERE at < ?", (triggered_at - age,))
            size = rows.size()
            duration_ms = (self.clock.monotonic() - started) * 1000.0
            c.execute(
                "INSERT INTO checkpoints(id, triggered_at, duration_ms, size_bytes) VALUES (?, ?, ?, ?)",
                (checkpoint_id, triggered_at, duration_ms, size),
            )
            c.execute(
                "DELETE FROM checkpoints WHERE id <= ?", (checkpoint_id - _KEEP_CHECKPOINT_ROWS,)
            )
            counts = self.meta("counts")
            counts["completed"] += 1
            self._set_meta("counts", counts)
            self._set_meta("next_checkpoint_id", checkpoint_id + 1)
        self._maybe_vacuum()
        return {
            "id": checkpoint_id,
            "trigger_timestamp": triggered_at,
            "duration_ms": (self.clock.monotonic() - started) * 1000.0,
            "size_bytes": size,
        }

    def _failed_runs_keep_signals(
        self, c: sqlite3.Connection, rows: CheckpointRows
    ) -> list[tuple[bytes, str, int, bytes, str, float, str, bytes | None]]:
        """The checkpoint's dead letters, a failed run's (its records deleted by this
        checkpoint) with the signals the run took in its detail, as `discard_run` keeps an
        abandoned run's: a redrive puts them back (`redrive_signals`)."""
        done = set(rows.completed)
        letters: list[tuple[bytes, str, int, bytes, str, float, str, bytes | None]] = []
        for row in rows.dead_letters:
            key, _text, seq, _event, _reason, _at, kind, detail = row
            if kind == FAILED_RUN and seq in done:
                taken = self._run_signals(self._run_calls(c, seq), key)
                if taken:
                    letters.append((*row[:7], with_run_signals(detail, taken)))
                    continue
            letters.append(row)
        return letters

    @staticmethod
    def _run_calls(c: sqlite3.Connection, seq: int) -> list[tuple[Any, ...]]:
        """A run's call records as rows: the record's fields, then what it keeps of a signal
        it took (`calls.taken`)."""
        return c.execute(
            "SELECT seq, task_id, idx, fn, digest, status, payload, taken FROM calls "
            "WHERE seq = ? ORDER BY task_id, idx",
            (seq,),
        ).fetchall()

    def _run_signals(
        self, found: list[tuple[Any, ...]], key: bytes
    ) -> list[tuple[int | None, str, str, bytes, float, str | None]]:
        """Every signal the run whose records are `found` (`_run_calls`) took (`run_signals`)."""
        records = [CallRecord(*r[:7]) for r in found]
        kept = {(r[1], r[2]): r[7] for r in found}
        return run_signals(
            records, kept, lambda: codec.decode(key, unknown="generic"), self.clock.now()
        )

    def _maybe_vacuum(self) -> None:
        """Return free pages to the file system once there are enough of them to matter.

        Best effort: it runs after a commit, and raising then would report a write that
        happened as one that did not."""
        try:
            free = self.conn.execute("PRAGMA freelist_count").fetchone()[0]
            if free * self._page_size >= _VACUUM_FREE_BYTES:
                # executescript steps the pragma to the end (execute() would free one page).
                self.conn.executescript("PRAGMA incremental_vacuum;")
        except sqlite3.Error:
            pass

    def forget_outputs(self, ids: list[str]) -> None:
        """Delete outbox rows whose outputs the sink holds (they are never needed again)."""
        with self._transaction() as c:
            c.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in ids])
        self._maybe_vacuum()

    def count_failed_checkpoint(self) -> None:
        """Best effort: the disk that failed the checkpoint may fail this too."""
        try:
            with self._transaction():
                counts = self.meta("counts")
                counts["failed"] += 1
                self._set_meta("counts", counts)
        except (sqlite3.Error, StateWriteError):
            pass

    @property
    def max_value_bytes(self) -> int:
        """The largest value SQLite stores (SQLITE_LIMIT_LENGTH, 1e9 bytes by default): a
        key's memory over it could never be checkpointed."""
        return self.conn.getlimit(sqlite3.SQLITE_LIMIT_LENGTH)

    def mark_reshard_seed(self) -> None:
        """Mark the latest completed checkpoint as the one re-sharding wrote into this new
        shard: what it moved in, not a checkpoint of the job's own (starting from it is a
        first start, not a restore). Nor is it counted as a completed checkpoint: a brand-new
        job with two workers said it had completed two before it had taken any."""
        with self._transaction():
            latest = self.stats()["latest_completed"]
            if latest is not None and self._meta_or("reshard_seed", None) != latest["id"]:
                self._set_meta("reshard_seed", latest["id"])
                counts = self.meta("counts")
                counts["completed"] = max(0, counts["completed"] - 1)
                self._set_meta("counts", counts)

    def record_restore(self) -> dict[str, Any] | None:
        """Count a restore of the latest completed checkpoint; returns it (None on a fresh start)."""
        with self._transaction():
            latest = self.stats()["latest_completed"]
            if latest is None or latest["id"] == self._meta_or("reshard_seed", None):
                # Nothing, or only what re-sharding moved in (a new shard): a first start.
                return None
            counts = self.meta("counts")
            counts["restored"] += 1
            restored = dict(latest, restored_at=self.clock.now())
            self._set_meta("counts", counts)
            self._set_meta("latest_restored", restored)
        return restored

    # -- operations on a stopped job (`ratchet runs`, `ratchet migrate`) ---------------------

    def runs_in_flight(self) -> list[dict[str, Any]]:
        """Runs the state holds in flight: key, input seq, journaled tasks, call records, and
        the agent version they run under (None: the current one)."""
        pins = {int(s): fp for s, fp in self._meta_or("pinned_runs", {}).items()}
        out = []
        rows = self.conn.execute("SELECT seq, key, journal FROM runs ORDER BY seq").fetchall()
        for seq, key, journal in rows:
            calls = self.conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(status != 'intent'), 0) FROM calls WHERE seq = ? "
                "AND idx >= 0",  # a replay marker (negative index) is not a call
                (seq,),
            ).fetchone()
            try:
                tasks = len(codec.decode(journal, unknown="generic"))
            except (codec.CorruptDataError, TypeError):
                tasks = None
            out.append(
                {
                    "key": codec.decode(key, unknown="generic"),
                    "seq": seq,
                    "journaled_tasks": tasks,
                    "call_records": calls[0],
                    "calls_returned": calls[1],
                    "agent_version": pins.get(seq),
                }
            )
        return out

    def dead_letters(self) -> list[dict[str, Any]]:
        """Every dead letter, oldest first (`ratchet dead-letters`)."""
        cols = {row[1] for row in self.conn.execute("PRAGMA table_info(dead_letters)")}
        if not cols:  # a state from before schema 3, read without migrating it
            return []
        if "kind" not in cols:  # schema 3 or 4
            rows = self.conn.execute(
                "SELECT id, key_text, seq, reason, at FROM dead_letters ORDER BY id"
            ).fetchall()
            return [
                {"id": i, "kind": "abandoned", "key": k, "seq": seq, "reason": reason, "at": at}
                for i, k, seq, reason, at in rows
            ]
        out = []
        for i, k, seq, reason, at, kind, detail, requested, redriven, blob in self.conn.execute(
            "SELECT id, key_text, seq, reason, at, kind, detail, redrive_requested, redriven_as, "
            "key FROM dead_letters ORDER BY id"
        ):
            letter = {"id": i, "kind": kind, "key": k, "seq": seq, "reason": reason, "at": at}
            typed = _dead_key_type(blob)
            if typed is not None:  # the integer key 1 and the string key "1" read alike
                letter["key_type"] = typed
            if detail is not None:
                try:
                    letter["detail"] = _readable_detail(codec.decode(detail, unknown="generic"))
                except (codec.CorruptDataError, TypeError):
                    letter["detail"] = None
            letter["redrive_requested"] = requested
            letter["redriven_as"] = redriven
            out.append(letter)
        return out

    def dead_letter_key_types(self, key_text: str) -> set[str]:
        """The types ('str', 'int') of the keys of text `key_text` that have dead letters (a
        key whose only trace in the state is a dead letter is still one `redrive` acts on)."""
        if not self._has_table("dead_letters"):
            return set()
        rows = self.conn.execute(
            "SELECT DISTINCT key FROM dead_letters WHERE key_text = ?", (key_text,)
        )
        return {t for (blob,) in rows if (t := _dead_key_type(blob)) is not None}

    def redrives(self) -> list[tuple[int, bytes, bytes]]:
        """Dead letters asked to be redriven and not redriven yet: (id, key, event)."""
        return self.conn.execute(
            "SELECT id, key, event FROM dead_letters WHERE redrive_requested IS NOT NULL AND "
            "redriven_as IS NULL AND kind != 'bad-input' ORDER BY id"
        ).fetchall()

    def discard_run(self, seq: int, dead_letter_reason: str | None) -> dict[str, int | None]:
        """Forget the in-flight run of input `seq`: its journal, call records and unreleased
        outputs. Without a reason its input stays queued (the run starts again from it) and
        the signals the run took go back to the signals table as they were sent
        (`run_signals`), so that the run takes them again; with one the input moves to the
        dead letters, and those signals go with it (its detail) until a redrive admits it
        (`redrive_signals`). One transaction. Counts what was discarded, and the signals put
        back (`signals_put_back`) or kept with the dead letter (`signals_kept`)."""
        with self._transaction() as c:
            row = c.execute("SELECT key, journal FROM runs WHERE seq = ?", (seq,)).fetchone()
            if row is None:
                raise StateError(f"{self.path} has no run in flight for input {seq}")
            key, journal = row
            found = self._run_calls(c, seq)
            calls = [CallRecord(*r[:7]) for r in found if r[2] >= 0]  # a marker is not a call
            counts: dict[str, int | None] = {
                "journaled_tasks": journal_tasks(journal),
                "call_records": len(calls),
                "calls_returned": sum(1 for r in calls if r.status != "intent"),
                "unreleased_outputs": c.execute(
                    "DELETE FROM outbox WHERE seq = ?", (seq,)
                ).rowcount,
            }
            taken = self._run_signals(found, key)
            c.execute("DELETE FROM runs WHERE seq = ?", (seq,))
            c.execute("DELETE FROM calls WHERE seq = ?", (seq,))
            if dead_letter_reason is not None:
                event = c.execute("SELECT event FROM inputs WHERE seq = ?", (seq,)).fetchone()
                if event is None:
                    raise StateError(f"{self.path}: the run of input {seq} has no input row")
                c.execute(
                    "INSERT INTO dead_letters(key, key_text, seq, event, reason, at, kind, "
                    "detail) VALUES (?, ?, ?, ?, ?, ?, 'abandoned', ?)",
                    (
                        key,
                        str(codec.decode(key, unknown="generic")),
                        seq,
                        event[0],
                        dead_letter_reason,
                        self.clock.now(),
                        with_run_signals(None, taken),
                    ),
                )
                c.execute("DELETE FROM inputs WHERE seq = ?", (seq,))
                counts["signals_kept"] = len(taken)
            else:
                counts["signals_put_back"] = len(self._insert_signals(c, taken))
            pins = dict(self._meta_or("pinned_runs", {}))
            if pins.pop(str(seq), None) is not None:
                self._set_meta("pinned_runs", pins)
        return counts

    def redrive_signals(self, dead_ids: list[int]) -> list[SignalRow]:
        """Put back the signals that the failed or abandoned runs of these dead letters (asked
        to be redriven, not redriven yet) took (their detail keeps them: `write_checkpoint`,
        `discard_run`), each once: in the same transaction the detail records them as put
        back (`signals_put_back`, with the ids they got). The engine calls it when a redrive
        admits a dead letter, before the new run starts, so that run takes them again.
        Returns the signals put back."""
        if not dead_ids:
            return []
        back: list[SignalRow] = []
        with self._transaction() as c:
            for dead_id in dead_ids:
                row = c.execute(
                    "SELECT detail FROM dead_letters WHERE id = ? AND kind IN (?, ?) AND "
                    "redrive_requested IS NOT NULL AND redriven_as IS NULL AND detail IS NOT NULL",
                    (dead_id, *KEEPS_SIGNALS),
                ).fetchone()
                detail = codec.decode(row[0], unknown="generic") if row is not None else None
                if not isinstance(detail, dict) or not detail.get("signals"):
                    continue
                put = self._insert_signals(c, [entry_signal(e) for e in detail.pop("signals")])
                detail["signals_put_back"] = [signal_entry(r) for r in put]
                c.execute(
                    "UPDATE dead_letters SET detail = ? WHERE id = ?",
                    (codec.encode(detail), dead_id),
                )
                back += put
        return back

    def keys_to_migrate(self, below: int) -> tuple[int, set[bytes]]:
        """How many keys have memory older than `below`, and the keys with a run in flight
        (their memory is migrated when their next run starts: the run resumes on the old)."""
        n = self.conn.execute(
            "SELECT COUNT(*) FROM keys WHERE memory_version < ?", (below,)
        ).fetchone()[0]
        busy = {row[0] for row in self.conn.execute("SELECT DISTINCT key FROM runs")}
        return n, busy

    def old_memories(
        self, below: int, after: bytes | None, limit: int
    ) -> list[tuple[bytes, int, bytes, int]]:
        """Up to `limit` keys (in key order, after `after`) with memory older than `below`."""
        with self._snapshot() as c:
            return c.execute(
                f"SELECT key, next_dispatch, {self._memory_sql()}, memory_version FROM keys "
                "WHERE memory_version < ? AND key > ? ORDER BY key LIMIT ?",
                (below, after if after is not None else b"", limit),
            ).fetchall()

    def put_migrated(self, rows: list[tuple[bytes, int, bytes, int]]) -> None:
        """Write migrated memories (key, old version, memory, new version) in one transaction;
        a row whose version moved meanwhile is left alone."""
        with self._transaction() as c:
            for key, old, mem, new in rows:
                inline = len(mem) <= _INLINE_MEMORY
                updated = c.execute(
                    "UPDATE keys SET memory = ?, memory_version = ? WHERE key = ? AND "
                    "memory_version = ?",
                    (mem if inline else None, new, key, old),
                ).rowcount
                if updated and not inline:
                    c.execute(
                        "INSERT INTO spilled(key, memory) VALUES (?, ?) ON CONFLICT(key) DO "
                        "UPDATE SET memory = excluded.memory",
                        (key, mem),
                    )

    def signals_after(self, signal_id: int) -> list[tuple[int, str, str, bytes, float, str | None]]:
        return self.conn.execute(
            "SELECT id, key_text, name, value, sent_at, key_type FROM signals WHERE id > ? "
            "ORDER BY id",
            (signal_id,),
        ).fetchall()

    def consume_signal(self, signal_id: int, record: CallRecord) -> None:
        r = record
        with self._transaction() as c:
            sent = c.execute(
                "SELECT key_text, sent_at, key_type FROM signals WHERE id = ?", (signal_id,)
            ).fetchone()
            if sent is None:
                raise StateError(f"{self.path}: signal {signal_id} was consumed already")
            c.execute("DELETE FROM signals WHERE id = ?", (signal_id,))
            # The record keeps the signal as sent (`discard_run` puts it back from there).
            c.execute(
                "INSERT OR REPLACE INTO calls(seq, task_id, idx, fn, digest, status, payload, "
                "taken) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (r.seq, r.task_id, r.idx, r.fn, r.digest, r.status, r.payload,
                 taken_signal(signal_id, *sent)),
            )  # fmt: skip
            # Taken by an attempt that replay has not accepted (its replay marker covers the
            # record): the marker keeps the signal as sent, so that dropping the record puts
            # it back (drop_calls, release_signals) instead of losing it.
            markers = self._markers(c, r.seq, r.task_id)
            mark = covering_marker(markers, r.idx)
            if mark is not None:
                taken = taken_signals(markers[mark])
                taken[r.idx] = [signal_id, *sent]
                c.execute(
                    "UPDATE calls SET payload = ? WHERE seq = ? AND task_id = ? AND idx = ?",
                    (codec.encode(taken), r.seq, r.task_id, mark),
                )

    @staticmethod
    def _markers(c: sqlite3.Connection, seq: int, task_id: str) -> dict[int, bytes | None]:
        """A task's replay markers: index -> payload."""
        return dict(
            c.execute(
                "SELECT idx, payload FROM calls WHERE seq = ? AND task_id = ? AND idx < 0 "
                "AND fn = ?",
                (seq, task_id, REPLAY_FN),
            ).fetchall()
        )

    def _put_back(
        self, c: sqlite3.Connection, seq: int, task_id: str, records: list[CallRecord]
    ) -> dict[int, SignalRow]:
        """Put back the signals that `records` (about to be deleted) took, as `_insert_signals`
        does. Returns them by the index of the record that had taken them."""
        taken = list(signals_taken(self._markers(c, seq, task_id), records))
        back = self._insert_signals(c, [row for _r, row in taken])
        return {r.idx: row for (r, _row), row in zip(taken, back, strict=True)}

    @staticmethod
    def _insert_signals(
        c: sqlite3.Connection, rows: Iterable[tuple[int | None, str, str, bytes, float, str | None]]
    ) -> list[SignalRow]:
        """Put signals back with the id and time they were sent: they are delivered again, in
        their place among the others. Returns them as put back."""
        back = []
        for sid, key_text, name, value, sent_at, key_type in rows:
            # Its own id (AUTOINCREMENT never gives one twice), else (not expected; or one
            # whose id was not kept: None) a new one.
            used = sid is None or c.execute("SELECT 1 FROM signals WHERE id = ?", (sid,)).fetchone()
            cur = c.execute(
                "INSERT INTO signals(id, key_text, name, value, sent_at, key_type) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (None if used else sid, key_text, name, value, sent_at, key_type),
            )
            back.append((int(cur.lastrowid or 0), key_text, name, value, sent_at, key_type))
        return back

    def _task_calls(
        self, c: sqlite3.Connection, seq: int, task_id: str, where: str, args: tuple[Any, ...]
    ) -> list[CallRecord]:
        rows = c.execute(
            "SELECT seq, task_id, idx, fn, digest, status, payload FROM calls WHERE seq = ? "
            f"AND task_id = ? AND {where}",
            (seq, task_id, *args),
        ).fetchall()
        return [CallRecord(*row) for row in rows]

    def waits(self) -> list[dict[str, Any]]:
        """Durable waits of runs in flight: signal waits not answered yet and sleeps (from
        their call records), and delayed events not due yet (from their journals) (`ratchet
        status` of a state, running or stopped)."""
        return self.call_waits() + self._delayed_events()

    def call_waits(self) -> list[dict[str, Any]]:
        """The waits kept in call records: signals not answered yet, and sleeps not over
        (without decoding every journal, as the delayed events need)."""
        out = []
        rows = self.conn.execute(
            "SELECT c.seq, r.key, c.task_id, c.fn, c.digest, c.status, c.payload FROM calls c "
            "JOIN runs r ON r.seq = c.seq WHERE c.fn IN ('ratchet.sleep', 'ratchet.signal') "
            "ORDER BY c.seq, c.task_id, c.idx"
        ).fetchall()
        for seq, key, task, fn, digest, status, payload in rows:
            try:
                when = codec.decode(payload or b"")
            except (codec.CorruptDataError, TypeError):
                when = {}
            if fn == "ratchet.signal" and status != "intent":
                continue
            if fn == "ratchet.sleep" and isinstance(when, dict):
                if (when.get("until") or 0) <= self.clock.now():
                    continue  # over: the task went on (or goes on when it next runs)
            on = "sleep" if fn == "ratchet.sleep" else f"signal {digest}"
            out.append(
                {
                    "key": codec.decode(key, unknown="generic"),
                    "seq": seq,
                    "task": task,
                    "on": on,
                    "since": when.get("since") if isinstance(when, dict) else None,
                    "until": when.get("until") if isinstance(when, dict) else None,
                }
            )
        return out

    def _delayed_events(self) -> list[dict[str, Any]]:
        """Runs in flight holding a delayed event (`send_event(delay=)`) not due yet: their
        journals hold it as `ratchet.Delayed` (one due already came out when the job ran)."""
        out = []
        now = self.clock.now()
        for seq, key, journal in self.conn.execute("SELECT seq, key, journal FROM runs"):
            try:
                entries = codec.decode(journal, unknown="generic")
            except (codec.CorruptDataError, TypeError):
                continue  # damaged: the usual checks name it when the run is restored
            for entry in entries if isinstance(entries, list) else ():
                if not (isinstance(entry, tuple) and len(entry) == 5) or str(entry[0])[:1] == "!":
                    continue
                for event in entry[4]:
                    if not (isinstance(event, tuple) and len(event) == 2):
                        continue
                    name, fields = event
                    due = fields.get("due") if isinstance(fields, dict) else None
                    if name != "ratchet.Delayed" or not isinstance(due, int | float) or due <= now:
                        continue
                    inner = fields.get("event")
                    what = inner[0] if isinstance(inner, tuple) and inner else "?"
                    out.append(
                        {
                            "key": codec.decode(key, unknown="generic"),
                            "seq": seq,
                            "task": entry[0],
                            "on": f"delayed event {what}",
                            "since": None,
                            "until": float(due),
                        }
                    )
        return out

    def ltm_rows(self, scope: str) -> list[tuple[str, str, bytes, bytes, float]]:
        """The long-term memories of one scope: (id, text, encoded metadata, float32 vector,
        added at), oldest first."""
        exists = self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'ltm'").fetchone()
        if exists is None:
            return []
        rows = self.conn.execute(
            "SELECT id, text, metadata, vector, at FROM ltm WHERE scope = ? ORDER BY at, id",
            (scope,),
        ).fetchall()
        return [(str(i), str(t), bytes(m), bytes(v), float(a)) for i, t, m, v, a in rows]

    def traces(
        self, key_text: str, seq: int | None = None, key_type: str | None = None
    ) -> list[dict[str, Any]]:
        """Kept traces of a key's completed runs, newest first (or the one of input `seq`).

        `key_type` ('str' or 'int') says which of the two keys of a text like "1" (traces kept
        before types were recorded are either's); None: every trace of the text. A trace that
        records its key's type says it (`key_type`)."""
        if not self._has_table("traces"):
            return []
        typed = traces_typed(self.conn)
        sql = f"SELECT seq, at, status, trace, {'key_type' if typed else 'NULL'} FROM traces "
        sql += "WHERE key_text = ?"
        params: list[Any] = [key_text]
        if seq is not None:
            sql += " AND seq = ?"
            params.append(seq)
        if key_type is not None and typed:
            sql += " AND (key_type = ? OR key_type IS NULL)"
            params.append(key_type)
        out = []
        for s, at, status, blob, kt in self.conn.execute(sql + " ORDER BY seq DESC", params):
            started, tasks = unpack_trace(blob)
            row = {
                "key": key_text,
                "seq": s,
                "completed_at": at,
                "status": status,
                "started_at": started,
                "tasks": tasks,
            }
            if kt is not None:
                row["key_type"] = kt
            out.append(row)
        return out

    def held_key_types(self, key_text: str) -> set[str]:
        """The types ('str', 'int') of the keys of text `key_text` the state holds: in its
        keys, its runs or its typed traces. Two for a text like "1" whose string and integer
        keys both ran."""
        forms: dict[str, Any] = {"str": key_text}
        if int_text(key_text):
            forms["int"] = int(key_text)
        held = {
            kind
            for kind, form in forms.items()
            if self.conn.execute(
                "SELECT 1 FROM keys WHERE key = ?1 UNION ALL SELECT 1 FROM runs WHERE key = ?1",
                (codec.encode(form),),
            ).fetchone()
        }
        if self._has_table("traces") and traces_typed(self.conn):
            held.update(
                str(t)
                for (t,) in self.conn.execute(
                    "SELECT DISTINCT key_type FROM traces WHERE key_text = ? AND key_type "
                    "IS NOT NULL",
                    (key_text,),
                )
            )
        return held

    def pending_signals(self) -> list[dict[str, Any]]:
        """Signals sent and not consumed yet (`ratchet status`)."""
        exists = self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'signals'").fetchone()
        if exists is None:
            return []
        typed = signals_typed(self.conn)
        return [
            {"id": i, "key": k, "name": n, "sent_at": t, **({"key_type": kt} if kt else {})}
            for i, k, n, t, kt in self.conn.execute(
                f"SELECT id, key_text, name, sent_at, {'key_type' if typed else 'NULL'} "
                "FROM signals ORDER BY id"
            )
        ]

    def put_calls(self, records: Iterable[CallRecord]) -> None:
        """Write durable-call records through at once, in one transaction (a group commit)."""
        rows = [(r.seq, r.task_id, r.idx, r.fn, r.digest, r.status, r.payload) for r in records]
        with self._transaction() as c:
            c.executemany(
                "INSERT OR REPLACE INTO calls(seq, task_id, idx, fn, digest, status, payload) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )

    def drop_calls(self, seq: int, task_id: str, from_idx: int) -> list[SignalRow]:
        """Delete the call records of one task from `from_idx` on, and its replay marker
        (index -from_idx): what a refused replay attempt added (`TaskCalls.discard_new`).
        A signal one of them took is put back, in the same transaction; returns those."""
        with self._transaction() as c:
            dropped = self._task_calls(c, seq, task_id, "idx >= ?", (from_idx,))
            back = self._put_back(c, seq, task_id, dropped)
            c.execute(
                "DELETE FROM calls WHERE seq = ? AND task_id = ? AND (idx >= ? OR idx = ?)",
                (seq, task_id, from_idx, -from_idx),
            )
        return list(back.values())

    def release_signals(self, seq: int, task_id: str, idxs: list[int]) -> list[SignalRow]:
        """Delete the records at `idxs` of one task that took a signal its replay marker
        keeps, and put those signals back, in one transaction; returns them. (The records of
        an attempt replay never accepted, which the accepted one did not use.)"""
        if not idxs:
            return []
        with self._transaction() as c:
            marks = ",".join("?" * len(idxs))
            records = self._task_calls(c, seq, task_id, f"idx IN ({marks})", tuple(idxs))
            back = self._put_back(c, seq, task_id, records)
            c.executemany(
                "DELETE FROM calls WHERE seq = ? AND task_id = ? AND idx = ?",
                [(seq, task_id, i) for i in back],
            )
        return list(back.values())

    def release_attempt_signals(self, seq: int, task_id: str, key: Any) -> list[SignalRow]:
        """Delete the delivered signals' records of one failed attempt (`task_id`) that will
        be tried again, and put the signals they took back as they were sent (`run_signals`),
        in one transaction; returns them. The retried attempt's wait takes them again."""
        with self._transaction() as c:
            found = c.execute(
                "SELECT seq, task_id, idx, fn, digest, status, payload, taken FROM calls "
                "WHERE seq = ? AND task_id = ? ORDER BY idx",
                (seq, task_id),
            ).fetchall()
            records = [CallRecord(*r[:7]) for r in found]
            kept = {(r[1], r[2]): r[7] for r in found}
            taken = run_signals(records, kept, lambda: key, self.clock.now())
            c.execute(
                "DELETE FROM calls WHERE seq = ? AND task_id = ? AND fn = ? AND status = 'ok'",
                (seq, task_id, SIGNAL_FN),
            )
            return self._insert_signals(c, taken)

    def close(self) -> None:
        if self._writable:
            # Give every free page back (the writer does it only past _VACUUM_FREE_BYTES): up
            # to 1 MB of a stopped job's file was pages the outbox and inputs had left free.
            # Best effort, like _maybe_vacuum: the state is complete without it.
            with contextlib.suppress(sqlite3.Error):
                if self.conn.execute("PRAGMA freelist_count").fetchone()[0]:
                    self.conn.executescript("PRAGMA incremental_vacuum;")
        with self._reader_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        self.conn.close()


def describe_table(table: DispatchTable) -> list[str]:
    """A dispatch table as `ratchet status` shows it: 'name(Event, ...)' per action."""
    return [f"{name}({', '.join(events)})" for name, events in table]
