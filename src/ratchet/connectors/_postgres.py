"""PostgreSQL: a table of inputs read by an increasing id, and a table of outputs.

Source: `--input postgresql://USER@HOST:PORT/DB?table=NAME[&id_column=id][&poll=0.5]` reads
the rows in order of an integer id column; the last id read is ratchet's position, in its
checkpoint (the table is never written). With `--follow` it polls for rows above that id.

Sink: `--output postgresql://USER@HOST:PORT/DB?table=NAME[&write_timeout=30]` inserts each
output once: the output id is the primary key, each release is one transaction, and a row
that is already there (a release repeated after a crash) is skipped by `ON CONFLICT DO
NOTHING`. A write the server does not answer within `write_timeout` seconds fails (its
connection is cut; the outputs stay in the outbox and are written again later): a server
that hangs with its sockets open would otherwise hold every later write, and a stop, forever.

Both: libpq's `connect_timeout` (default here 10 s, whatever libpq's own default) bounds
opening: connecting, and then the checks of the table, which wait for a lock another session
holds on it. A server that takes TCP connections and never answers (SIGSTOPped, a black-hole
proxy), or a table locked by a long migration, is a one-line error at start, not a job that
hangs there for good.

psycopg is imported here, so `ratchet[postgres]` is needed only by those who use this.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import ConfigError, ServerUnreachableError
from ratchet.connectors import missing_extra, redact
from ratchet.runtime._io import (
    JobIdentity,
    Record,
    Sink,
    Source,
    _key_and_depth,
    _kind_of,
    to_json_line,
)

try:
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict
except ImportError as _exc:  # pragma: no cover - exercised by a test that hides psycopg
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

log = logging.getLogger("ratchet.connectors.postgres")

# The columns of an output table, with the type information_schema reports for each.
OUTPUT_COLUMNS = {
    "id": "text",
    "job": "text",
    "key": "text",
    "seq": "bigint",
    "task": "text",
    "record": "jsonb",
}
_INTEGER_TYPES = ("smallint", "integer", "bigint")
_SOURCE_PARAMS = frozenset({"table", "id_column", "poll"})  # and libpq's: connect_timeout=...
_SINK_PARAMS = frozenset({"table", "write_timeout"})
_WRITE_TIMEOUT = 30.0
_CONNECT_TIMEOUT = 10  # seconds; libpq takes whole seconds, and waits at least 2
_READ_BATCH = 500
# What follows the key in an output id, `:SEQ:TASK:INDEX` (the runtime's `_OUTPUT_ID`), and how
# many keys' ids `holds_outputs_where` reads per round trip.
_ID_TAIL = ":[0-9]+:[^:]*:[0-9]+$"
_KEYS_BATCH = 10_000
_RETRY = 1.0  # seconds between attempts while the database cannot be read (--follow)
# How long next_record waits for a read in the source's thread before it answers "nothing
# now": the engine runs on the calling thread, and must see a stop while the database hangs.
_READ_WAIT = 0.5


def _require(flag: str, uri: str) -> None:
    if _IMPORT_ERROR is not None:
        raise missing_extra(flag, uri, "postgres", "psycopg", _IMPORT_ERROR)


def _split(uri: str, flag: str, known: frozenset[str]) -> tuple[str, dict[str, str], list[str]]:
    """(libpq connection URI without ratchet's parameters, ratchet's parameters, table name
    parts). libpq's own parameters (sslmode=...) stay in the connection URI."""
    params = dict(parse_qsl(urlsplit(uri).query, keep_blank_values=True))
    ours = {k: v for k, v in params.items() if k in known}
    table = ours.get("table", "")
    parts = table.split(".")
    if not table or len(parts) > 2 or not all(parts):
        raise ConfigError(
            f"{flag} {redact(uri)}: name the table with ?table=NAME (or ?table=SCHEMA.NAME)"
        )
    rest = urlencode({k: v for k, v in params.items() if k not in known})
    conninfo = urlunsplit(urlsplit(uri)._replace(query=rest))
    try:
        conninfo_to_dict(conninfo)  # libpq's parameters (sslmode=...) are checked here
    except psycopg.ProgrammingError as exc:
        raise ConfigError(
            f"{flag} {redact(uri)}: {str(exc).strip()}; ratchet's parameters are "
            f"{', '.join(sorted(known))}, the others go to libpq"
        ) from exc
    return conninfo, ours, parts


