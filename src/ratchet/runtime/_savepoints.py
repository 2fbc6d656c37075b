"""Savepoints and forks: consistent copies of an embedded job's state, taken while it runs.

The engine updates its one SQLite database in place, so only the latest completed checkpoint
can be restored; a savepoint keeps a point to come back to. Every copy here is made with
SQLite's online backup API from a read-only connection, in one read transaction: it holds
exactly what a crash at that instant would have left (the latest completed checkpoint, plus
the durable-call records written through since), and the job's writer carries on meanwhile
(in WAL mode a reader never blocks it). A live database is never copied as files.

Every copy is built beside its destination under a name only that attempt uses, locked
(flock) while it is built, and moved into place only once it is complete, verified and
fsynced: a kill at any moment leaves no copy or a complete one. A staging file or directory
that nobody holds locked is a killed attempt's leftover; the next attempt removes it.

- `take_savepoint`: the state as one self-contained SQLite file with a `savepoint` meta record
  (job id, checkpoint id, agent fingerprint, ...); listed in the state's `savepoints.jsonl`.
- `read_savepoint`: a savepoint file's record, after checking it is whole and a savepoint.
- `restore_savepoint`: a new state directory holding a savepoint's state and its job id (the
  same job, continued: its outputs dedupe by id against that job's output file).
- `fork_state`: a new job (a new id) from all of a state's keys, or only some of them.
- `list_checkpoints`: a state's checkpoint history and its savepoints.

Tables added by later schema versions are found through `sqlite_master`, never assumed.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import shutil
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import (
    CodecError,
    ConfigError,
    CorruptDataError,
    InternalError,
    StateError,
)
from ratchet.runtime._io import JOB_FILE, job_identity, newer_job_format
from ratchet.runtime._shards import chosen_key_type, int_text
from ratchet.store import codec
from ratchet.store._base import signal_key_type
from ratchet.store._files import atomic_json, fsync_dir
from ratchet.store._sqlite import DB_NAME, LOCK_NAME, SCHEMA_VERSION, SqliteStore

SAVEPOINT_META = "savepoint"  # the meta record that makes a database file a savepoint
SAVEPOINT_FORMAT = 1
SAVEPOINTS_LOG = "savepoints.jsonl"  # in the state directory: one line per savepoint taken
FORK_META = "forked_from"  # the meta record a fork gets: where it came from
_JOB_FORMAT = 1  # of job.json; a file written here is read back through `job_identity`
_SIDECARS = ("-journal", "-wal", "-shm")

# How a fork of some keys treats each table. Rows of a per-key table belong to the key in
# their `key` column; `calls` rows to the input (seq) whose run made them; outbox rows to the
# key inside their record. Tables in _WHOLE hold nothing per key and are copied whole. Any
# other table with a key or seq column is refused: splitting state this code does not know
# could leave a fork with rows of keys it does not have, or without rows it needs.
_PER_KEY = ("keys", "spilled", "inputs", "runs", "dead_letters")
_PER_INPUT = ("calls",)
_PER_KEY_TEXT = ("signals", "traces")  # rows that name their key by its text only
_WHOLE = ("meta", "checkpoints", "agent_versions")
_KEYED_COLUMNS = frozenset({"key", "key_text", "seq"})

RESTORABLE_NOTE = (
    "the state is updated in place: only the latest completed checkpoint is restorable (it is "
    "what `ratchet run --state {state}` resumes from); earlier rows are history, statistics of "
    "checkpoints whose state has since been overwritten. To keep a point you can go back to, "
    "take a savepoint: ratchet savepoint --state {state} PATH"
)


# -- small helpers ---------------------------------------------------------------------------------


def iso_utc(timestamp: float | None) -> str | None:
    """A stored wall-clock timestamp as ISO-8601 UTC ending in Z (as `_clock.utc_iso` writes
    the clock's current time)."""
    if timestamp is None:
        return None
    stamp = _dt.datetime.fromtimestamp(timestamp, _dt.UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _q(name: str) -> str:
    """An SQL identifier, quoted (table names come from the database's own catalogue)."""
    return '"' + name.replace('"', '""') + '"'


def _open_ro(path: Path) -> sqlite3.Connection:
    uri = f"{path.resolve().as_uri()}?mode=ro"
    return sqlite3.connect(uri, uri=True, isolation_level=None)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tables(conn: sqlite3.Connection) -> dict[str, list[str]]:
    """Every table of the main database and its columns."""
    names = [
        row[0]
        for row in conn.execute(
            "SELECT name FROM main.sqlite_master WHERE type = 'table' AND substr(name, 1, 7) != 'sqlite_'"
        )
    ]
    return {n: [c[1] for c in conn.execute(f"PRAGMA main.table_info({_q(n)})")] for n in names}


def _check(conn: sqlite3.Connection, what: str, full: bool, then: str = "") -> None:
    """SQLite's integrity check (or the quicker one) of `what`; StateError unless it is ok.
    `then` is the rest of the sentence: what was (not) written, and the fix."""
    pragma = "integrity_check" if full else "quick_check"
    found = [" ".join(str(row[0]).split()) for row in conn.execute(f"PRAGMA {pragma}").fetchall()]
    if found != ["ok"]:
        shown = "; ".join(found[:5]) + ("; ..." if len(found) > 5 else "")
        raise StateError(
            f"{what} failed SQLite's integrity check ({shown})" + (f"; {then}" if then else "")
        )


def _copy_damaged(db: Path, target: Path) -> str:
    """The rest of the sentence when the copy of a state's database fails its check."""
    return (
        f"nothing was written at {target}; the state's database is likely damaged (see "
        f"`sqlite3 {db} 'PRAGMA integrity_check'`): restore it from a backup or an earlier "
        f"savepoint"
    )


def _meta(conn: sqlite3.Connection, path: Path) -> dict[str, Any]:
    """Every meta record of a ratchet database, decoded; StateError if it is not one, or one
    of a newer schema than this ratchet reads."""
    try:
        rows = conn.execute("SELECT name, value FROM meta").fetchall()
    except sqlite3.DatabaseError as exc:
        raise StateError(f"{path} is not a ratchet state database ({exc})") from exc
    meta: dict[str, Any] = {}
    for name, value in rows:
        try:
            meta[str(name)] = codec.decode(bytes(value), unknown="generic")
        except (CorruptDataError, CodecError) as exc:
            raise StateError(
                f"{path}: the meta record {name!r} cannot be decoded ({exc}); it is damaged"
            ) from exc
    version = meta.get("schema_version")
    if type(version) is not int or version < 1:
        raise StateError(
            f"{path} has no valid schema_version record ({version!r}); it is not a ratchet "
            f"state database"
        )
    if version > SCHEMA_VERSION:
        raise StateError(
            f"{path} was written with state schema {version}; this ratchet reads schema "
            f"{SCHEMA_VERSION} and older; upgrade ratchet to read it"
        )
    return meta


def _latest_checkpoint(conn: sqlite3.Connection) -> int | None:
    row = conn.execute("SELECT MAX(id) FROM checkpoints").fetchone()
    return None if row is None or row[0] is None else int(row[0])


def _describe(conn: sqlite3.Connection) -> dict[str, int]:
    """What a state holds, counted."""

    def count(sql: str) -> int:
        return int(conn.execute(sql).fetchone()[0])

    counts = {
        "keys": count("SELECT COUNT(*) FROM keys"),
        "in_flight_runs": count("SELECT COUNT(*) FROM runs"),
        "queued_inputs": count(
            "SELECT COUNT(*) FROM inputs WHERE seq NOT IN (SELECT seq FROM runs)"
        ),
        "unreleased_outputs": count("SELECT COUNT(*) FROM outbox"),
    }
    if "dead_letters" in _tables(conn):
        counts["dead_letters"] = count("SELECT COUNT(*) FROM dead_letters")
    return counts


def _set_meta(conn: sqlite3.Connection, name: str, value: Any) -> None:
    conn.execute(
        "INSERT INTO meta(name, value) VALUES (?, ?) "
        "ON CONFLICT(name) DO UPDATE SET value = excluded.value",
        (name, codec.encode(value)),
    )


def _read_job(state_dir: Path) -> tuple[str | None, bool]:
    """The job id in `state_dir`'s job file and whether its outputs predate job ids; (None,
    False) for a state without a job file (made by a ratchet older than job ids). Unlike
    `job_identity` it never writes one: the source of a copy is only read."""
    path = state_dir / JOB_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, False
    except (OSError, ValueError) as exc:
        raise StateError(
            f'{path} is not a ratchet job file ({exc}); restore it (its job id is the "job" field '
            f"of this job's output lines) before copying this state"
        ) from exc
    newer = newer_job_format(data)
    if newer is not None:  # a copy made here would be this version's job.json: refused
        raise StateError(f"{path} {newer}")
    job = data.get("job") if isinstance(data, dict) else None
    legacy = data.get("legacy_outputs") if isinstance(data, dict) else None
    if not isinstance(job, str) or not job or not isinstance(legacy, bool):
        raise StateError(
            f'{path} is not a ratchet job file (a "job" id and "legacy_outputs"); restore it '
            f"before copying this state"
        )
    return job, legacy


def _require_state(state_dir: Path) -> None:
    if not (state_dir / DB_NAME).is_file():
        raise StateError(
            f"no ratchet state in {state_dir} ({state_dir / DB_NAME} does not exist); pass the "
            f"--state directory of a job that has run"
        )


def _require_empty(target: Path, what: str) -> None:
    """A state directory to create must not exist yet, or be an empty directory."""
    if target.is_dir() and not target.is_symlink():
        if any(target.iterdir()):
            raise StateError(
                f"{target} is not empty; {what} a new directory (one that does not exist yet, "
                f"or an empty one), or empty {target} first"
            )
    elif target.exists() or target.is_symlink():
        raise StateError(f"{target} exists and is not a plain directory; {what} a new directory")


def _refuse_here(target: Path, flag: str) -> None:
    """A new state is moved into place by renaming a finished copy onto `target`: that cannot
    replace the current directory (nor `/`), and would leave this process in a removed one."""
    if not target.name or target.resolve() == Path.cwd().resolve():
        raise ConfigError(
            f"{flag} {target} is the current directory (or the root), which a restore or a fork "
            f"cannot fill: it puts a finished copy in place of the directory; pass a new "
            f"directory, e.g. {flag} {target.resolve() / 'state'}"
        )


def _free_name(path: Path) -> Path:
    """A name beside `path` that is not taken: `name-2.ext`, `name-3.ext`, ..."""
    n = 2
    while True:
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
        if not candidate.exists():
            return candidate
        n += 1


# -- staging: build beside the target, then move into place ---------------------------------------


def _try_lock(path: Path, create: bool) -> int | None:
    """A descriptor holding an exclusive flock on `path`; None if someone holds it or it is gone."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:  # removed (or replaced) between the open and the lock
        os.close(fd)
        return None
    return fd


def _remove_file(path: Path) -> None:
    for sidecar in _SIDECARS:  # the journals first: a database without them is just stale
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{path}{sidecar}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class _Staging:
    """A file or directory built beside `target` under a name only this attempt uses.

    It is locked (flock; the OS drops the lock when the process dies) for as long as it is
    built, so one that nobody holds is a killed attempt's leftover: entering removes those
    first. A directory is locked through its `ratchet.lock`, the lock file a state directory
    has anyway. `place()` moves the finished copy onto `target`; leaving without placing
    removes it.
    """

    def __init__(self, target: Path, kind: str, directory: bool) -> None:
        self.target = target
        self.parent = target.parent
        self.prefix = f".{target.name}.{kind}-"
        self.suffix = ".tmp"
        self.directory = directory
        self._path: Path | None = None
        self._fd: int | None = None
        self._placed = False

    @property
    def path(self) -> Path:
        assert self._path is not None, "entered first"
        return self._path

    def _lock_path(self, path: Path) -> Path:
        return path / LOCK_NAME if self.directory else path

    def _ours(self, name: str) -> bool:
        return name.startswith(self.prefix) and self.suffix in name[len(self.prefix) :]

    def _clean_leftovers(self) -> None:
        try:
            names = os.listdir(self.parent)
        except FileNotFoundError:
            return
        for name in names:
            if not self._ours(name):
                continue
            path = self.parent / name
            if not self.directory and not name.endswith(self.suffix):
                # A journal of a staging file: it goes with its database, or alone if that is gone.
                base = next((name[: -len(s)] for s in _SIDECARS if name.endswith(s)), None)
                if base is not None and not (self.parent / base).exists():
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                continue
            fd = _try_lock(self._lock_path(path), create=self.directory)
            if fd is None:
                continue  # another attempt is building it
            try:
                if self.directory:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    _remove_file(path)
            finally:
                os.close(fd)

    def __enter__(self) -> _Staging:
        self.parent.mkdir(parents=True, exist_ok=True)
        self._clean_leftovers()
        for _attempt in range(8):
            path = self.parent / f"{self.prefix}{os.urandom(8).hex()}{self.suffix}"
            try:
                if self.directory:
                    os.mkdir(path)  # as any new directory (mkdtemp's would be private)
                else:
                    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                continue
            fd = _try_lock(self._lock_path(path), create=self.directory)
            if fd is not None:
                self._path, self._fd = path, fd
                return self
            # Another attempt's clean-up took it for a leftover and holds or removed it: anew.
        raise StateError(
            f"could not make a staging {'directory' if self.directory else 'file'} in "
            f"{self.parent} (other processes kept removing it); run again"
        )

    def sync(self) -> None:
        """Make the finished copy durable before it is moved into place."""
        if self.directory:
            for child in self.path.iterdir():
                if child.is_file():
                    _fsync_file(child)
            fsync_dir(self.path)
        else:
            assert self._fd is not None
            os.fsync(self._fd)

    def place(self) -> None:
        """Move the finished copy onto the target, which must not exist (a file) or be an
        empty directory (a directory); StateError otherwise."""
        self.sync()
        path = self.path
        if self.directory:
            try:
                os.rename(path, self.target)  # replaces an empty directory, nothing else
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise StateError(
                        f"{self.target} was filled while the copy was made; nothing was written "
                        f"to it; choose a new directory"
                    ) from exc
                raise
        else:
            try:
                os.link(path, self.target)  # fails if the target exists: never replaces one
            except FileExistsError:
                raise StateError(
                    f"{self.target} was created while the savepoint was taken; it was left "
                    f"as it is; choose a new path, e.g. {_free_name(self.target)}"
                ) from None
            except OSError:
                # A file system without hard links: check, then rename (a narrow race).
                if self.target.exists():
                    raise StateError(
                        f"{self.target} was created while the savepoint was taken; choose a "
                        f"new path, e.g. {_free_name(self.target)}"
                    ) from None
                os.rename(path, self.target)
            else:
                os.unlink(path)
        fsync_dir(self.parent)
        self._placed = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if not self._placed and self._path is not None:
                if self.directory:
                    shutil.rmtree(self._path, ignore_errors=True)
                else:
                    _remove_file(self._path)
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _copy_into(source: sqlite3.Connection, dest_path: Path) -> sqlite3.Connection:
    """A consistent copy of `source` (one read transaction) at `dest_path`, a new or empty
    file, as a rollback-journal database (one self-contained file, written with full fsyncs);
    the open connection to the copy."""
    dest = sqlite3.connect(dest_path, isolation_level=None)
    try:
        source.backup(dest)
        # The copy inherits its source's WAL mode; a copy is one file, so switch back.
        mode = str(dest.execute("PRAGMA journal_mode=DELETE").fetchone()[0])
        if mode.lower() != "delete":
            raise StateError(f"{dest_path}: could not leave WAL mode (got {mode})")
        dest.execute("PRAGMA synchronous=FULL")
    except BaseException:
        dest.close()
        raise
    return dest


def _copy_failed(what: str, exc: BaseException) -> StateError:
    import sqlite3

    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        fix = (
            "the state's database is damaged, so no consistent copy of it can be made; "
            "restore it from a backup or an earlier savepoint"
        )
    elif isinstance(exc, (FileExistsError, NotADirectoryError)):
        fix = "a part of the path is a file, not a folder; choose another path"
    else:
        fix = "fix the cause (disk space, permissions) and run again"
    return StateError(f"{what} failed ({type(exc).__name__}: {exc}); nothing was written; {fix}")


# -- savepoints ------------------------------------------------------------------------------------


def take_savepoint(
    state_dir: str | os.PathLike[str],
    path: str | os.PathLike[str],
    clock: Clock = SYSTEM_CLOCK,
) -> dict[str, Any]:
    """Write a consistent, self-contained copy of the state in `state_dir` to the file `path`.

    Works while a job owns the state (and writes it) or while it is stopped. `path` must not
    exist; it appears only once the copy is complete, verified (SQLite's integrity check, meta
    records readable) and fsynced. The copy carries a `savepoint` meta record; the savepoint is
    also appended to `state_dir/savepoints.jsonl` (best effort: `logged` says whether it was).
    Returns what was written: path, job, checkpoint id, size, counts.
    """
    sdir = Path(state_dir)
    target = Path(path)
    _require_state(sdir)
    if not str(path):
        raise ConfigError("the savepoint PATH is empty; pass a new file's path, e.g. savepoint.db")
    if target.is_dir():  # also '.' and '/', whose name is empty: no sibling name to suggest
        inside = target / "savepoint.db"
        raise ConfigError(
            f"{target} is a directory; a savepoint is one file: pass a new file's path, e.g. "
            f"{_free_name(inside) if inside.exists() else inside}"
        )
    if target.exists() or target.is_symlink():
        raise StateError(
            f"{target} exists; a savepoint never replaces a file; choose a new path, e.g. "
            f"{_free_name(target)}"
        )
    job, legacy = _read_job(sdir)
    store = SqliteStore.open_readonly(sdir)
    try:
        with _Staging(target, "savepoint", directory=False) as staging:
            try:
                dest = _copy_into(store.conn, staging.path)
            finally:
                store.close()  # ends the read transaction: the writer may checkpoint its WAL
            try:
                meta = _meta(dest, sdir / DB_NAME)
                record = {
                    "format": SAVEPOINT_FORMAT,
                    "taken_at": clock.now(),
                    "state_dir": str(sdir.resolve()),
                    "job": job,
                    "legacy_outputs": legacy,
                    "checkpoint_id": _latest_checkpoint(dest),
                    "agent_fingerprint": meta.get("agent_fingerprint"),
                    "agent_name": meta.get("agent_name"),
                    "memory_version": meta.get("memory_version", 1),
                    "schema_version": meta["schema_version"],
                }
                if record["checkpoint_id"] is None:
                    _refuse_lost_history(sdir, job, meta)
                _set_meta(dest, SAVEPOINT_META, record)
                _check(
                    dest,
                    f"the copy of {sdir / DB_NAME}",
                    True,
                    _copy_damaged(sdir / DB_NAME, target),
                )
                if _meta(dest, staging.path).get(SAVEPOINT_META) != record:
                    raise InternalError(f"{staging.path}: the savepoint record did not read back")
                counts = _describe(dest)
            finally:
                dest.close()
            staging.place()
    except (sqlite3.Error, OSError) as exc:
        raise _copy_failed(f"copying the state of {sdir} to {target}", exc) from exc
    finally:
        store.close()
    size = target.stat().st_size
    result: dict[str, Any] = {
        "path": str(target.resolve()),
        **record,
        "size_bytes": size,
        **counts,
    }
    result["logged"], result["log_error"] = _log_savepoint(sdir, result)
    return result


def _refuse_lost_history(sdir: Path, job: str | None, meta: dict[str, Any]) -> None:
    """A savepoint of a state with no completed checkpoint whose job has run (its job.json
    exists), that no process runs now, and that is not a restore or a re-sharding's seed:
    the state lost its committed work (its write-ahead log removed after a kill; `ratchet
    run` refuses it) or was killed before its first checkpoint. Such a savepoint holds
    nothing of the job, and continuing from it redid every input and repeated every durable
    call: refused, naming the fix. A running job before its first checkpoint is let through
    (it passed that check as it started); `run --from-savepoint` asks the output then."""
    counts = meta.get("counts")
    completed = counts.get("completed", 0) if isinstance(counts, dict) else 0
    if (
        job is None
        or completed
        or meta.get("source")
        or meta.get(SAVEPOINT_META) is not None
        or _owned(sdir)
    ):
        return
    raise StateError(
        f"cannot take a savepoint of {sdir}: {sdir / DB_NAME} has no completed checkpoint, "
        f"but its job {job} has run (its {JOB_FILE} exists) and no process runs it now: the "
        f"state lost its committed work (its write-ahead log {DB_NAME}-wal was removed after "
        f"a kill, or {DB_NAME} was copied without it), or its job was killed before its first "
        f"checkpoint; a savepoint of it holds no checkpoint, and continuing from one would "
        f"redo every input and repeat every durable call. Restore {DB_NAME} together with its "
        f"{DB_NAME}-wal file, or continue from a savepoint taken before (`ratchet checkpoints "
        f"--state {sdir}` lists them); a job killed before its first checkpoint lost nothing: "
        f"run it on with --state {sdir}"
    )


def _owned(sdir: Path) -> bool:
    """Whether a process holds the state's lock or its supervisor's (a job runs it), asked
    without taking either: holding one even for a moment would make a job that starts then
    fail as "in use"."""
    from ratchet.runtime._io import _flock_holder
    from ratchet.store._sqlite import SUPERVISOR_LOCK_NAME

    for name in (LOCK_NAME, SUPERVISOR_LOCK_NAME):
        try:
            fd = os.open(sdir / name, os.O_RDONLY)
        except OSError:
            continue
        try:
            if _flock_holder(fd) is not None:
                return True
        finally:
            os.close(fd)
    return False


def _log_savepoint(state_dir: Path, result: dict[str, Any]) -> tuple[bool, str | None]:
    """Append one line for the savepoint to `savepoints.jsonl`; best effort (the savepoint is
    complete without it): (whether it was written, why not)."""
    entry = {
        k: result[k]
        for k in (
            "path",
            "taken_at",
            "checkpoint_id",
            "job",
            "size_bytes",
            "keys",
            "schema_version",
        )
    }
    line = json.dumps(entry, sort_keys=True) + "\n"
    log_path = state_dir / SAVEPOINTS_LOG
    try:
        fd = os.open(log_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = "\n" + line  # the end of a line cut by a kill: start a new one
            os.write(fd, line.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return False, f"{log_path} could not be written: {exc}"
    return True, None


def _read_savepoint(p: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The savepoint record of the file `p` as stored, and what the savepoint holds."""
    if not p.is_file():
        what = "does not exist" if not p.exists() else "is not a file"
        raise StateError(f"savepoint {p} {what}; pass a file written by `ratchet savepoint`")
    try:
        conn = _open_ro(p)
    except sqlite3.Error as exc:
        raise StateError(f"{p} cannot be opened as a ratchet savepoint ({exc})") from exc
    fix = "pass a file written by `ratchet savepoint`"
    try:
        try:
            _check(conn, str(p), True)  # the handler below adds the fix
            meta = _meta(conn, p)
            counts = _describe(conn)
        except sqlite3.DatabaseError as exc:
            raise StateError(f"{p} is not a ratchet savepoint ({exc}); {fix}") from exc
        except StateError as exc:
            raise StateError(f"{exc}; it is not a usable savepoint; {fix}") from exc
    finally:
        conn.close()
    record = meta.get(SAVEPOINT_META)
    if not isinstance(record, dict):
        raise StateError(
            f"{p} is a ratchet state database but not a savepoint (it has no "
            f"{SAVEPOINT_META!r} record); {fix}"
        )
    if record.get("format") != SAVEPOINT_FORMAT:
        raise StateError(
            f"{p} is a savepoint of format {record.get('format')!r}; this ratchet reads format "
            f"{SAVEPOINT_FORMAT}; use the ratchet version that wrote it"
        )
    return record, counts


def read_savepoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The `savepoint` record of the savepoint file at `path`, with what it holds (`counts`)
    and its size, after checking that it is whole (SQLite's integrity check) and a ratchet
    savepoint; StateError naming what is wrong otherwise."""
    p = Path(path)
    return _described(p, *_read_savepoint(p))


def _described(p: Path, record: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    return dict(record, counts=counts, size_bytes=p.stat().st_size, path=str(p.resolve()))


def restore_savepoint(
    savepoint: str | os.PathLike[str],
    state_dir: str | os.PathLike[str],
    clock: Clock = SYSTEM_CLOCK,
) -> dict[str, Any]:
    """Make `state_dir` (which must not exist, or be empty) hold the savepoint's state.

    The state gets the savepoint's job id: the restored job is the same job, continued, so
    outputs it writes again dedupe by id against that job's output file. Built beside
    `state_dir` and renamed onto it once complete and fsynced: a kill leaves no state there or
    a whole one. Returns the savepoint's record with `state_dir`.
    """
    sp = Path(savepoint)
    target = Path(state_dir)
    stored, counts = _read_savepoint(sp)
    if _is_used(target):
        raise _used_error(target, sp, stored, _restored_record(target))
    return _restore(sp, target, stored, counts, clock)


def restore_or_resume(
    savepoint: str | os.PathLike[str],
    state_dir: str | os.PathLike[str],
    clock: Clock = SYSTEM_CLOCK,
) -> dict[str, Any]:
    """`restore_savepoint`, unless `state_dir` already holds this very savepoint's restore:
    then nothing is done and the result says `resumed: True`.

    What `ratchet run --from-savepoint` does, so that the same command continues a job killed
    after its restore (or refused after it: wrong input, output or agent) instead of refusing
    the directory: restoring again would roll the job back to the savepoint and make every
    durable call since then again. The restore is recognised by the savepoint record it
    copied into the state's meta (its time, source state and checkpoint are the savepoint's
    alone; job.json keeps a copy for a state sharded since). Anything else in `state_dir` is
    refused, naming a fix that loses nothing."""
    sp = Path(savepoint)
    target = Path(state_dir)
    try:
        stored, counts = _read_savepoint(sp)
    except StateError as exc:
        if _is_used(target) and _restored_record(target) is not None:
            raise StateError(
                f"{exc}; or, to resume the state in {target} as it is, run without --from-savepoint"
            ) from exc
        raise
    if not _is_used(target):
        return dict(_restore(sp, target, stored, counts, clock), resumed=False)
    held = _restored_record(target)
    if held is not None and held["record"] == stored:
        return dict(
            _described(sp, stored, counts),
            state_dir=str(target.resolve()),
            savepoint=str(sp.resolve()),
            resumed=True,
        )
    raise _used_error(target, sp, stored, held)


def _is_used(target: Path) -> bool:
    """Whether `target` is anything but a directory to restore into (absent, or empty)."""
    if target.is_dir() and not target.is_symlink():
        return any(target.iterdir())
    return target.exists() or target.is_symlink()


def _restored_record(target: Path) -> dict[str, Any] | None:
    """What the state in `target` is, for the refusal and the resume: None if `target` holds no
    ratchet state; else {"job": its job id or None, "record": the savepoint record its restore
    copied (None: never restored), "sharded": bool, "error": why it could not be read}."""
    from ratchet.runtime._shards import is_sharded

    if not target.is_dir():
        return None
    sharded = is_sharded(target)
    if not (target / DB_NAME).exists() and not sharded and not (target / JOB_FILE).exists():
        return None
    held: dict[str, Any] = {"job": None, "record": None, "sharded": sharded, "error": None}
    try:
        held["job"] = _read_job(target)[0]
        if (target / DB_NAME).exists():
            store = SqliteStore.open_readonly(target)
            try:
                record = _meta(store.conn, store.path).get(SAVEPOINT_META)
            finally:
                store.close()
            held["record"] = record if isinstance(record, dict) else None
        elif sharded:
            held["record"] = _job_file_restore(target)
    except (StateError, sqlite3.Error) as exc:
        held["error"] = str(exc)
    return held


def _job_file_restore(target: Path) -> dict[str, Any] | None:
    """The savepoint record a restore wrote into `target`'s job.json (None: none there)."""
    try:
        data = json.loads((target / JOB_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    record = data.get("restored_from") if isinstance(data, dict) else None
    return record if isinstance(record, dict) else None


def _used_error(
    target: Path, sp: Path, stored: dict[str, Any], held: dict[str, Any] | None
) -> StateError:
    """The refusal to restore into a `target` that is not empty. A target holding a ratchet
    state may hold committed work (the job restored there before and run on): the fix named
    never empties it."""
    new = (
        f"restore {sp} into a new --state directory (one that does not exist yet, or an empty one)"
    )
    if held is None:
        if target.is_dir() and not target.is_symlink():
            return StateError(
                f"{target} is not empty; {new}, or empty {target} first (it holds no ratchet state)"
            )
        return StateError(f"{target} exists and is not a plain directory; {new}")
    job = f"job {held['job']}" if held["job"] else "a job"
    resume = f"resume it with the same command without --from-savepoint, or {new}"
    if held["error"] is not None:
        return StateError(
            f"{target} is not empty: it holds a ratchet state that could not be read "
            f"({held['error']}); {new}"
        )
    if held["sharded"] and held["record"] is None:
        return StateError(
            f"{target} is not empty: it holds the sharded state of {job}, which records no "
            f"restore of {sp}; {resume}"
        )
    other = held["record"]
    if other == stored:
        return StateError(
            f"{target} is not empty: it holds {job}, restored from {sp} before and maybe run "
            f"on since; resume it (`ratchet run ... --state {target}`, with or without "
            f"--from-savepoint), or {new}"
        )
    if other is None:
        return StateError(
            f"{target} is not empty: it holds the state of {job}, never restored from a "
            f"savepoint; {resume}"
        )
    return StateError(
        f"{target} is not empty: it holds {job} restored from another savepoint (of "
        f"{other.get('state_dir')}, checkpoint #{other.get('checkpoint_id')}, taken "
        f"{iso_utc(other.get('taken_at'))}), not from {sp}; {resume}"
    )


def _restore(
    sp: Path, target: Path, stored: dict[str, Any], counts: dict[str, int], clock: Clock
) -> dict[str, Any]:
    _refuse_here(target, "--state")
    record = _described(sp, stored, counts)
    job = record.get("job")
    if job is not None and not isinstance(job, str):
        raise StateError(f"{sp}: the savepoint names the job {job!r}, which is not a job id")
    try:
        with _Staging(target, "restore", directory=True) as staging:
            db = staging.path / DB_NAME
            source = _open_ro(sp)
            try:
                dest = _copy_into(source, db)
            finally:
                source.close()
            try:
                _check(
                    dest,
                    f"the copy of savepoint {sp}",
                    False,
                    f"nothing was restored at {target}; the savepoint passed its check, so "
                    "suspect the disk: check it and run again, or restore another savepoint",
                )
                _meta(dest, db)
            finally:
                dest.close()
            if job is not None:
                atomic_json(
                    staging.path / JOB_FILE,
                    {
                        "format": _JOB_FORMAT,
                        "job": job,
                        "created": clock.now(),
                        "legacy_outputs": bool(record.get("legacy_outputs", False)),
                        # Kept here too: re-sharding (--workers N) leaves no top database,
                        # and its shards no meta of the restore; this file stays.
                        "restored_from": stored,
                    },
                )
                # Read back as the engine will read it: a format drift fails here, not later.
                if job_identity(staging.path, has_history=True, clock=clock).id != job:
                    raise InternalError(f"{staging.path / JOB_FILE} did not read back as job {job}")
            staging.place()
    except (sqlite3.Error, OSError) as exc:
        raise _copy_failed(f"restoring {sp} into {target}", exc) from exc
    return dict(record, state_dir=str(target.resolve()), savepoint=str(sp.resolve()))


# -- forks -----------------------------------------------------------------------------------------


def _key_text(blob: bytes, where: str) -> str:
    """A stored key as the engine writes its text (`str(key)`)."""
    try:
        return str(codec.decode(blob, unknown="generic"))
    except (CorruptDataError, CodecError) as exc:
        raise StateError(f"{where}: a stored key cannot be decoded ({exc}); it is damaged") from exc


def _blob_type(blob: bytes, text: str) -> str:
    """Which of the two keys of `text` a stored key is: 'int' for the integer key, else 'str'
    (as signals and traces record it; a key of another type reads as neither)."""
    return "int" if int_text(text) and blob == codec.encode(int(text)) else "str"


def _keep_only(
    conn: sqlite3.Connection, selected: list[str], where: Path, key_type: str = "auto"
) -> tuple[dict[str, int], dict[str, str]]:
    """Delete, in one transaction, every row that belongs to a key not in `selected` (keys by
    their text, as `ratchet inspect` shows them, and `key_type`: which of the two keys of a
    text like "1" each is); the rows removed per table, and each text's type kept.
    ConfigError naming the keys the state does not hold, or a text whose two keys it holds
    when `key_type` is "auto"."""
    tables = _tables(conn)
    unknown_tables = sorted(
        name
        for name, cols in tables.items()
        if name not in (*_PER_KEY, *_PER_INPUT, *_PER_KEY_TEXT, *_WHOLE, "outbox")
        and _KEYED_COLUMNS & set(cols)
    )
    if unknown_tables:
        raise StateError(
            f"{where} has table(s) {', '.join(unknown_tables)} that this ratchet cannot split by "
            f"key; fork all keys (without --key), or use the ratchet version that wrote the state"
        )
    texts: dict[bytes, str] = {}
    for name in _PER_KEY:
        cols = tables.get(name)
        if cols is None:
            continue
        if "key_text" in cols:
            for blob, text in conn.execute(f"SELECT DISTINCT key, key_text FROM {_q(name)}"):
                texts.setdefault(bytes(blob), str(text))
        else:
            for (blob,) in conn.execute(f"SELECT DISTINCT key FROM {_q(name)}"):
                if bytes(blob) not in texts:
                    texts[bytes(blob)] = _key_text(bytes(blob), f"{where} table {name}")
    # Every key by (text, type): the integer key 1 and the string key "1" are two.
    known = {(text, _blob_type(blob, text)) for blob, text in texts.items()}
    wanted: set[tuple[str, str]] = set()
    unknown = []
    for text in selected:
        held = {t for k, t in known if k == text}
        typed = chosen_key_type(
            text,
            key_type,
            held.copy,
            where.parent,
            "say which one to fork (--key-type str or --key-type int)",
        )
        if typed is None or (text, typed) not in known:
            unknown.append(repr(text) if typed is None else f"{text!r} ({typed})")
        else:
            wanted.add((text, typed))
    if unknown:
        listed = sorted(known)
        shown = ", ".join(repr(int(k) if t == "int" else k) for k, t in listed[:20]) + (
            ", ..." if len(listed) > 20 else ""
        )
        raise ConfigError(
            f"--key {', '.join(unknown)}: no such key in the state of "
            f"{where.parent} (as of its latest checkpoint); it holds {len(listed)} key(s): "
            f"{shown or 'none'}; `ratchet inspect --state {where.parent}` lists them"
        )
    keep = [(blob,) for blob, text in texts.items() if (text, _blob_type(blob, text)) in wanted]
    wanted_texts = sorted({text for text, _ in wanted})
    removed: dict[str, int] = {}
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("CREATE TEMP TABLE keep_keys(key BLOB PRIMARY KEY)")
        conn.executemany("INSERT INTO temp.keep_keys(key) VALUES (?)", keep)
        for name in _PER_KEY:
            if name in tables:
                cur = conn.execute(
                    f"DELETE FROM main.{_q(name)} WHERE key NOT IN (SELECT key FROM temp.keep_keys)"
                )
                removed[name] = max(cur.rowcount, 0)
        for name in _PER_KEY_TEXT:
            if name in tables:
                marks = ", ".join("?" for _ in wanted_texts) or "NULL"
                cur = conn.execute(
                    f"DELETE FROM main.{_q(name)} WHERE key_text NOT IN ({marks})", wanted_texts
                )
                removed[name] = max(cur.rowcount, 0)
                if "key_type" in tables[name]:
                    # A typed row of the other key of a kept text goes too (an untyped one,
                    # kept from before types were, is either key's: it stays).
                    cur = conn.execute(
                        f"DELETE FROM main.{_q(name)} WHERE key_type IS NOT NULL AND "
                        f"key_text || ':' || key_type NOT IN "
                        f"({', '.join('?' for _ in wanted) or 'NULL'})",
                        sorted(f"{text}:{t}" for text, t in wanted),
                    )
                    removed[name] += max(cur.rowcount, 0)
        # A call record belongs to the run of its input. One whose input is not in the state
        # (admitted after the latest checkpoint) cannot be placed: it goes, so the fork makes
        # that call again rather than trust a record that may be another key's.
        for name in _PER_INPUT:
            if name in tables:
                cur = conn.execute(
                    f"DELETE FROM main.{_q(name)} WHERE seq NOT IN (SELECT seq FROM main.inputs)"
                )
                removed[name] = max(cur.rowcount, 0)
        if "outbox" in tables:
            kept_seqs = {int(s) for (s,) in conn.execute("SELECT seq FROM main.inputs")}
            gone = []
            for out_id, seq, blob in conn.execute("SELECT id, seq, record FROM main.outbox"):
                if int(seq) in kept_seqs:
                    continue
                try:
                    rec = codec.decode(bytes(blob), unknown="generic")
                except (CorruptDataError, CodecError) as exc:
                    raise StateError(
                        f"{where}: the unreleased output {out_id} cannot be decoded ({exc})"
                    ) from exc
                if not isinstance(rec, dict) or "key" not in rec:
                    raise StateError(f"{where}: the unreleased output {out_id} names no key")
                if (str(rec["key"]), signal_key_type(rec["key"])) not in wanted:
                    gone.append((out_id,))
            conn.executemany("DELETE FROM main.outbox WHERE id = ?", gone)
            removed["outbox"] = len(gone)
        conn.execute("DROP TABLE temp.keep_keys")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return removed, {text: t for text, t in sorted(wanted)}


def fork_state(
    state_dir: str | os.PathLike[str],
    to: str | os.PathLike[str],
    keys: Sequence[str] | None = None,
    clock: Clock = SYSTEM_CLOCK,
    key_type: str = "auto",
) -> dict[str, Any]:
    """Copy the state in `state_dir` into a new job at `to` (which must not exist, or be empty).

    All keys, or only those whose text (as `ratchet inspect` shows keys) is in `keys`, of
    `key_type` ("str", "int", or "auto": for each text, the key of it the state holds, refused
    when it holds both the string key "1" and the integer key 1): every
    row of the other keys is left out (memory, queued and in-flight inputs, their call records
    and unreleased outputs, dead letters). The fork gets a new job id: it is a different job,
    so its outputs go to a new output file (or are appended with --append-output). Its source
    position is the original's: it reads on from the same input; inputs of keys it does not
    hold start those keys anew. Works while a job owns `state_dir`. Returns what was copied.
    """
    sdir = Path(state_dir)
    target = Path(to)
    _require_state(sdir)
    _refuse_here(target, "--to")
    _require_empty(target, "fork into")
    selected = None if keys is None else list(dict.fromkeys(str(k) for k in keys))
    source_job, _legacy = _read_job(sdir)
    store = SqliteStore.open_readonly(sdir)
    try:
        with _Staging(target, "fork", directory=True) as staging:
            db = staging.path / DB_NAME
            try:
                dest = _copy_into(store.conn, db)
            finally:
                store.close()
            try:
                _meta(dest, sdir / DB_NAME)
                before = _describe(dest)
                checkpoint_id = _latest_checkpoint(dest)
                removed, types = (
                    ({}, {})
                    if selected is None
                    else _keep_only(dest, selected, sdir / DB_NAME, key_type)
                )
                _set_meta(
                    dest,
                    FORK_META,
                    {
                        "format": 1,
                        "at": clock.now(),
                        "state_dir": str(sdir.resolve()),
                        "job": source_job,
                        "checkpoint_id": checkpoint_id,
                        "keys": selected,
                        "key_types": types or None,
                    },
                )
                if any(removed.values()):
                    dest.execute("VACUUM")  # a fork of a few keys should not keep all the pages
                _check(
                    dest,
                    f"the copy of {sdir / DB_NAME}",
                    False,
                    _copy_damaged(sdir / DB_NAME, target),
                )
                after = _describe(dest)
                kept = sorted(str(t) for (t,) in dest.execute("SELECT key_text FROM keys"))
            finally:
                dest.close()
            job = job_identity(staging.path, has_history=False, clock=clock)
            staging.place()
    except (sqlite3.Error, OSError) as exc:
        raise _copy_failed(f"forking {sdir} into {target}", exc) from exc
    finally:
        store.close()
    return {
        "from": str(sdir.resolve()),
        "from_job": source_job,
        "to": str(target.resolve()),
        "job": job.id,
        "checkpoint_id": checkpoint_id,
        "selected_keys": selected,
        # Which key of each text (the integer key 1 or the string key "1"; --key-type).
        "selected_key_types": None if selected is None else [types[k] for k in selected],
        "keys_with_memory": kept,
        "source_counts": before,
        **after,
        "removed_rows": removed,
    }


# -- listing ---------------------------------------------------------------------------------------


def _read_log(state_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """The savepoints listed in `savepoints.jsonl` (with whether each file still exists) and
    how many lines could not be read (e.g. one cut by a kill)."""
    try:
        text = (state_dir / SAVEPOINTS_LOG).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return [], 0
    entries: list[dict[str, Any]] = []
    bad = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            bad += 1
            continue
        taken = entry.get("taken_at")
        entry["taken_at_iso"] = iso_utc(taken) if isinstance(taken, int | float) else None
        entry["exists"] = Path(entry["path"]).is_file()
        entries.append(entry)
    return entries, bad


def list_checkpoints(state_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoints a state retains (statistics of the latest ones; only the latest is
    restorable) and the savepoints taken of it. Read-only; works while a job runs."""
    sdir = Path(state_dir)
    _require_state(sdir)
    store = SqliteStore.open_readonly(sdir)
    try:
        conn = store.conn
        try:
            conn.execute("BEGIN")  # one read transaction: rows and counts of one moment
            rows = conn.execute(
                "SELECT id, triggered_at, duration_ms, size_bytes FROM checkpoints ORDER BY id"
            ).fetchall()
            meta = _meta(conn, store.path)
            conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            raise StateError(f"{store.path} could not be read ({exc})") from exc
    finally:
        store.close()
    latest = int(rows[-1][0]) if rows else None
    job, _legacy = _read_job(sdir)
    savepoints, bad = _read_log(sdir)
    return {
        "state_dir": str(sdir.resolve()),
        "agent": meta.get("agent_name"),
        "job": job,
        "counts": meta.get("counts"),
        "latest_restored": meta.get("latest_restored"),
        "restorable_checkpoint": latest,
        "note": RESTORABLE_NOTE.format(state=sdir),
        "checkpoints": [
            {
                "id": int(cid),
                "triggered_at": triggered,
                "time": iso_utc(triggered),
                "duration_ms": duration,
                "size_bytes": size,
                "restorable": int(cid) == latest,
            }
            for cid, triggered, duration, size in rows
        ],
        "savepoints": savepoints,
        "unreadable_savepoint_lines": bad,
    }
