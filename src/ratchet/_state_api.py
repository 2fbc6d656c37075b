"""`ratchet.open_state(dir)`: read a job's state directory from Python, safely while it runs.

Read-only by construction: SQLite is opened with `mode=ro` (as `SqliteStore.open_readonly`), the
state lock (`ratchet.lock`) is never taken and nothing is written, so a running job is not
disturbed. Each method reads in one read
transaction: what it returns is one consistent moment of the state (in WAL mode a reader never
blocks the job's writer, nor the writer it).

Every method returns plain data (dicts and lists of JSON-like values), the same shapes the
CLI's `--json` output prints (`ratchet status`, `inspect`, `runs list`, `dead-letters`,
`trace`, `checkpoints`); docs/api.md lists them. A state that does not exist, or is not a
ratchet state, raises `ratchet.StateError` naming the path.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from ratchet._errors import (
    CodecError,
    CorruptDataError,
    RatchetError,
    StateError,
)
from ratchet.store import codec
from ratchet.store._sqlite import (
    _KEY_IS_STR,
    DB_NAME,
    SqliteStore,
    signals_typed,
    traces_typed,
)
from ratchet.store._traces import unpack_trace

__all__ = ["State", "open_state"]

_T = TypeVar("_T")


# What to do about a stored value that no longer decodes (the file was damaged, or altered
# outside ratchet): said by `State`, `ratchet inspect` and `ratchet trace` alike.
DAMAGED_FIX = (
    "the state is damaged: restore it from a backup or a savepoint (`ratchet run AGENT "
    "--state NEW --from-savepoint FILE`), or point --state at a new directory"
)


def undecodable_memory(db: Path, key: str, exc: BaseException) -> StateError:
    """The error for a key whose committed memory does not decode."""
    return StateError(f"{db}: the memory of key {key!r} cannot be decoded ({exc}); {DAMAGED_FIX}")


def undecodable_trace(db: Path, key: str, seq: int, exc: BaseException) -> StateError:
    """The error for a kept trace that does not decode."""
    return StateError(
        f"{db}: the trace of key {key!r}, input {seq}, cannot be decoded ({exc}); {DAMAGED_FIX}"
    )


def read_traces(
    store: SqliteStore, key_text: str, seq: int | None = None, key_type: str | None = None
) -> tuple[list[dict[str, Any]], list[tuple[int, Exception]]]:
    """`store.traces(key_text, seq, key_type)`, and apart the (seq, error) of each trace that
    does not decode: one damaged row must not hide the others, and the error names its seq."""
    try:
        return store.traces(key_text, seq, key_type), []
    except (CodecError, CorruptDataError, TypeError, ValueError):
        pass  # read them one by one to find the damaged ones (rare: only then)
    sql = "SELECT seq FROM traces WHERE key_text = ?" + (" AND seq = ?" if seq is not None else "")
    params: list[Any] = [key_text] if seq is None else [key_text, seq]
    if key_type is not None and traces_typed(store.conn):
        sql += " AND (key_type = ? OR key_type IS NULL)"
        params.append(key_type)
    good: list[dict[str, Any]] = []
    bad: list[tuple[int, Exception]] = []
    for (s,) in store.conn.execute(sql + " ORDER BY seq DESC", params).fetchall():
        try:
            good += store.traces(key_text, int(s), key_type)
        except (CodecError, CorruptDataError, TypeError, ValueError) as exc:
            bad.append((int(s), exc))
    return good, bad


def trace_key_type(
    text: str,
    key_type: str,
    seq: int | None,
    held: Callable[[], set[str]],
    where: Path | str,
) -> str | None:
    """Which of the two keys of a text like "1" to show the traces of: 'str' or 'int' as
    asked; for "auto", the one the state holds (`held()` gives the types it holds). None:
    every trace of the text (with `seq`, which names one run; or when the state holds neither
    key, so any trace there is one kept before types were, of either). A state holding both
    is refused: showing both keys' runs as one key's was the defect this prevents."""
    from ratchet.runtime._shards import chosen_key_type

    return chosen_key_type(
        text,
        key_type,
        (lambda: set()) if seq is not None else held,  # an input seq names one run
        where,
        "say whose traces to show (--key-type str or --key-type int; REST: ?key_type=str or "
        "int; from Python: state.traces(key, key_type='str') or pass the key as an int)",
    )


def memory_key_type(
    text: str, key_type: str, held: Callable[[], set[str]], where: Path | str
) -> str | None:
    """Which of the two keys of a text like "1" to show the memory of: 'str' or 'int' as
    asked; for "auto", the one the state holds (`held()` gives the types it holds), None when
    it holds neither. A state holding both is refused, as `trace_key_type` refuses it:
    `ratchet inspect --key 1` showed both keys' memories as the one key asked for."""
    from ratchet.runtime._shards import chosen_key_type

    return chosen_key_type(
        text,
        key_type,
        held,
        where,
        "say whose memory to show (--key-type str or --key-type int; REST: ?key_type=str or "
        "int; from Python: state.memory(key, key_type='str') or pass the key as an int)",
    )