def connect_timeout_of(conninfo: str, flag: str, uri: str) -> int:
    """The URI's `connect_timeout`, or ratchet's default: never libpq's "0 = wait forever"."""
    value = conninfo_to_dict(conninfo).get("connect_timeout")
    if value is None:
        return _CONNECT_TIMEOUT
    try:
        seconds = int(str(value))
    except ValueError:
        seconds = 0
    if seconds < 2:
        raise ConfigError(
            f"{flag} {redact(uri)}: connect_timeout is a whole number of seconds, at least 2 "
            f"(libpq's minimum; default {_CONNECT_TIMEOUT})"
        )
    return seconds


def address_of(conninfo: str) -> str:
    """HOST:PORT of a connection string, for messages (libpq's defaults when not given)."""
    params = conninfo_to_dict(conninfo)
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    return f"{host}:{params.get('port') or 5432}"


def _one_line(exc: BaseException) -> str:
    """libpq's message on one line (it puts a hint on a second, tab-indented)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _connect(conninfo: str, flag: str, uri: str, timeout: int) -> psycopg.Connection[Any]:
    """A connection, or why not: a server that cannot be reached (nothing listens, its name
    does not resolve, no answer within `timeout`, starting up or shutting down) is a
    ServerUnreachableError, which a supervised job waits out; one that answered no (a wrong
    password, a role or database that does not exist, SSL required of a server without it) a
    ConfigError."""
    address = address_of(conninfo)
    for attempt in (1, 2):
        try:
            return psycopg.connect(conninfo, autocommit=True, connect_timeout=timeout)
        except psycopg.errors.ConnectionTimeout as exc:
            raise ServerUnreachableError(
                f"{flag} {redact(uri)}: PostgreSQL at {address} did not answer within "
                f"{timeout} s (connect_timeout); check that the server is up and reachable, or "
                f"give it longer with &connect_timeout=SECONDS",
                server="PostgreSQL",
                address=address,
            ) from exc
        except psycopg.Error as exc:
            why = _why_not(conninfo, timeout)
            if why is _UNREACHABLE:
                raise ServerUnreachableError(
                    f"{flag} {redact(uri)}: cannot reach PostgreSQL at {address}: {_one_line(exc)}",
                    server="PostgreSQL",
                    address=address,
                ) from exc
            if why is not None:
                raise _settings_refused(f"{flag} {redact(uri)}", address, why, exc) from exc
            if attempt == 2:
                raise ConfigError(
                    f"{flag} {redact(uri)}: cannot connect to PostgreSQL: {_one_line(exc)}"
                ) from exc
            # It takes connections now: it may have come up since this attempt failed (its
            # "connection refused" is not a no). Ask once more; a second refusal is its answer.
    raise AssertionError("not reached: the second attempt returns or raises")  # pragma: no cover


def _answers(conninfo: str, timeout: int) -> bool:
    """Whether a server takes connections at `conninfo` (libpq's PQping): True also when it
    would refuse these credentials or this database; False when nothing answered (refused,
    no answer in time, a name that does not resolve) or it is starting up, shutting down or
    recovering. Locale-proof: libpq decides by what happened, not by a message's words."""
    from psycopg import pq

    return _ping(conninfo, timeout) not in (pq.Ping.NO_RESPONSE, pq.Ping.REJECT)


def _ping(conninfo: str, timeout: int) -> Any:
    from psycopg import pq
    from psycopg.conninfo import make_conninfo

    return pq.PGconn.ping(make_conninfo(conninfo, connect_timeout=timeout).encode())


# What _why_not says of a server that cannot be reached (else: None, or the settings refused).
_UNREACHABLE = "unreachable"
_SSL_REQUIRING = ("require", "verify-ca", "verify-full")


def _demands(conninfo: str) -> list[str]:
    """The connection's settings that a server answering without them refuses before it asks
    for a password (so PQping reports no answer): SSL or GSSAPI encryption required, from the
    URI or libpq's environment variables."""
    params = conninfo_to_dict(conninfo)
    said = []
    for name, env, requiring in (
        ("sslmode", "PGSSLMODE", _SSL_REQUIRING),
        ("gssencmode", "PGGSSENCMODE", ("require",)),
        ("sslrootcert", "PGSSLROOTCERT", ("system",)),  # implies sslmode=verify-full
        ("sslnegotiation", "PGSSLNEGOTIATION", ("direct",)),  # SSL at once, or nothing
    ):
        value = params.get(name)
        source = f"{name}={value}"
        if value is None and os.environ.get(env):
            value = os.environ[env]
            source = f"{name}={value} (from {env})"
        if str(value) in requiring:
            said.append(source)
    return said


def _why_not(conninfo: str, timeout: int) -> str | None:
    """After a failed connect: _UNREACHABLE when no server answered at `conninfo`; the
    settings it refused (`sslmode=require`) when one answers without them; None when it
    answers these (so it refused something else: credentials, a database). A server that
    lacks SSL answers sslmode=require's first message with "no", which PQping counts as no
    answer: asked first without those settings, it tells a server that is down (still no
    answer: one wait, not two) from one that said no."""
    from psycopg import pq
    from psycopg.conninfo import make_conninfo

    demands = _demands(conninfo)
    if demands:
        # Without the demands and the settings that only go with them (sslrootcert=system
        # forbids a weaker sslmode; sslnegotiation=direct needs a requiring one). Left out,
        # not given None (make_conninfo ignores such a kwarg: the key stays); sslrootcert="" so
        # PGSSLROOTCERT does not bring "system" back.
        params = conninfo_to_dict(conninfo)
        params.pop("sslnegotiation", None)
        params.update(sslmode="prefer", gssencmode="prefer", sslrootcert="")
        ping = _ping(make_conninfo("", **params), timeout)
        if ping in (pq.Ping.NO_RESPONSE, pq.Ping.REJECT):
            return _UNREACHABLE
        if ping == pq.Ping.OK:
            return ", ".join(demands) if not _answers(conninfo, timeout) else None
    return None if _answers(conninfo, timeout) else _UNREACHABLE


def _settings_refused(where: str, address: str, settings: str, exc: psycopg.Error) -> ConfigError:
    """A server that answers, but not a connection with `settings`: not an outage."""
    return ConfigError(
        f"{where}: PostgreSQL at {address} answers, but refused the connection with {settings}: "
        f"{_one_line(exc)}; enable that on the server, or connect with a setting it supports "
        f"(e.g. sslmode=prefer)"
    )


def _checks_hung(where: str, conninfo: str, timeout: int, doing: str) -> ServerUnreachableError:
    """The checks at start got no answer within connect_timeout (their connection was cut)."""
    return ServerUnreachableError(
        f"{where}: PostgreSQL at {address_of(conninfo)} did not answer within {timeout} s "
        f"(connect_timeout) {doing}: another session may hold a lock on the table (an ALTER "
        f"TABLE, a LOCK TABLE; see pg_locks), or the server hangs; end that, or give it longer "
        f"with &connect_timeout=SECONDS",
        server="PostgreSQL",
        address=address_of(conninfo),
    )


def _lost(where: str, conninfo: str, exc: psycopg.Error, doing: str) -> ServerUnreachableError:
    """The connection went away during the checks at start (the server shut down or
    restarted): not the database's answer to them."""
    said = str(exc).strip().splitlines()  # its first line: not the statement it cut
    return ServerUnreachableError(
        f"{where}: lost the connection to PostgreSQL at {address_of(conninfo)} {doing}: "
        f"{said[0] if said else type(exc).__name__}",
        server="PostgreSQL",
        address=address_of(conninfo),
    )


def _check_failed(
    where: str,
    conninfo: str,
    timeout: int,
    exc: psycopg.Error,
    *,
    cut: bool,
    broken: bool,
    doing: str,
    refused: str,
) -> ConfigError:
    """What a check at start that failed says: no answer in time or a connection lost is the
    server's absence (a supervised job waits for it), anything else the database's refusal."""
    if cut:
        return _checks_hung(where, conninfo, timeout, f"while {doing}")
    if broken:
        return _lost(where, conninfo, exc, f"while {doing}")
    return _refused(where, exc, refused)


def _regclass(conn: psycopg.Connection[Any], parts: list[str]) -> str:
    """The table's name as to_regclass reads it: quoted, so that `Res` or `my-t` is that exact
    table (unquoted, PostgreSQL folds it to lower case or cannot parse it)."""
    return sql.Identifier(*parts).as_string(conn)


def _refused(where: str, exc: psycopg.Error, doing: str) -> ConfigError:
    """A database's refusal of what the job needs (a privilege, a schema) as one line."""
    fix = {
        "42501": "grant the user that privilege, or connect as one who has it",
        "3F000": "create the schema first, or name a table in an existing one",
    }.get(exc.sqlstate or "", "fix that in the database, or name another table")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(f"{where}: PostgreSQL refused {doing}: {first}; {fix}")


def _columns(conn: psycopg.Connection[Any], parts: list[str]) -> dict[str, str] | None:
    """The table's columns and their types, or None if there is no such table."""
    row = conn.execute("SELECT to_regclass(%s)::oid", (_regclass(conn, parts),)).fetchone()
    if row is None or row[0] is None:
        return None
    rows = conn.execute(
        "SELECT attname, format_type(atttypid, NULL) FROM pg_attribute "
        "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (row[0],),
    ).fetchall()
    return {str(n): str(t) for n, t in rows}


def _primary_key(conn: psycopg.Connection[Any], parts: list[str]) -> list[str]:
    rows = conn.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
        "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = to_regclass(%s) AND i.indisprimary",
        (_regclass(conn, parts),),
    ).fetchall()
    return sorted(str(r[0]) for r in rows)


