"""The durable-call journal of the Flink engine in PostgreSQL (`--call-journal postgresql://...`).

One table, `ratchet_call_journal` (created if missing), shared by every job: rows are keyed
naturally by (namespace, key, seq, task, idx), so a retried write is harmless. A terminal row
(`ok`/`error`) is never overwritten: `ON CONFLICT ... DO UPDATE ... WHERE status = 'intent'`.
`put` is one transaction per group of records, committed before it returns.

Connecting waits at most the URI's `connect_timeout` (default 10 s; libpq's own "0 = forever"
is refused), so a server that takes TCP connections and never answers fails the job's start
with a line naming it instead of hanging there.

The connection string may hold a password: it is only ever shown through `redact`, and the
journal keeps it in memory only (never in Flink state or a log line).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ratchet._errors import ConfigError
from ratchet.connectors import missing_extra, redact
from ratchet.connectors._postgres import address_of, connect_timeout_of
from ratchet.store._base import CallRecord
from ratchet.store._call_journal import JournalledCall

try:
    import psycopg
    from psycopg.conninfo import conninfo_to_dict
except ImportError as _exc:  # pragma: no cover - exercised where psycopg is missing
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

TABLE = "ratchet_call_journal"
FLAG = "--call-journal"
DSN_ENV = "RATCHET_CALL_JOURNAL"  # the URI when not on the command line (it may hold a password)

_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} ("
    " ns text NOT NULL, key text NOT NULL, seq bigint NOT NULL, task text NOT NULL,"
    " idx integer NOT NULL, input text NOT NULL, fn text NOT NULL, digest text NOT NULL,"
    " status text NOT NULL, payload bytea, completed_at double precision,"
    " written_at timestamptz NOT NULL DEFAULT now(),"
    " PRIMARY KEY (ns, key, seq, task, idx))",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_done ON {TABLE} (ns, completed_at)",
)
_PUT = (
    f"INSERT INTO {TABLE} AS j (ns, key, seq, task, idx, input, fn, digest, status, payload) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
    "ON CONFLICT (ns, key, seq, task, idx) DO UPDATE SET input = excluded.input, "
    "fn = excluded.fn, digest = excluded.digest, status = excluded.status, "
    "payload = excluded.payload, written_at = now() WHERE j.status = 'intent'"
)


def check_dsn(dsn: str) -> None:
    """Refuse a connection string libpq cannot parse (a `ConfigError` naming it, redacted)."""
    if _IMPORT_ERROR is not None:
        raise missing_extra(FLAG, dsn, "postgres", "psycopg", _IMPORT_ERROR)
    if not dsn.startswith(("postgresql://", "postgres://")):
        raise ConfigError(
            f"{FLAG} {redact(dsn)}: give a PostgreSQL URI, postgresql://USER@HOST:PORT/DB"
        )
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"{FLAG} {redact(dsn)}: {str(exc).strip()}") from None
    connect_timeout_of(dsn, FLAG, dsn)


class PostgresCallJournal:
    """`CallJournalStore` in one PostgreSQL table, for the records of one namespace.

    Thread-safe: one connection, used under a lock (the Flink core's writer thread puts, the
    operator thread reads a key's records when it first loads the key). A broken connection is
    reopened at the next call; the error of the call that found it broken is raised to the
    caller, who retries (the core's writer) or reports it.
    """

    def __init__(self, dsn: str, namespace: str, *, connect_timeout: int | None = None) -> None:
        check_dsn(dsn)
        if not namespace:
            raise ConfigError(f"{FLAG}: the journal namespace must not be empty")
        self._dsn = dsn
        self.namespace = namespace
        # The DSN's connect_timeout unless the caller sets one (a test): libpq's own default
        # would wait forever for a server that takes the TCP connection and never answers.
        self._timeout = connect_timeout or connect_timeout_of(dsn, FLAG, dsn)
        self._lock = threading.Lock()
        self._conn: Any = None
        with self._lock:
            try:
                conn = self._connection()
                for stmt in _SCHEMA:
                    conn.execute(stmt)
                conn.commit()
            except psycopg.errors.ConnectionTimeout:
                self._drop()
                raise ConfigError(
                    f"{FLAG} {redact(dsn)}: PostgreSQL at {address_of(dsn)} did not answer "
                    f"within {self._timeout} s (connect_timeout); check that the server is up "
                    f"and reachable, or give it longer with connect_timeout=SECONDS in its URI"
                ) from None
            except psycopg.Error as exc:
                self._drop()
                raise ConfigError(
                    f"{FLAG} {redact(dsn)}: cannot use PostgreSQL: {_first_line(exc)}"
                ) from None

    def __repr__(self) -> str:
        return f"PostgresCallJournal({redact(self._dsn)!r}, namespace={self.namespace!r})"

    def _connection(self) -> Any:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._drop()
            self._conn = psycopg.connect(self._dsn, connect_timeout=self._timeout)
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
        self._conn = None

    def _run(self, fn: Any) -> Any:
        with self._lock:
            conn = self._connection()
            try:
                result = fn(conn)
                conn.commit()
                return result
            except BaseException:
                try:
                    conn.rollback()
                except psycopg.Error:
                    self._drop()
                raise

    def put(self, calls: Sequence[JournalledCall]) -> None:
        ns = self.namespace
        rows = [
            (ns, c.key, c.record.seq, c.record.task_id, c.record.idx, c.input, c.record.fn,
             c.record.digest, c.record.status, c.record.payload)
            for c in calls
        ]  # fmt: skip
        if rows:
            self._run(lambda conn: conn.cursor().executemany(_PUT, rows))

    def get(self, key: str) -> list[JournalledCall]:
        def read(conn: Any) -> list[JournalledCall]:
            cur = conn.execute(
                f"SELECT seq, task, idx, input, fn, digest, status, payload FROM {TABLE} "
                "WHERE ns = %s AND key = %s ORDER BY seq, task, idx",
                (self.namespace, key),
            )
            return [
                JournalledCall(
                    key, inp, CallRecord(seq, task, idx, fn, digest, status, _bytes(payload))
                )
                for seq, task, idx, inp, fn, digest, status, payload in cur.fetchall()
            ]

        result: list[JournalledCall] = self._run(read)
        return result

    def keys(self) -> set[str]:
        rows = self._run(
            lambda conn: conn.execute(
                f"SELECT DISTINCT key FROM {TABLE} WHERE ns = %s", (self.namespace,)
            ).fetchall()
        )
        return {str(r[0]) for r in rows}

    def complete(self, marks: Sequence[tuple[str, int]], at: float) -> None:
        rows = [(at, self.namespace, key, seq) for key, seq in marks]
        if rows:
            self._run(
                lambda conn: conn.cursor().executemany(
                    f"UPDATE {TABLE} SET completed_at = %s WHERE ns = %s AND key = %s "
                    "AND seq <= %s AND completed_at IS NULL",
                    rows,
                )
            )

    def prune(self, before: float) -> int:
        n = self._run(
            lambda conn: (
                conn.execute(
                    f"DELETE FROM {TABLE} WHERE ns = %s AND completed_at < %s",
                    (self.namespace, before),
                ).rowcount
            )
        )
        return int(n)

    def clear(self) -> None:
        self._run(
            lambda conn: conn.execute(f"DELETE FROM {TABLE} WHERE ns = %s", (self.namespace,))
        )

    def count(self) -> int:
        """Rows of this namespace (for tests and reports)."""
        row = self._run(
            lambda conn: conn.execute(
                f"SELECT count(*) FROM {TABLE} WHERE ns = %s", (self.namespace,)
            ).fetchone()
        )
        return int(row[0])

    def close(self) -> None:
        with self._lock:
            self._drop()


def _bytes(v: Any) -> bytes | None:
    return None if v is None else bytes(v)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