def _asked_type(key: str | int, key_type: str | None) -> str:
    """What `State.traces` was asked for: an int key says it is the integer key; a str key
    may be the text of either (as `keys()` and `recent_runs()` give keys)."""
    if key_type is not None:
        return key_type
    return "int" if isinstance(key, int) and not isinstance(key, bool) else "auto"


def open_state(state_dir: str | os.PathLike[str]) -> State:
    """Open the state directory of a job (the `--state DIR` of `ratchet run`) for reading.

    Use it as a context manager, or call `close()`:

        with ratchet.open_state("state") as state:
            print(state.summary()["keys"], state.keys())

    Raises `ratchet.StateError` (naming the path) if there is no ratchet state there, or the
    database is not one (or was written by a newer ratchet).

    A job sharded over N workers (`--workers N`) is read as one: the same methods, answering
    over every shard (each shard read in its own transaction, one after the other)."""
    sdir = Path(state_dir)
    if not sdir.exists():
        raise StateError(f"no ratchet state in {sdir} (the directory does not exist)")
    if not sdir.is_dir():
        raise StateError(f"no ratchet state in {sdir} (it is not a directory)")
    from ratchet.runtime._shards import is_sharded, read_layout

    if is_sharded(sdir):
        layout = read_layout(sdir)
        shards = [
            State(d, _open_readonly(d / DB_NAME)) for d in layout.dirs if (d / DB_NAME).is_file()
        ]
        if not shards:
            raise StateError(f"no ratchet state in {sdir}: none of its shards has a database")
        return ShardedState(sdir, shards, layout.workers)
    if not (sdir / DB_NAME).is_file():
        raise StateError(
            f"no ratchet state in {sdir} ({sdir / DB_NAME} does not exist); pass the --state "
            f"directory of a job that has run"
        )
    return State(sdir, _open_readonly(sdir / DB_NAME))


def _open_readonly(db: Path) -> SqliteStore:
    """`SqliteStore.open_readonly` of the directory holding `db` (its URI escapes the path: a
    `?`, `#` or `%` in a directory name would otherwise end it early)."""
    return SqliteStore.open_readonly(db.parent)