def _has_nul(value: Any) -> bool:
    """Whether a NUL character is in any string of `value` (keys too). Searching the JSON line
    for `\\u0000` would also find the harmless text backslash-u0000, written `\\\\u0000`."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple | set | frozenset):
        return any(_has_nul(v) for v in value)
    return False


def _shape(columns: dict[str, str]) -> str:
    return ", ".join(f"{n} {t}" for n, t in columns.items())


class _Deadline:
    """Ends a statement (a write, the checks at start) the server does not answer within
    `seconds`: shutting the connection's socket down makes the blocked libpq call return with
    an error in the calling thread (closing the connection from the timer's thread, under that
    call, is not safe). The lock keeps the cut and the statement's end apart: one that ended
    is never cut, and the socket cut is the connection's while it runs (its descriptor cannot
    be closed and reused meanwhile)."""

    def __init__(self, conn: psycopg.Connection[Any], seconds: float) -> None:
        self.conn = conn
        self.cut = False
        self._done = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()

    def _cut(self) -> None:
        with self._lock:
            if self._done:
                return
            self.cut = True
            try:
                sock = socket.socket(fileno=os.dup(self.conn.fileno()))
            except (OSError, psycopg.Error):
                return
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                sock.close()


class PostgresSink(Sink):
    """Outputs as rows of a table keyed by output id, each written once (see module doc)."""

    def __init__(
        self,
        uri: str,
        conninfo: str,
        table: list[str],
        write_timeout: float = _WRITE_TIMEOUT,
        connect_timeout: int = _CONNECT_TIMEOUT,
    ) -> None:
        self.uri = uri
        self.conninfo = conninfo
        self.table = table
        self.write_timeout = write_timeout
        self.connect_timeout = connect_timeout
        self.ident = sql.Identifier(*table)
        self._conn: psycopg.Connection[Any] | None = None
        self._job: str | None = None

    @classmethod
    def from_uri(cls, uri: str) -> PostgresSink:
        _require("--output", uri)
        conninfo, params, table = _split(uri, "--output", _SINK_PARAMS)
        try:
            timeout = float(params.get("write_timeout", _WRITE_TIMEOUT))
        except ValueError:
            timeout = math.nan
        if not math.isfinite(timeout) or timeout <= 0:
            raise ConfigError(
                f"--output {redact(uri)}: write_timeout is a number of seconds > 0 "
                f"(default {_WRITE_TIMEOUT:g})"
            )
        return cls(uri, conninfo, table, timeout, connect_timeout_of(conninfo, "--output", uri))

    @property
    def where(self) -> str:
        return f"--output {redact(self.uri)} (table {'.'.join(self.table)})"

    def open(self, job: JobIdentity | None) -> None:
        if self._conn is not None:
            return
        self._job = job.id if job is not None else None
        conn = _connect(self.conninfo, "--output", self.uri, self.connect_timeout)
        watch = _Deadline(conn, self.connect_timeout)
        try:
            with watch:
                self._prepare(conn)
        except psycopg.Error as exc:
            broken = conn.broken
            conn.close()
            raise _check_failed(
                self.where, self.conninfo, self.connect_timeout, exc, cut=watch.cut,
                broken=broken, doing="preparing the output table",
                refused="to prepare the output table",
            ) from exc  # fmt: skip
        except BaseException:
            conn.close()
            raise
        if watch.cut:  # cut as the checks ended: they passed, the connection is gone
            conn.close()
            raise _checks_hung(
                self.where, self.conninfo, self.connect_timeout, "while preparing the output table"
            )
        self._conn = conn

    def _prepare(self, conn: psycopg.Connection[Any]) -> None:
        columns = _columns(conn, self.table)
        if columns is None:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (id text PRIMARY KEY, job text NOT NULL, "
                    "key text, seq bigint, task text, record jsonb NOT NULL, "
                    "written_at timestamptz NOT NULL DEFAULT now())"
                ).format(self.ident)
            )
            log.info("created the output table %s", ".".join(self.table))
            return
        wrong = {n: t for n, t in OUTPUT_COLUMNS.items() if columns.get(n) != t}
        pk = _primary_key(conn, self.table)
        if wrong or pk != ["id"]:
            raise ConfigError(
                f"{self.where} exists with another shape: it has the columns "
                f"({_shape(columns)}) and primary key ({', '.join(pk) or 'none'}); an output "
                f"table needs the columns ({_shape(OUTPUT_COLUMNS)}) with primary key (id). "
                f"Name a new table (it is created), or drop this one"
            )
        if self._job is not None:
            other = conn.execute(
                sql.SQL("SELECT job FROM {} WHERE job <> %s LIMIT 1").format(self.ident),
                (self._job,),
            ).fetchone()
            if other is not None:
                raise ConfigError(
                    f"{self.where} holds outputs of job {other[0]}, and this state directory is "
                    f"job {self._job}: a new job repeats the earlier one's output ids, so its "
                    f"outputs would be taken for duplicates. Write to a new table, or pass that "
                    f"job's --state directory to resume it"
                )

    def holds_outputs_of(self, job: JobIdentity) -> bool | None:
        if self._conn is None:
            return None
        watch = _Deadline(self._conn, self.connect_timeout)  # asked at start, like open's checks
        try:
            with watch:
                row = self._conn.execute(
                    sql.SQL("SELECT 1 FROM {} WHERE job = %s LIMIT 1").format(self.ident),
                    (job.id,),
                ).fetchone()
        except psycopg.Error as exc:
            broken = self._conn.broken
            if watch.cut or broken:
                self._conn.close()
            raise _check_failed(
                self.where, self.conninfo, self.connect_timeout, exc, cut=watch.cut,
                broken=broken, doing="reading the output table",
                refused="to read the output table",
            ) from exc  # fmt: skip
        return row is not None

    def holds_outputs_where(self, job: JobIdentity, keep: Callable[[str], bool]) -> bool | None:
        """Whether the table holds an output of `job` whose id `keep` accepts (a sharded job
        asks it of one shard's keys). The database groups the job's rows by the key of their
        id (an id is `KEY:SEQ:TASK:INDEX`: the key is what comes before its last three parts)
        and sends one id per key, read by a server-side cursor in batches, so what comes back
        is a row per key, not per output, and the reading stops at the first id kept."""
        if self._conn is None:
            return None
        conn = self._conn
        query = sql.SQL(
            "SELECT min(id) FROM {} WHERE job = %s GROUP BY regexp_replace(id, %s, '')"
        ).format(self.ident)
        doing = "reading the ids of the output table (a table of many outputs takes longer)"
        watch = _Deadline(conn, self.connect_timeout)
        try:
            with conn.transaction(), conn.cursor(name="ratchet_outputs_by_key") as cur:
                with watch:
                    cur.execute(query, (job.id, _ID_TAIL))
                while True:
                    watch = _Deadline(conn, self.connect_timeout)  # each batch, like a check
                    with watch:
                        ids = cur.fetchmany(_KEYS_BATCH)
                    if not ids:
                        return False
                    if any(keep(str(row[0])) for row in ids):
                        return True
        except psycopg.Error as exc:
            broken = conn.broken
            if watch.cut or broken:
                conn.close()
            raise _check_failed(
                self.where, self.conninfo, self.connect_timeout, exc, cut=watch.cut,
                broken=broken, doing=doing, refused="to read the output table",
            ) from exc  # fmt: skip

    def describe(self) -> str:
        return self.where

    def validate(self, record: dict[str, Any]) -> str | None:
        try:
            to_json_line(record)
        except Exception as exc:  # noqa: BLE001 - whatever fails is the reason
            return f"it cannot be written as JSON: {type(exc).__name__}: {exc}"
        if _has_nul(record):
            return "it holds a NUL character (\\u0000), which PostgreSQL jsonb cannot store"
        return None

    def write(self, records: list[dict[str, Any]]) -> int:
        if self._conn is None:
            self.open(None)  # used without a Job (a Sink built by hand): not bound to one
        elif self._conn.closed:  # after a lost connection
            # No longer than a write may take: a stop waits for this release.
            wait = min(self.connect_timeout, max(2, math.ceil(self.write_timeout)))
            self._conn = _connect(self.conninfo, "--output", self.uri, wait)
        assert self._conn is not None
        rows = [
            (
                r["id"],
                self._job or "",
                None if r.get("key") is None else str(r.get("key")),
                r.get("seq"),
                r.get("task"),
                to_json_line(r),
            )
            for r in records
        ]
        stmt = sql.SQL(
            "INSERT INTO {} (id, job, key, seq, task, record) VALUES (%s, %s, %s, %s, %s, "
            "%s::jsonb) ON CONFLICT (id) DO NOTHING"
        ).format(self.ident)
        conn = self._conn
        watch = _Deadline(conn, self.write_timeout)
        try:
            with watch, conn.transaction(), conn.cursor() as cur:
                cur.executemany(stmt, rows)
                # Rows inserted, over every statement: an id the table holds is not one.
                inserted = cur.rowcount
        except psycopg.OperationalError as exc:
            conn.close()  # reconnected at the next release
            if watch.cut:
                raise psycopg.OperationalError(
                    f"PostgreSQL did not answer a write of {len(rows)} output(s) within "
                    f"{self.write_timeout:g} s (write_timeout); the connection was cut"
                ) from exc
            raise
        if watch.cut:  # cut as it committed: the rows are written, the connection is not usable
            conn.close()
        return max(inserted, 0)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class PostgresSource(Source):
    """Rows of a table in order of an increasing integer id (see module doc)."""

    def __init__(
        self,
        uri: str,
        conninfo: str,
        table: list[str],
        *,
        key_field: str = "key",
        follow: bool = False,
        id_column: str = "id",
        poll: float = 0.5,
        clock: Clock = SYSTEM_CLOCK,
        connect_timeout: int = _CONNECT_TIMEOUT,
    ) -> None:
        self.uri = uri
        self.conninfo = conninfo
        self.table = table
        self.connect_timeout = connect_timeout
        self.key_field = key_field
        self._follow = follow
        self.id_column = id_column
        self.poll = poll
        self.clock = clock
        self._conn: psycopg.Connection[Any] | None = None
        self._after: int = 0
        self._buffer: list[tuple[int, str]] = []
        self._next = 0
        self._before = 0
        self._polled_at: float | None = None
        self._retry_at = 0.0  # after a failed read with --follow: not before this
        self._reader: threading.Thread | None = None  # a read under way, in its own thread
        self._read_done = threading.Event()
        self._read: list[tuple[int, str]] | BaseException = []
        self._database: str | None = None
        self._query = sql.SQL(
            "SELECT {id}, row_to_json(t)::text FROM {table} AS t WHERE {id} > %s "
            "ORDER BY {id} LIMIT %s"
        ).format(id=sql.Identifier(id_column), table=sql.Identifier(*table))

    @classmethod
    def from_uri(cls, uri: str, *, key_field: str, follow: bool) -> PostgresSource:
        _require("--input", uri)
        conninfo, params, table = _split(uri, "--input", _SOURCE_PARAMS)
        try:
            poll = float(params.get("poll", 0.5))
        except ValueError as exc:
            raise ConfigError(f"--input {redact(uri)}: poll is in seconds, a number") from exc
        if not math.isfinite(poll) or poll < 0:
            raise ConfigError(f"--input {redact(uri)}: poll must be a number of seconds >= 0")
        return cls(
            uri, conninfo, table, key_field=key_field, follow=follow,
            id_column=params.get("id_column") or "id", poll=poll,
            connect_timeout=connect_timeout_of(conninfo, "--input", uri),
        )  # fmt: skip

    @property
    def follow(self) -> bool:  # type: ignore[override]
        # Without --follow the input ends once a read comes back empty; while one is under
        # way, "nothing now" means "ask again".
        return self._follow or self._reader is not None

    @property
    def where(self) -> str:
        return f"--input {redact(self.uri)} (table {'.'.join(self.table)})"

    def open(self, job: JobIdentity | None, *, checkpoint_interval: float) -> None:
        conn = _connect(self.conninfo, "--input", self.uri, self.connect_timeout)
        watch = _Deadline(conn, self.connect_timeout)
        try:
            with watch:
                self._check(conn)
        except psycopg.Error as exc:  # no SELECT privilege, say: found now, not at first read
            broken = conn.broken
            conn.close()
            raise _check_failed(
                self.where, self.conninfo, self.connect_timeout, exc, cut=watch.cut,
                broken=broken, doing="checking the table", refused="to read the table",
            ) from exc  # fmt: skip
        except BaseException:
            conn.close()
            raise
        if watch.cut:  # cut as the checks ended: they passed, the connection is gone
            conn.close()
            raise _checks_hung(
                self.where, self.conninfo, self.connect_timeout, "while checking the table"
            )
        self._conn = conn
        self._database = conn.info.dbname

    def _check(self, conn: psycopg.Connection[Any]) -> None:
        """The table exists, has an integer id column, and this user may read it."""
        columns = _columns(conn, self.table)
        if columns is None:
            raise ConfigError(f"{self.where} does not exist")
        kind = columns.get(self.id_column)
        if kind not in _INTEGER_TYPES:
            raise ConfigError(
                f"{self.where} has no integer column {self.id_column!r} to read it in order "
                f"by (its columns: {_shape(columns)}); pass ?id_column=NAME naming an "
                f"increasing smallint, integer or bigint column"
            )
        conn.execute(sql.SQL("SELECT 1 FROM {} LIMIT 0").format(sql.Identifier(*self.table)))

    def restore(self, position: dict[str, Any]) -> None:
        if not position:
            return
        table = ".".join(self.table)
        if position.get("table") != table or position.get("id_column") != self.id_column:
            raise ConfigError(
                f"this state directory read its inputs {_kind_of(position)} by "
                f"{position.get('id_column')!r}, not from the PostgreSQL table {table} by "
                f"{self.id_column!r}; pass the same --input as before, or use a new --state"
                if "after" in position
                else f"this state directory read its inputs {_kind_of(position)}, not from the "
                f"PostgreSQL table {table}; pass the same --input as before, or use a new --state"
            )
        was = position.get("database")
        if was is not None and self._database is not None and was != self._database:
            raise ConfigError(
                f"this state directory read table {table} of the database {was!r}, not of "
                f"{self._database!r}; pass the same --input as before, or use a new --state"
            )
        self._after = int(position["after"])

    def position(self) -> dict[str, Any]:
        return {
            "database": self._database,
            "table": ".".join(self.table),
            "id_column": self.id_column,
            "after": self._after,
        }

    def next_record(self) -> Record | None:
        if self._next >= len(self._buffer):
            if self._reader is None:
                now = self.clock.monotonic()
                if (
                    self._follow
                    and self._polled_at is not None
                    and now - self._polled_at < self.poll
                ):
                    return None
                if now < self._retry_at:
                    return None
                self._polled_at = now
                self._read_done.clear()
                self._reader = threading.Thread(
                    target=self._read_rows, name="ratchet-postgres-source", daemon=True
                )
                self._reader.start()
            if not self._read_done.wait(_READ_WAIT):
                return None  # the database is slow or hangs: the engine may stop meanwhile
            self._reader, read = None, self._read
            if isinstance(read, BaseException):
                raise read
            self._buffer, self._next = read, 0
            if not self._buffer:
                return None
            self._polled_at = None  # rows came: read on without waiting
        row_id, text = self._buffer[self._next]
        self._next += 1
        self._before, self._after = self._after, row_id
        where = f"{'.'.join(self.table)} row {self.id_column}={row_id}"
        try:
            value = json.loads(text)  # the database checked it is JSON
        except RecursionError:
            error = f"{where}: invalid JSON (arrays or objects nested too deeply to read)"
            return Record(row_id, error=error, raw=text[:65536])
        except ValueError as exc:  # an integer over Python's 4,300 digits
            error = f"{where}: invalid JSON ({exc})"
            return Record(row_id, error=error, raw=text[:65536])
        key, err = _key_and_depth(value, self.key_field, where)
        if err is not None:
            return Record(row_id, error=err, raw=text)
        return Record(row_id, key=key, value=value)

    def _read_rows(self) -> None:
        """The source's thread: one read, its rows or its error left for next_record."""
        try:
            self._read = self._fetch()
        except BaseException as exc:  # noqa: BLE001 - raised again by next_record
            self._read = exc
        self._read_done.set()

    def _fetch(self) -> list[tuple[int, str]]:
        for attempt in (1, 2):
            try:
                return self._fetch_once()
            except psycopg.OperationalError as exc:
                if self._conn is not None:
                    self._conn.close()
                if self._follow:
                    log.warning("%s: reading failed, will retry: %s", self.where, exc)
                    self._retry_at = self.clock.monotonic() + _RETRY  # not at every poll
                    return []
                # Without --follow a failed read ends the job. The server's absence (it shut
                # down or restarts) is not the database's answer: a supervised job waits for
                # it and resumes from its last checkpoint, as at start.
                why = _why_not(self.conninfo, self.connect_timeout)
                address = address_of(self.conninfo)
                if why is _UNREACHABLE:
                    raise ServerUnreachableError(
                        f"{self.where}: lost PostgreSQL at {address} while reading: "
                        f"{_one_line(exc)}; the next start resumes from the last checkpoint",
                        server="PostgreSQL",
                        address=address,
                    ) from exc
                if why is not None:
                    raise _settings_refused(self.where, address, why, exc) from exc
                if attempt == 2:
                    raise ConfigError(
                        f"{self.where}: reading failed ({_one_line(exc)}); everything read "
                        f"before is checkpointed: run again to resume"
                    ) from exc
                # It answers now (a restart that was quick, or a connection ended by
                # pg_terminate_backend): read once more, on a new connection.
            except psycopg.Error as exc:  # a privilege revoked mid-run, say: retrying cannot help
                raise _refused(self.where, exc, "to read the table") from exc
        raise AssertionError("not reached: the second read returns or raises")  # pragma: no cover

    def _fetch_once(self) -> list[tuple[int, str]]:
        if self._conn is None or self._conn.closed:
            # Not _connect: a failed reconnect (the database restarting) is retried with
            # --follow like a failed read, and told apart by _fetch without it.
            self._conn = psycopg.connect(
                self.conninfo, autocommit=True, connect_timeout=self.connect_timeout
            )
        rows = self._conn.execute(self._query, (self._after, _READ_BATCH)).fetchall()
        return [(int(i), str(t)) for i, t in rows]

    def unread(self) -> None:
        if self._next > 0:
            self._next -= 1
            self._after = self._before

    def close(self) -> None:
        if self._reader is not None and not self._read_done.is_set():
            # A read hangs (the database stopped answering): leave its connection to that
            # daemon thread; closing it under the query could block this thread too.
            log.warning("%s: a read still waits for the database; not waiting for it", self.where)
            self._conn = None
            return
        if self._conn is not None:
            self._conn.close()
            self._conn = None
