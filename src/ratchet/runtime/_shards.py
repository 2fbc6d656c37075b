"""Where a multi-process job keeps its shards, which shard a key belongs to, and re-sharding.

Layout of a state directory (`--state DIR`):

- one worker (the default): `DIR/ratchet.db`, exactly as a single-process job keeps it;
- N > 1 workers: `DIR/shards/layout.json` says N; shard i lives in `DIR/shards/<i>-of-<N>/`,
  an ordinary state directory (its own `ratchet.db` and lock) that holds only its keys.

`layout.json` is the one source of truth: it is written atomically, last, when the shards it
names are complete, so a re-sharding killed half-way leaves the old layout in force.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK
from ratchet._errors import ConfigError, InvalidArgumentError, StateError
from ratchet.store import codec
from ratchet.store._base import KEEPS_SIGNALS, CheckpointRows, signal_key_type
from ratchet.store._base import int_text as int_text  # where the runtime has read it from
from ratchet.store._files import atomic_json
from ratchet.store._sqlite import DB_NAME, SqliteStore

SHARDS_DIR = "shards"
LAYOUT_FILE = "layout.json"
_LAYOUT_FORMAT = 1
HASH_NAME = "blake2b-64"


def shard_of(key: Any, shards: int) -> int:
    """The shard of `key` among `shards`: stable across processes, runs and Python versions
    (not `hash()`, which is salted per process)."""
    if shards == 1:
        return 0
    if isinstance(key, str):
        raw = b"s" + key.encode("utf-8", "surrogatepass")
    elif isinstance(key, int) and not isinstance(key, bool):
        raw = b"i" + str(key).encode()
    else:
        raw = b"c" + codec.encode(key)
    digest = hashlib.blake2b(raw, digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def shard_dir(state_dir: Path, index: int, shards: int) -> Path:
    return state_dir / SHARDS_DIR / f"{index}-of-{shards}"


@dataclass(frozen=True)
class Layout:
    """How a state directory is split: `workers` shards at `dirs` (one: the directory itself)."""

    workers: int
    dirs: tuple[Path, ...]


def read_layout(state_dir: str | os.PathLike[str]) -> Layout:
    """The layout in force; a state without `shards/layout.json` is a single-process state.
    A layout naming a shard whose database is not there is refused (`lost_shards_error`)."""
    sdir = Path(state_dir)
    path = sdir / SHARDS_DIR / LAYOUT_FILE
    if sdir.exists() and not sdir.is_dir():
        raise StateError(
            f"--state {sdir} is a file, not a state directory; point --state at the directory "
            "a job wrote (or at a new one)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return Layout(1, (sdir,))
    except (OSError, ValueError) as exc:
        raise StateError(f"{path} cannot be read ({exc}); restore it from a backup") from exc
    n = data.get("workers") if isinstance(data, dict) else None
    if (
        not isinstance(data, dict)
        or data.get("format") != _LAYOUT_FORMAT
        or data.get("hash") != HASH_NAME
        or not isinstance(n, int)
        or n < 2
    ):
        raise StateError(
            f"{path} is not a shard layout this ratchet knows (format {_LAYOUT_FORMAT}, hash "
            f"{HASH_NAME}, workers >= 2); use the ratchet version that wrote it"
        )
    layout = Layout(n, tuple(shard_dir(sdir, i, n) for i in range(n)))
    lost = [d / DB_NAME if d.exists() else d for d in layout.dirs if not (d / DB_NAME).exists()]
    if lost:
        raise lost_shards_error(sdir, lost, n)
    return layout


def lost_shards_error(sdir: Path, lost: list[Path], workers: int | None) -> StateError:
    """A layout in force is never missing a shard: a re-sharding builds every shard it names
    (each with its database) before it writes `layout.json`. A shard gone, or a layout that
    names shards that are not there (edited), would have its keys' inputs redone and their
    durable calls repeated by a run that made it afresh, and a read command would show part
    of the job as all of it: refused, naming what is missing (`lost`) and the fix.
    `workers` None: the state has no layout, but its job has run (its job.json exists)."""
    shown = [str(p) for p in lost]
    what = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
    verb = "is" if len(shown) == 1 else "are"
    if workers is None:
        named = "its job.json exists"
    else:
        named = f"{SHARDS_DIR}/{LAYOUT_FILE} names {workers} shards"
    hint = ""
    # Only when none of the shards named is there: beside a shard lost from a layout in force,
    # whole shards of another number are the leftovers of an earlier change, not its state.
    others = _shard_sets(sdir, exclude=workers) if len(lost) == (workers or 1) else []
    if others:
        m = others[-1]
        hint = (
            f' ({sdir / SHARDS_DIR} holds the {m} whole shards of a job with "workers": {m}: '
            f"if {LAYOUT_FILE} was edited or removed, write that number back)"
        )
    gone = "its committed work is gone"
    if lost == [sdir / SHARDS_DIR / LAYOUT_FILE]:
        gone = "without it no shard's committed work is read"
    return StateError(
        f"{what} {verb} missing, but the job in {sdir} has run before ({named}): {gone}, "
        f"and a run would redo its inputs and repeat every durable call. Restore the state "
        f"directory from a backup{hint}; to start the job over, remove {sdir} and write to a "
        f"new output"
    )


def lost_layout_error(sdir: Path) -> StateError:
    """`lost_shards_error` of a state with no layout and no database whose job has run: what
    is missing is `layout.json` when whole shards are there, else the database."""
    gone = sdir / SHARDS_DIR / LAYOUT_FILE if _shard_sets(sdir, None) else sdir / DB_NAME
    return lost_shards_error(sdir, [gone], None)


def _shard_sets(sdir: Path, exclude: int | None) -> list[int]:
    """The numbers of workers M (other than `exclude`) whose every shard `i-of-M`, with its
    database, is in `sdir/shards`: what a layout that names none of them may have said."""
    try:
        names = [p.name for p in (sdir / SHARDS_DIR).iterdir() if p.is_dir()]
    except OSError:
        return []
    counts: dict[int, int] = {}
    for name in names:
        _, sep, m = name.partition("-of-")
        if sep and m.isdigit() and int(m) >= 2 and int(m) != exclude:
            counts[int(m)] = counts.get(int(m), 0) + 1
    return sorted(
        m
        for m, held in counts.items()
        if held >= m and all((shard_dir(sdir, i, m) / DB_NAME).exists() for i in range(m))
    )


def is_sharded(state_dir: str | os.PathLike[str]) -> bool:
    return (Path(state_dir) / SHARDS_DIR / LAYOUT_FILE).exists()


# Commands that act on one whole database and why they stay single-database (docs/operations.md).
_SINGLE_DATABASE = {
    "savepoint": "a savepoint is one SQLite file holding one consistent checkpoint; the shards "
    "checkpoint independently, so no single moment holds all of them",
    "fork": "a fork is made from one consistent copy of the state (a savepoint)",
    "checkpoints": "checkpoint ids and history are per database; `ratchet status` shows each "
    "shard's latest checkpoint",
}


def refuse_sharded(state_dir: str | os.PathLike[str], command: str) -> None:
    """Commands inherently about one database refuse a sharded job (exit 2), saying why and how
    to get a single database back, rather than act on one shard silently."""
    if command in _SINGLE_DATABASE and is_sharded(state_dir):
        n = read_layout(state_dir).workers
        raise ConfigError(
            f"{state_dir} is a job sharded over {n} workers (shards/layout.json); `ratchet "
            f"{command}` works on one database: {_SINGLE_DATABASE[command]}. Run the job once "
            f"with --workers 1 (it moves every key back into {state_dir}/ratchet.db at one "
            f"input position), use `ratchet {command}` there, then run on with --workers {n}"
        )


def in_force(state_dir: Path, target: Path) -> bool:
    """Whether the database directory `target` is part of the layout in force now: a writer
    from another process checks it inside its write transaction (see `frozen`)."""
    try:
        return target in read_layout(state_dir).dirs
    except StateError:
        return False


@contextmanager
def frozen(dirs: tuple[Path, ...]) -> Iterator[None]:
    """Hold the write lock of every database in `dirs` while the layout changes: a signal or a
    redrive request another process writes meanwhile waits, then finds (with `in_force`, in its
    own write transaction) that its shard is out of force and goes to the new one. Without this
    a row written after the quiet check and before the switch would be left in an old shard."""
    conns: list[sqlite3.Connection] = []
    try:
        for d in dirs:
            if (d / DB_NAME).exists():
                conn = sqlite3.connect(d / DB_NAME, timeout=60, isolation_level=None)
                conn.execute("BEGIN IMMEDIATE")
                conns.append(conn)
        yield
    finally:
        for conn in conns:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            conn.close()


# -- shard positions ---------------------------------------------------------------------------


def shard_position(source_meta: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
    """(next, from, at) of a shard's checkpointed source meta: every input of the shard below
    `next` is admitted; re-reading the job's source from `at` (input number `from`) gives every
    input at or after `next`."""
    pos = source_meta.get("position") or {}
    if not pos:
        return 0, 0, {}
    return int(pos["next"]), int(pos["from"]), dict(pos.get("at") or {})


def read_position(sdir: Path) -> tuple[int, int, dict[str, Any]]:
    if not (sdir / DB_NAME).exists():
        return 0, 0, {}
    store = SqliteStore.open_readonly(sdir)
    try:
        return shard_position(store.meta("source") or {})
    finally:
        store.close()


def _quiet(sdir: Path) -> str | None:
    """Why the shard at `sdir` cannot have its keys moved now (None: it can)."""
    if not (sdir / DB_NAME).exists():
        return None
    store = SqliteStore.open_readonly(sdir)
    try:
        s = store.summary()
        ltm = (
            store.conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name = 'ltm'").fetchone()[
                0
            ]
            and store.conn.execute("SELECT COUNT(*) FROM ltm").fetchone()[0]
        )
    finally:
        store.close()
    if s["in_flight_runs"] or s["queued_inputs"]:
        return (
            f"{s['in_flight_runs']} run(s) in flight and {s['queued_inputs']} queued input(s) "
            f"(runs waiting for a signal or a timer cannot move between shards)"
        )
    if s["unreleased_outputs"]:
        return f"{s['unreleased_outputs']} output(s) not yet released to the sink"
    if ltm:
        return "long-term memory (re-sharding does not move it yet)"
    return None


def _timers(store: SqliteStore) -> list[float]:
    """When the timers of the state's runs in flight fall due: sleeps not over, and delayed
    events (`send_event(delay=)`) not due yet."""
    return [
        float(w["until"] or 0)
        for w in store.waits()
        if w["on"] == "sleep" or str(w["on"]).startswith("delayed event ")
    ]


def check_no_timers(dirs: tuple[Path, ...], workers: int, current: int) -> None:
    """Before the old shards are finished: a run waiting on a durable timer (a sleep, a
    delayed event) cannot move between shards, and finishing would wait for it (silently, for
    as long as the timer: days for a reminder): refused now, naming when the last one is due."""
    import datetime

    for d in dirs:
        if not (d / DB_NAME).exists():
            continue
        store = SqliteStore.open_readonly(d)
        try:
            due = _timers(store)
        finally:
            store.close()
        if due:
            when = datetime.datetime.fromtimestamp(max(due), datetime.UTC)
            raise ConfigError(
                f"cannot change the number of workers to {workers}: {d} holds {len(due)} "
                f"durable timer(s) of runs in flight (a sleep or a delayed event; the last is "
                f"due at {when:%Y-%m-%d %H:%M:%S} UTC), which cannot move between shards. Run "
                f"the job with --workers {current} until they are due, then change it"
            )


def check_quiet(dirs: tuple[Path, ...], workers: int) -> None:
    for d in dirs:
        why = _quiet(d)
        if why is not None:
            raise ConfigError(
                f"cannot change the number of workers to {workers}: {d} holds {why}. Run the "
                f"job with its current number of workers until these are done, then change it"
            )
    _check_signals_placeable(dirs, workers)


def _check_signals_placeable(dirs: tuple[Path, ...], workers: int) -> None:
    """Signals not taken yet move with their key's text. A text like "42" whose key no shard
    holds could be the string or the integer key, which may land in different new shards:
    refused rather than guessed (the signal would wait in a shard its key never reaches)."""
    held: set[str] = set()
    pending: dict[str, Path] = {}
    for d in dirs:
        if not (d / DB_NAME).exists():
            continue
        store = SqliteStore.open_readonly(d)
        try:
            held.update(str(t) for (t,) in store.conn.execute("SELECT key_text FROM keys"))
            for p in store.pending_signals():
                if p.get("key_type") is None:  # a typed signal's key (and shard) is known
                    pending.setdefault(str(p["key"]), d)
        finally:
            store.close()
    for text, d in pending.items():
        if text in held or not int_text(text):
            continue
        if shard_of(text, workers) != shard_of(int(text), workers):
            raise ConfigError(
                f"cannot change the number of workers to {workers}: {d} holds a signal for key "
                f"{text!r}, which no shard holds yet, and the text {text!r} and the integer "
                f"{text} belong to different shards among {workers}. Run the job with its "
                f"current number of workers until a run of that key has taken the signal, then "
                f"change it"
            )


def reshard(
    state_dir: Path,
    old: Layout,
    workers: int,
    agent_name: str,
    fingerprint: str,
    actions: list[str],
    *,
    position: tuple[int, dict[str, Any]],
) -> Layout:
    """Move every key of the quiet state `old` into `workers` shards; returns the new layout.

    `position`: (n, at), where every shard of `old` stands: all inputs numbered below n are
    done, and `at` is the source's position after input n - 1 (the caller brought them there
    and checked they are quiet). Memory, traces and dead letters move with their key.
    Crash-safe: the new shards are built in directories the old layout does not name and put
    in force by one atomic step (N > 1: writing `layout.json`; 1: removing it, once
    `ratchet.db` is complete), then the old files go."""
    n, at = position
    if workers == 1:
        targets = [state_dir]
        source: dict[str, Any] = {"next_seq": n, "position": at} if at or n else {}
    else:
        targets = [shard_dir(state_dir, i, workers) for i in range(workers)]
        source = {"next_seq": n, "position": {"next": n, "from": n, "at": at}}
    for t in targets:
        # Left by a re-sharding killed before it took effect: nothing in force names it.
        if t != state_dir and t.exists():
            shutil.rmtree(t)
        elif t == state_dir:
            for name in (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm"):
                if (t / name).exists() and old.workers > 1:
                    (t / name).unlink()
    stores = [
        SqliteStore.open(
            t, agent_name, fingerprint, actions, synchronous="FULL", rebuild=t == state_dir
        )
        for t in targets
    ]
    try:
        moved: list[CheckpointRows] = [CheckpointRows(source=dict(source)) for _ in targets]
        texts: dict[str, Any] = {}  # key text -> key, to place rows that only name the text
        for d in old.dirs:
            if not (d / DB_NAME).exists():
                continue
            src = SqliteStore.open_readonly(d)
            try:
                for k, text, nd, mem, version in src.key_rows():
                    key = codec.decode(bytes(k), unknown="generic")
                    texts[str(text)] = key
                    i = shard_of(key, workers)
                    moved[i].keys.append((bytes(k), str(text), int(nd), bytes(mem), int(version)))
            finally:
                src.close()
        now = SYSTEM_CLOCK.now()  # when the keys moved in (`ratchet checkpoints` shows it)
        for store, rows in zip(stores, moved, strict=True):
            store.write_checkpoint(rows, now)
            store.mark_reshard_seed()
        for i, store in enumerate(stores):
            store.ensure_tables()  # a new shard makes traces on first use: they come now
            _copy_per_key_text(store.conn, old.dirs, _placer(texts, i, workers))
    finally:
        for store in stores:
            store.close()
    layout_path = state_dir / SHARDS_DIR / LAYOUT_FILE
    if workers == 1:
        layout_path.unlink(missing_ok=True)
    else:
        layout_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_json(layout_path, {"format": _LAYOUT_FORMAT, "hash": HASH_NAME, "workers": workers})
    # The old layout is out of force now: its files go.
    for d in old.dirs:
        if d == state_dir:
            for name in (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm"):
                if workers > 1:
                    (d / name).unlink(missing_ok=True)
        elif d not in targets:
            shutil.rmtree(d, ignore_errors=True)
    if workers == 1:
        shutil.rmtree(state_dir / SHARDS_DIR, ignore_errors=True)
    return read_layout(state_dir)


def _placer(texts: dict[str, Any], index: int, workers: int) -> Callable[[str, str | None], bool]:
    """Whether a row naming a key by its text belongs to shard `index`; a signal's or a
    trace's row also by the type of its key ('str' or 'int'; None: the key held of that text,
    if any)."""

    def mine(text: str, key_type: str | None = None) -> bool:
        key: Any = texts.get(text, text)
        if key_type == "int" and int_text(text):
            key = int(text)
        elif key_type == "str":
            key = text
        return shard_of(key, workers) == index

    return mine


def _copy_per_key_text(
    conn: sqlite3.Connection,
    dirs: tuple[Path, ...],
    mine: Callable[[str, str | None], bool],
) -> None:
    """Traces, dead letters and signals not taken yet of this shard's keys, from every old
    shard (in their order there: a key's signals keep the order they were sent in).

    A signal gets an id of this shard. So does one a failed or abandoned run took, which its
    dead letter keeps until its redrive puts it back (`redrive_signals`, with the id kept):
    the ids are given in one sequence, in the old shard's order, to the signals copied and to
    those kept (an id no signal of this shard has or will get). Kept with its old id, it could
    be put back under the id of another signal here, or after a signal of its key and name
    sent after it, and the redriven run would take that one first."""
    conn.create_function("ratchet_mine", 1, lambda t: 1 if mine(str(t), None) else 0)
    conn.create_function("ratchet_mine_typed", 2, lambda t, k: 1 if mine(str(t), k) else 0)
    # (old dead letter id, index in its detail's "signals") -> the id it has here
    renumbered: dict[tuple[int, int], int] = {}
    conn.create_function("ratchet_renumbered", 2, lambda i, d: _renumbered(renumbered, i, d))

    def mine_by_key(blob: bytes, text: str) -> int:
        """A dead letter by its exact key (its `key` column): the text "1" names two keys."""
        try:
            key = codec.decode(bytes(blob), unknown="generic")
        except Exception:  # noqa: BLE001 - a row that cannot be read goes by its text
            key = None
        key_type = signal_key_type(key) if type(key) in (str, int) else None
        return 1 if mine(str(text), key_type) else 0

    conn.create_function("ratchet_mine_key", 2, mine_by_key)
    for d in dirs:
        db = d / DB_NAME
        if not db.exists():
            continue
        conn.execute("ATTACH DATABASE ? AS old", (str(db),))
        try:
            # Deferred: it writes only main; IMMEDIATE would also ask for the write lock of the
            # attached old shard, which `frozen` holds for the whole change.
            conn.execute("BEGIN")
            renumbered.clear()
            for table in ("traces", "signals", "dead_letters"):
                cols = [r[1] for r in conn.execute(f"PRAGMA old.table_info({table})")]
                ours = {r[1] for r in conn.execute(f"PRAGMA main.table_info({table})")}
                cols = [c for c in cols if c in ours and c != "id"]
                if not cols:
                    continue
                names = ", ".join(cols)
                if "key_type" in cols:
                    where = "ratchet_mine_typed(key_text, key_type)"
                elif "key" in cols:
                    where = "ratchet_mine_key(key, key_text)"
                else:
                    where = "ratchet_mine(key_text)"
                if table == "signals":
                    _copy_signals(conn, names, where, renumbered)
                    continue
                picked = names
                if table == "dead_letters" and "detail" in cols:
                    picked = ", ".join(
                        "ratchet_renumbered(id, detail)" if c == "detail" else c for c in cols
                    )
                conn.execute(
                    f"INSERT OR IGNORE INTO main.{table}({names}) SELECT {picked} FROM "
                    f"old.{table} WHERE {where} ORDER BY rowid"
                )
            conn.execute("COMMIT")
        finally:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            conn.execute("DETACH DATABASE old")


def _kept_signals(conn: sqlite3.Connection) -> list[tuple[int, int, int]]:
    """The signals that the dead letters of this shard's keys in the attached old shard keep
    for their redrive (failed and abandoned runs'): (old id, dead letter id, index in its
    detail's "signals"). One kept without its id (taken before schema 13) is put back as a
    new signal anyway: not listed."""
    cols = {r[1] for r in conn.execute("PRAGMA old.table_info(dead_letters)")}
    if not {"id", "key", "key_text", "kind", "detail", "redriven_as"} <= cols:
        return []  # dead letters from before any kept a signal
    found = []
    for dead_id, blob in conn.execute(
        "SELECT id, detail FROM old.dead_letters WHERE ratchet_mine_key(key, key_text) AND "
        f"kind IN ({', '.join('?' * len(KEEPS_SIGNALS))}) AND detail IS NOT NULL AND "
        "redriven_as IS NULL",
        KEEPS_SIGNALS,
    ):
        detail = _decoded(blob)
        entries = detail.get("signals") if isinstance(detail, dict) else None
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            sid = entry.get("id") if isinstance(entry, dict) else None
            if type(sid) is int:
                found.append((sid, int(dead_id), i))
    return found


def _copy_signals(
    conn: sqlite3.Connection, names: str, where: str, renumbered: dict[tuple[int, int], int]
) -> None:
    """The attached old shard's signals of this shard's keys, and those its dead letters keep
    (`_kept_signals`), numbered here in one sequence in their old order: a kept one is given
    the id its redrive puts it back with (`renumbered`), which no signal here holds or will."""
    pending = conn.execute(
        f"SELECT rowid, {names} FROM old.signals WHERE {where} ORDER BY rowid"
    ).fetchall()
    kept = _kept_signals(conn)
    (last,) = conn.execute(
        "SELECT max(coalesce((SELECT seq FROM main.sqlite_sequence WHERE name = 'signals'), 0), "
        "coalesce((SELECT max(id) FROM main.signals), 0))"
    ).fetchone()
    ordered = sorted(
        [(int(row[0]), 0, tuple(row[1:])) for row in pending]
        + [(sid, 1, (dead_id, i)) for sid, dead_id, i in kept],
        key=lambda item: (item[0], item[1]),
    )
    marks = ", ".join("?" * (names.count(",") + 2))
    for _old_id, is_kept, what in ordered:
        last += 1
        if is_kept:
            renumbered[(int(what[0]), int(what[1]))] = last
        else:
            conn.execute(
                f"INSERT OR IGNORE INTO main.signals(id, {names}) VALUES ({marks})", (last, *what)
            )
    # AUTOINCREMENT gives no later signal an id at or below `last`: a kept one's stays its own.
    raised = conn.execute(
        "UPDATE main.sqlite_sequence SET seq = max(seq, ?) WHERE name = 'signals'", (last,)
    )
    if raised.rowcount == 0 and last:
        conn.execute("INSERT INTO main.sqlite_sequence(name, seq) VALUES ('signals', ?)", (last,))


def _decoded(blob: Any) -> Any:
    try:
        return codec.decode(bytes(blob), unknown="generic")
    except Exception:  # noqa: BLE001 - a detail that cannot be read is copied as it is
        return None


def _renumbered(renumbered: dict[tuple[int, int], int], dead_id: int, blob: Any) -> Any:
    """A dead letter's detail as copied into the new shard: the signals it keeps with the ids
    `_copy_signals` gave them here (`renumbered`); any other detail as it was."""
    if blob is None or not any(k[0] == dead_id for k in renumbered):
        return blob
    detail = _decoded(blob)
    if not isinstance(detail, dict):
        return blob
    for i, entry in enumerate(detail.get("signals") or []):
        sid = renumbered.get((dead_id, i))
        if sid is not None:
            entry["id"] = sid
    return codec.encode(detail)


# -- reading a sharded state ---------------------------------------------------------------------


def state_dirs(state_dir: str | os.PathLike[str]) -> list[Path]:
    """The directories that hold the state's databases: itself, or every shard that has one."""
    layout = read_layout(state_dir)
    if layout.workers == 1:
        return [Path(state_dir)]
    return [d for d in layout.dirs if (d / DB_NAME).exists()]


_SUMMED = ("keys", "in_flight_runs", "queued_inputs", "unreleased_outputs", "dead_letters",
           "runs_failed")  # fmt: skip
_LISTED = ("waiting", "paused", "pending_signals")


def sharded_summary(state_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """`ratchet status` of a sharded state: the shards' counts summed, their lists joined, and
    each shard's own summary under "shards"."""
    layout = read_layout(state_dir)
    per: list[dict[str, Any]] = []
    for d in layout.dirs:
        if not (d / DB_NAME).exists():
            continue
        store = SqliteStore.open_readonly(d)
        try:
            per.append(dict(store.summary(), shard=d.name))
        finally:
            store.close()
    if not per:
        raise StateError(f"no ratchet state in {state_dir}: none of its shards has a database")
    first = per[0]
    total: dict[str, Any] = {k: v for k, v in first.items() if k not in ("shard",)}
    total["state_db"] = [p["state_db"] for p in per]
    for name in _SUMMED:
        total[name] = sum(int(p[name]) for p in per)
    for name in _LISTED:  # each item says its shard
        total[name] = [dict(item, shard=p["shard"]) for p in per for item in p[name]]
    counts = {
        c: sum(int(p["checkpoints"]["counts"][c]) for p in per)
        for c in first["checkpoints"]["counts"]
    }
    latest = [
        p["checkpoints"]["latest_completed"] for p in per if p["checkpoints"]["latest_completed"]
    ]
    restored = [
        p["checkpoints"]["latest_restored"] for p in per if p["checkpoints"].get("latest_restored")
    ]
    total["checkpoints"] = {
        "counts": counts,
        "latest_completed": max(latest, key=lambda c: c["trigger_timestamp"]) if latest else None,
        "latest_restored": max(restored, key=lambda c: c.get("restored_at") or 0)
        if restored
        else None,
    }
    total["source"] = {p["shard"]: p["source"].get("position", {}).get("next") for p in per}
    total["workers"] = layout.workers
    total["shards"] = per
    return total


# -- acting on one key of a sharded state from another process -----------------------------------

KEY_TYPES = ("auto", "str", "int")


def chosen_key_type(
    text: str, key_type: str, held: Callable[[], set[str]], where: Path | str, say: str
) -> str | None:
    """Which of the two keys of a text like "1" a command given the text means: 'str' or
    'int' as asked (--key-type); for "auto", the one the state holds (`held()` gives the types
    it holds), None when it holds neither. A state holding both is refused, the message
    ending with `say` (how to name one): acting on both keys as one was the defect this
    prevents. The one decision of `ratchet signal`, `trace`, `redrive` and `fork`."""
    if key_type not in KEY_TYPES:
        raise InvalidArgumentError(
            f"key type must be one of {', '.join(KEY_TYPES)}, not {key_type!r}"
        )
    if key_type == "int" and not int_text(text):
        raise InvalidArgumentError(f"key {text!r} is not an integer (--key-type int)")
    if key_type != "auto":
        return key_type
    types = held()
    if len(types) > 1:
        raise InvalidArgumentError(
            f"{where} holds both the string key {text!r} and the integer key {text}: {say}"
        )
    return types.pop() if types else None


def _holds(sdir: Path, keys: list[Any]) -> bool:
    """Whether the shard at `sdir` holds any of `keys` (memory, a run, or a queued input)."""
    if not (sdir / DB_NAME).exists():
        return False
    store = SqliteStore.open_readonly(sdir)
    try:
        for key in keys:
            blob = codec.encode(key)
            for table in ("keys", "runs", "inputs"):
                if store.conn.execute(
                    f"SELECT 1 FROM {table} WHERE key = ? LIMIT 1", (blob,)
                ).fetchone():
                    return True
    finally:
        store.close()
    return False


def shard_for_text(state_dir: Path, layout: Layout, text: str, key_type: str = "auto") -> int:
    """The shard of the key whose text is `text` (as `ratchet inspect` shows keys).

    A text like "42" could be the string or the integer key of an input; `key_type` says which
    ("auto": whichever the shards hold; if the two forms hash to different shards, neither is
    held yet and nothing says which, it is refused rather than guessed)."""
    if key_type not in KEY_TYPES:
        raise ConfigError(f"key type must be one of {', '.join(KEY_TYPES)}, not {key_type!r}")
    forms: list[Any] = []
    if key_type in ("auto", "str"):
        forms.append(text)
    if key_type in ("auto", "int"):
        if int_text(text):
            forms.append(int(text))
        elif key_type == "int":
            raise ConfigError(f"key {text!r} is not an integer (--key-type int)")
    n = layout.workers
    places = {shard_of(f, n) for f in forms}
    if len(places) == 1:
        return places.pop()
    held = sorted({shard_of(f, n) for f in forms if _holds(layout.dirs[shard_of(f, n)], [f])})
    if len(held) == 1:
        return held[0]
    raise ConfigError(
        f"key {text!r} of the job sharded over {n} workers in {state_dir} could be the text "
        f"{text!r} (shard {shard_of(text, n)}) or the integer {text} (shard "
        f"{shard_of(int(text), n)}), and {'both are' if held else 'neither is'} held by its "
        f"shard; say which with `ratchet signal --key-type str` or `--key-type int` (or from Python: ratchet.send_signal with a str or an int key)"
    )


class Moved(Exception):
    """The database written to left the layout in force (the number of workers changed)."""


def write_in_force(state_dir: Path, target: Path, fn: Callable[[sqlite3.Connection], Any]) -> Any:
    """Run `fn` in one write transaction on `target`'s database, only if `target` is still part
    of the layout in force once the write lock is held (`frozen` holds it during a change of
    the number of workers); raises `Moved` otherwise, having written nothing."""
    path = target / DB_NAME
    uri = path.resolve().as_uri() + "?mode=rw"  # never creates a database that was removed
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=30, isolation_level=None)
    except sqlite3.Error as exc:
        if not in_force(state_dir, target):
            raise Moved from None
        raise StateError(f"could not open {path}: {exc}") from exc
    try:
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:
            if not in_force(state_dir, target):
                raise Moved from None
            raise
        if not in_force(state_dir, target):
            conn.execute("ROLLBACK")
            raise Moved
        out = fn(conn)
        conn.execute("COMMIT")
        return out
    except sqlite3.Error as exc:
        raise StateError(f"could not write to {path}: {exc}") from exc
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.close()


def global_id(local: int, shard: int, shards: int) -> int:
    """One id for a row of shard `shard` (dead letters): unique over the job, and the shard
    and local id come back from it (`local_id`)."""
    return local * shards + shard


def local_id(gid: int, shards: int) -> tuple[int, int]:
    """(shard, local id) of a `global_id`."""
    return gid % shards, gid // shards


REDRIVE_SEQ_BASE = 10**15  # far above any input number a coordinator gives, below 2**53 (JSON)


def first_redrive_seq(sdir: Path) -> int:
    """The number a shard gives the next input it redrives: above every input number its
    coordinator gives (those are the source's places), and above every redrive the shard (or,
    before a re-sharding, its keys' old shard: dead letters move with their key) committed, so
    a key's outputs never reuse an id."""
    if not (sdir / DB_NAME).exists():
        return REDRIVE_SEQ_BASE
    store = SqliteStore.open_readonly(sdir)
    try:
        highest = [
            store.conn.execute(sql).fetchone()[0]
            for sql in (
                "SELECT MAX(redriven_as) FROM dead_letters",
                "SELECT MAX(seq) FROM inputs",
                "SELECT MAX(seq) FROM runs",
            )
        ]
    except sqlite3.Error:
        highest = []  # an old schema without redrives: nothing redriven yet
    finally:
        store.close()
    return max([REDRIVE_SEQ_BASE - 1, *(int(h) for h in highest if h is not None)]) + 1