class State:
    """A read-only view of one state directory (from `ratchet.open_state`).

    Use it from the thread that opened it. After `close()` every method raises StateError."""

    def __init__(self, state_dir: Path, store: SqliteStore) -> None:
        self._dir = state_dir
        self._store: SqliteStore | None = store

    # -- lifetime ---------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        """The state directory."""
        return self._dir

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._store is None

    def close(self) -> None:
        """Close the database connection (idempotent)."""
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> State:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ratchet.State {str(self._dir)!r}{' closed' if self.closed else ''}>"

    # -- reading ----------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """What `ratchet status --json` prints: agent, actions, checkpoint statistics, counts
        (keys, in_flight_runs, queued_inputs, unreleased_outputs, dead_letters, runs_failed,
        runs_on_earlier_versions), memory_version, source position, waiting runs, paused
        resources, pending signals and upgrades."""
        return self._read(lambda s: _shown(s.summary(), False))

    def keys(self, contains: str | None = None, limit: int | None = None) -> list[str]:
        """The keys that have committed memory, as text (as `ratchet inspect` shows them), in
        order; only those whose text contains `contains` (case-insensitive), at most `limit`."""
        return [text for text, _type in self._typed_keys(contains, limit)]

    def _typed_keys(
        self, contains: str | None = None, limit: int | None = None
    ) -> list[tuple[str, str]]:
        """`keys()` with each key's type, 'str' or 'int' (the string key "1" and the integer
        key 1 are two keys of one text), ordered by text and then type: what the REST API's
        /v1/keys lists, so the dashboard can ask for each of the two."""
        where, params = _key_search(contains)
        kind = f"CASE WHEN {_KEY_IS_STR} THEN 'str' ELSE 'int' END"
        sql = f"SELECT key_text, {kind} AS kind FROM keys{where} ORDER BY key_text, kind"
        if limit is not None:
            sql += f" LIMIT {max(0, int(limit))}"
        return self._read(
            lambda s: [(str(text), str(kind)) for text, kind in s.conn.execute(sql, params)]
        )

    def count_keys(self, contains: str | None = None) -> int:
        """How many keys `keys(contains)` would list with no limit."""
        where, params = _key_search(contains)
        sql = f"SELECT COUNT(*) FROM keys{where}"
        return self._read(lambda s: int(s.conn.execute(sql, params).fetchone()[0]))

    def memory(
        self, key: str | int, *, as_json: bool = False, key_type: str | None = None
    ) -> dict[str, Any] | None:
        """The committed short-term memory of `key` as a nested dict; None for a key with no
        committed memory.

        The string key "1" and the integer key 1 are two keys: without `key_type`, the one of
        `key`'s own type, else the only one of its text there is. `key_type` 'str' or 'int'
        reads that one only; 'auto' the one of the text the state holds, and a state holding
        both raises `ratchet.InvalidArgumentError` until you say which (as `traces`).

        Values of types this process registered (`ratchet.register_type`, ratchet's own chat
        types, pydantic models and dataclasses the codec knows) come back as those objects;
        a value of a type it has not registered comes back in a generic form, never as an
        error: `{"$unregistered": "<stored type name>", "$state": <its stored fields>}`.
        With `as_json=True` the result is exactly what `ratchet inspect --json` prints for the
        key (registered objects as their fields, sets as sorted lists, non-string dict keys as
        text)."""
        import ratchet.agents.chat  # noqa: F401 - registers ratchet's chat types (no provider SDK)
        from ratchet.agents._memory import nested
        from ratchet.runtime._memops import from_wire

        text = str(key)

        def read(s: SqliteStore) -> tuple[Any, list[tuple[bytes, bytes]]]:
            if key_type is None:
                return key, s.memories(text)
            typed = memory_key_type(text, key_type, lambda: s.held_key_types(text), self._dir)
            if typed is None:  # the state holds neither key of the text
                return None, []
            return (int(text) if typed == "int" else text), s.memories(text)

        want, rows = self._read(read)
        if not rows:
            return None
        try:
            # Every key that reads as `key` (the string "1" and the integer 1 are two keys):
            # the one of `key`'s own type, else (no `key_type` given) the only one there is.
            exact = [m for k, m in rows if _same_key(codec.decode(k, unknown="generic"), want)]
            if not exact and (len(rows) > 1 or key_type is not None):
                return None
            raw = exact[0] if exact else rows[0][1]
            memory = nested(from_wire(codec.decode(raw, unknown="generic")))
        except (RatchetError, TypeError, KeyError, ValueError) as exc:
            raise undecodable_memory(self._dir / DB_NAME, str(key), exc) from exc
        shown: dict[str, Any] = _shown(memory, as_json)
        return shown

    def memory_fields(
        self, key: str | int, *, key_type: str | None = None
    ) -> list[dict[str, Any]] | None:
        """The committed memory of `key` flattened to its leaves, in path order: `path`
        (dotted, as `ctx.short_term_memory.get` takes it), `type` (the stored type's name:
        `int`, `str`, `dict`, `ChatMessage`, `myapp.Ticket`, ...; an unregistered type by its
        stored name) and `value` (as `memory(key, as_json=True)` shows it). None for a key
        with no committed memory. What the dashboard shows beside a key. `key_type` as for
        `memory`."""
        memory = self.memory(key, key_type=key_type)
        if memory is None:
            return None
        out: list[dict[str, Any]] = []
        _leaves(memory, "", out)
        return out

    def recent_runs(self, limit: int = 50) -> list[dict[str, Any]]:
        """The most recently completed runs that have a kept trace, newest first, across all
        keys: key (text), seq, completed_at, status (`"ok"` or `"error"`), tasks (how many).
        Their traces are `traces(key, seq)`."""

        def read(s: SqliteStore) -> list[dict[str, Any]]:
            exists = s.conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'traces'"
            ).fetchone()
            if exists is None:
                return []
            kt = "key_type" if traces_typed(s.conn) else "NULL"
            rows = s.conn.execute(
                f"SELECT key_text, seq, at, status, trace, {kt} FROM traces "
                "ORDER BY at DESC, seq DESC LIMIT ?",
                (max(0, int(limit)),),
            ).fetchall()
            out: list[dict[str, Any]] = []
            for key_text, seq, at, status, blob, key_type in rows:
                try:  # either stored format (it read only the older, so it was always None)
                    tasks: int | None = len(unpack_trace(blob)[1])
                except (RatchetError, TypeError, AttributeError, ValueError):
                    tasks = None
                out.append(
                    {"key": key_text, "seq": seq, "completed_at": at, "status": status,
                     "tasks": tasks}
                )  # fmt: skip
                if key_type is not None:  # which of the two keys of a text like "1"
                    out[-1]["key_type"] = key_type
            return out

        return self._read(read)

    def approvals(self) -> list[dict[str, Any]]:
        """Tool calls waiting for a person's decision (docs/chat.md, *Tools that need
        approval*), oldest run first: key, seq, call_id, signal (send it to decide: `{"value":
        {"approved": true}}`), since, and from the run's journal tool, arguments and
        description (None where the journal does not hold them)."""

        def read(s: SqliteStore) -> list[dict[str, Any]]:
            waits = [w for w in s.call_waits() if str(w["on"]).startswith("signal approval:")]
            journals: dict[int, Any] = {}
            out = []
            for w in waits:
                signal = str(w["on"]).removeprefix("signal ")
                call_id = signal.removeprefix("approval:")
                seq = int(w["seq"])
                if seq not in journals:
                    row = s.conn.execute(
                        "SELECT journal FROM runs WHERE seq = ?", (seq,)
                    ).fetchone()
                    try:
                        journals[seq] = codec.decode(row[0], unknown="generic") if row else None
                    except (RatchetError, TypeError):
                        journals[seq] = None
                request = _find_approval_request(journals[seq], call_id) or {}
                out.append(
                    {
                        "key": _shown(w["key"], False),
                        "seq": seq,
                        "call_id": call_id,
                        "signal": signal,
                        "since": w.get("since"),
                        "tool": request.get("tool"),
                        "arguments": request.get("arguments"),
                        "description": request.get("description"),
                    }
                )
            return out

        return self._read(read)

    def runs_in_flight(self) -> list[dict[str, Any]]:
        """Runs started and not completed (`ratchet runs list`): key, seq (the input),
        journaled_tasks, call_records, calls_returned, agent_version (None: the current one;
        else the version the run is pinned to), oldest input first."""
        return self._read(lambda s: _shown(s.runs_in_flight(), False))

    def waiting(self) -> list[dict[str, Any]]:
        """Parked runs and what they wait on: key, seq, task, on (`"signal <name>"` or
        `"sleep"`), since and until (Unix times; until is None for a wait without a
        deadline). Sleeps whose deadline has passed are not listed."""
        return self._read(lambda s: _shown(s.waits(), False))

    def pending_signals(self) -> list[dict[str, Any]]:
        """Signals sent and not taken by a run yet, oldest first: id, key, name, value,
        sent_at, and key_type ('str' or 'int') when it was sent for one of the two keys of
        its text."""

        def read(s: SqliteStore) -> list[dict[str, Any]]:
            exists = s.conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'signals'"
            ).fetchone()
            if exists is None:
                return []
            out = []
            kt = "key_type" if signals_typed(s.conn) else "NULL"
            for i, k, n, v, t, key_type in s.conn.execute(
                f"SELECT id, key_text, name, value, sent_at, {kt} FROM signals ORDER BY id"
            ):
                try:
                    value = codec.decode(v, unknown="generic")
                except (RatchetError, TypeError):
                    value = None
                row = {"id": i, "key": k, "name": n, "value": _shown(value, False), "sent_at": t}
                if key_type is not None:
                    row["key_type"] = key_type
                out.append(row)
            return out

        return self._read(read)

    def dead_letters(self) -> list[dict[str, Any]]:
        """What `ratchet dead-letters --json` prints: id, kind (`"failed-run"`, `"bad-input"`,
        `"abandoned"`), key, seq, reason, at, detail, redrive_requested, redriven_as; oldest
        first."""
        return self._read(lambda s: _shown(s.dead_letters(), False))

    def traces(
        self, key: str | int, seq: int | None = None, *, key_type: str | None = None
    ) -> list[dict[str, Any]]:
        """The kept traces of `key`'s completed runs, newest first (only input `seq`'s with
        `seq`): key, seq, completed_at, status, started_at, key_type ('str' or 'int'; absent
        on a trace kept before types were) and tasks (each: action, on, task, index, replayed,
        started, duration, attempts, calls, notes, memory, events). The first one is what
        `ratchet trace --key K [--seq N] --json` prints. Runs in flight have no trace yet;
        older ones go by the job's `--trace-retention`.

        The string key "1" and the integer key 1 are two keys: an int `key`, or `key_type`
        'int', means the integer key; `key_type` 'str' the string key; a str `key` without a
        `key_type` ('auto') whichever of the two the state holds, and a state holding both
        raises `ratchet.InvalidArgumentError` until you say which."""
        text, asked = str(key), _asked_type(key, key_type)

        def read(s: SqliteStore) -> list[dict[str, Any]]:
            typed = trace_key_type(text, asked, seq, lambda: s.held_key_types(text), self._dir)
            good, bad = read_traces(s, text, seq, typed)
            if bad:
                raise undecodable_trace(self._dir / DB_NAME, text, bad[0][0], bad[0][1])
            return good

        return self._read(lambda s: _shown(read(s), False))

    def _held_key_types(self, text: str) -> set[str]:
        return self._read(lambda s: s.held_key_types(text))

    def checkpoints(self) -> dict[str, Any]:
        """What `ratchet checkpoints --json` prints: counts, latest_restored, the statistics
        rows of the retained checkpoints (id, triggered_at, time, duration_ms, size_bytes,
        restorable: only the latest is), the savepoints taken of the state, and the job id."""
        from ratchet.runtime._savepoints import list_checkpoints

        self._open()
        try:
            return list_checkpoints(self._dir)
        except sqlite3.Error as exc:
            raise StateError(f"{self._dir / DB_NAME} could not be read ({exc})") from exc

    # -- helpers ----------------------------------------------------------------------------

    def _open(self) -> SqliteStore:
        if self._store is None:
            raise StateError(f"the state {self._dir} was closed (ratchet.open_state again)")
        return self._store

    def _read(self, fn: Callable[[SqliteStore], _T]) -> _T:
        store = self._open()
        with _snapshot(store):
            return fn(store)


class ShardedState(State):
    """A read-only view of a job sharded over N workers: every method answers for the whole
    job, as `State`'s does for one database. Each shard is read in its own read transaction:
    within a shard one consistent moment, across shards one after the other (a key lives in
    one shard, so what one key shows is always consistent)."""

    def __init__(self, state_dir: Path, shards: list[State], workers: int) -> None:
        super().__init__(state_dir, shards[0]._open())
        self._shards = shards
        self._workers = workers

    def close(self) -> None:
        for s in self._shards:
            s.close()
        self._store = None

    def _each(self) -> list[State]:
        self._open()
        return self._shards

    def summary(self) -> dict[str, Any]:
        from ratchet.runtime._shards import sharded_summary

        self._open()
        try:
            return dict(_shown(sharded_summary(self._dir), False))
        except sqlite3.Error as exc:
            raise StateError(f"{self._dir} could not be read ({exc})") from exc

    def _typed_keys(
        self, contains: str | None = None, limit: int | None = None
    ) -> list[tuple[str, str]]:
        found = sorted(k for s in self._each() for k in s._typed_keys(contains, limit))
        return found if limit is None else found[: max(0, int(limit))]

    def count_keys(self, contains: str | None = None) -> int:
        return sum(s.count_keys(contains) for s in self._each())

    def memory(
        self, key: str | int, *, as_json: bool = False, key_type: str | None = None
    ) -> dict[str, Any] | None:
        shards = self._each()
        if key_type is not None:
            # The two keys of a text may live in two shards: which one is meant is found
            # over all, then read where it lives.
            text = str(key)

            def held() -> set[str]:
                return set().union(*(s._held_key_types(text) for s in shards))

            typed = memory_key_type(text, key_type, held, self._dir)
            if typed is None:
                return None
            key_type = typed
        else:
            # The key of `key`'s own type first, over every shard: one shard's "only key of
            # the text" may be the other key, whose twin lives in another shard.
            own = "int" if isinstance(key, int) and not isinstance(key, bool) else "str"
            for s in shards:
                found = s.memory(key, as_json=as_json, key_type=own)
                if found is not None:
                    return found
        for s in shards:
            found = s.memory(key, as_json=as_json, key_type=key_type)
            if found is not None:
                return found
        return None

    def recent_runs(self, limit: int = 50) -> list[dict[str, Any]]:
        runs = [r for s in self._each() for r in s.recent_runs(limit)]
        runs.sort(key=lambda r: (r["completed_at"], r["seq"]), reverse=True)
        return runs[: max(0, int(limit))]

    def approvals(self) -> list[dict[str, Any]]:
        return sorted((a for s in self._each() for a in s.approvals()), key=lambda a: a["seq"])

    def runs_in_flight(self) -> list[dict[str, Any]]:
        return sorted((r for s in self._each() for r in s.runs_in_flight()), key=lambda r: r["seq"])

    def waiting(self) -> list[dict[str, Any]]:
        return sorted((w for s in self._each() for w in s.waiting()), key=lambda w: w["seq"])

    def pending_signals(self) -> list[dict[str, Any]]:
        out = []
        for s in self._each():
            for p in s.pending_signals():
                p["shard"] = s.path.name
                out.append(p)
        return sorted(out, key=lambda p: (p["sent_at"], p["id"]))

    def dead_letters(self) -> list[dict[str, Any]]:
        from ratchet.runtime._shards import global_id

        out = []
        for s in self._each():
            index = int(s.path.name.split("-of-")[0])
            for d in s.dead_letters():
                d["id"] = global_id(int(d["id"]), index, self._workers)
                d["shard"] = s.path.name
                out.append(d)
        return sorted(out, key=lambda d: (d["at"], d["id"]))

    def traces(
        self, key: str | int, seq: int | None = None, *, key_type: str | None = None
    ) -> list[dict[str, Any]]:
        # The two keys of a text may live in two shards: which one is meant is found over all.
        text, shards = str(key), self._each()

        def held() -> set[str]:
            return set().union(*(s._held_key_types(text) for s in shards))

        typed = trace_key_type(text, _asked_type(key, key_type), seq, held, self._dir)
        found = [t for s in shards for t in s.traces(text, seq, key_type=typed or "auto")]
        return sorted(found, key=lambda t: t["seq"], reverse=True)

    def checkpoints(self) -> dict[str, Any]:
        """Per shard (checkpoint ids and history are each shard's own): {"workers": N,
        "shards": {name: what `State.checkpoints` gives for that shard}}."""
        return {
            "workers": self._workers,
            "shards": {s.path.name: s.checkpoints() for s in self._each()},
        }


@contextmanager
def _snapshot(store: SqliteStore) -> Iterator[None]:
    """One read transaction (a consistent moment); sqlite errors become StateError."""
    conn = store.conn
    try:
        conn.execute("BEGIN")
        try:
            yield
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")
    except sqlite3.Error as exc:
        raise StateError(f"{store.path} could not be read ({exc}); it was left untouched") from exc
    except (CodecError, CorruptDataError) as exc:  # stored bytes that do not decode
        raise StateError(
            f"{store.path} holds data that cannot be decoded ({exc}); it is damaged, or was "
            f"written by another ratchet; it was left untouched"
        ) from exc


def _key_search(contains: str | None) -> tuple[str, list[Any]]:
    """The WHERE clause (and its parameters) of a case-insensitive search in key texts: instr
    on lower(), no LIKE, so `%` and `_` in a search are plain characters."""
    if not contains:
        return "", []
    return " WHERE instr(lower(key_text), lower(?)) > 0", [contains]


def _type_name(value: Any) -> str:
    if type(value) is codec.UnknownValue:
        return str(value.type_name)
    t = type(value)
    if t.__module__ == "builtins":
        return t.__name__
    return codec.registered_name(t) or f"{t.__module__}.{t.__qualname__}"


def _leaves(value: Any, path: str, out: list[dict[str, Any]]) -> None:
    """Memory flattened to (path, type, value) leaves: nested dicts with text keys are the
    memory's own structure; any other value is a leaf, however composite."""
    if type(value) is dict and value and all(isinstance(k, str) for k in value):
        for k in sorted(value):
            _leaves(value[k], f"{path}.{k}" if path else k, out)
        return
    out.append({"path": path, "type": _type_name(value), "value": _shown(value, True)})


def _find_approval_request(tree: Any, call_id: str, depth: int = 0) -> dict[str, Any] | None:
    """The `approval_request` record of `call_id` anywhere in a generically decoded journal
    (the chat agent's tools action emits it as an output event before the run waits)."""
    if depth > 40:
        return None
    if type(tree) is codec.UnknownValue:
        return _find_approval_request(tree.state, call_id, depth + 1)
    if isinstance(tree, dict):
        req = tree.get("approval_request")
        if isinstance(req, dict) and req.get("call_id") == call_id:
            return req
        items: Any = tree.values()
    elif isinstance(tree, list | tuple):
        items = tree
    else:
        return None
    for item in items:
        found = _find_approval_request(item, call_id, depth + 1)
        if found is not None:
            return found
    return None


_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _shown(value: Any, as_json: bool, seen: set[str] | None = None) -> Any:
    """`value` with every unregistered-type stand-in in its generic form; with `as_json`,
    converted as `ratchet inspect --json` converts memory (objects to fields, sets to sorted
    lists, non-string keys to text, NaN and infinities to the strings "NaN", "Infinity" and
    "-Infinity"). The names of unregistered types met go into `seen`."""
    t = type(value)
    if t is codec.UnknownValue:
        if seen is not None:
            seen.add(value.type_name)
        return {"$unregistered": value.type_name, "$state": _shown(value.state, as_json, seen)}
    if as_json:
        if isinstance(value, Enum):
            return _shown(value.value, as_json, seen)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = dataclasses.fields(value)
            return {f.name: _shown(getattr(value, f.name), as_json, seen) for f in fields}
        from pydantic import BaseModel

        if isinstance(value, BaseModel):
            return _shown(value.model_dump(mode="python"), as_json, seen)
        if t is set or t is frozenset:
            return sorted((_shown(v, as_json, seen) for v in value), key=repr)
        if t is float and not math.isfinite(value):
            return _NON_FINITE[str(value)]  # standard JSON has no NaN or Infinity
    if t is dict:
        return {_shown_key(k, as_json, seen): _shown(v, as_json, seen) for k, v in value.items()}
    if t is list or t is tuple:
        return t(_shown(v, as_json, seen) for v in value)
    # A set (as_json=False) is returned as it is: its members must stay hashable, so an
    # unregistered member keeps its stand-in (`ratchet.store.codec.UnknownValue`).
    return value


def _shown_key(key: Any, as_json: bool, seen: set[str] | None = None) -> Any:
    if not as_json:
        # A dict key must stay hashable: an unregistered key keeps its stand-in.
        return key
    if type(key) is float and not math.isfinite(key):
        return _NON_FINITE[str(key)]
    if isinstance(key, str | int | float):
        return key
    return _key_text(key, seen)


def _key_text(key: Any, seen: set[str] | None = None) -> str:
    if type(key) is tuple:
        inner = ", ".join(_key_text(x, seen) for x in key)
        return f"({inner},)" if len(key) == 1 else f"({inner})"
    if type(key) is codec.UnknownValue:
        if seen is not None:
            seen.add(key.type_name)
        return f"{key.type_name}({_key_text(key.state, seen)})"
    if isinstance(key, Enum):
        return f"{type(key).__name__}.{key.name}"
    return repr(key)


def _same_key(stored: Any, key: Any) -> bool:
    return type(stored) is type(key) and stored == key
