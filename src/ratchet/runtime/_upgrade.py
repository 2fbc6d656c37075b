"""Operations on a stopped job's state for upgrades: `ratchet migrate` and `ratchet runs`.

Each takes the job's locks (a running job, or the supervisor of one, holds them, so they refuse
to run beside one: also while a supervisor is between two workers) and
changes the state in transactions that are whole or absent after a kill.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import StateError, StateInUseError
from ratchet.runtime._dispatch import Binding
from ratchet.runtime._journal import decode_memory, decoded, encode_memory
from ratchet.runtime._shards import chosen_key_type, read_layout
from ratchet.store import codec
from ratchet.store._base import int_text, signal_key_type
from ratchet.store._sqlite import (
    DB_NAME,
    LOCK_NAME,
    SUPERVISOR_LOCK_NAME,
    SqliteStore,
    StateLock,
    state_dir_error,
)

MIGRATE_BATCH = 256


@contextlib.contextmanager
def stopped_state(
    state_dir: str | os.PathLike[str], clock: Clock = SYSTEM_CLOCK, *, whole_job: bool = True
) -> Iterator[SqliteStore]:
    """The state of a job that is not running, locked for as long as the block runs.

    `whole_job` False: a shard's directory, whose job's locks the caller holds already."""
    sdir = Path(state_dir)
    if not (sdir / DB_NAME).exists():
        raise StateError(f"no ratchet state in {sdir} ({sdir / DB_NAME} does not exist)")
    # Read-only first: an empty or foreign file is refused as `status` refuses it, before a
    # writer would build a new state in it (or a lock file is left beside it).
    SqliteStore.open_readonly(sdir).close()
    with _job_stopped(sdir) if whole_job else _locked(sdir, LOCK_NAME):
        store = SqliteStore.open(sdir, "", "", [], clock=clock)
        try:
            yield store
        finally:
            store.close()


@dataclass
class MigrateResult:
    migrated: int = 0
    to_version: int = 1
    waiting: list[str] = field(default_factory=list)  # keys with a run in flight: lazily
    upgraded_from: str | None = None


def migrate_state(
    state_dir: str | os.PathLike[str],
    binding: Binding,
    *,
    on_progress: Callable[[int, int], None] | None = None,
    clock: Clock = SYSTEM_CLOCK,
    batch: int = MIGRATE_BATCH,
) -> MigrateResult:
    """`_migrate_one` on the state, or on every shard of a sharded job in turn (each key lives
    in one shard, and each shard keeps the same whole-or-absent batches)."""
    layout = read_layout(state_dir)
    if layout.workers == 1:
        return _migrate_one(state_dir, binding, on_progress, clock, batch)
    total = MigrateResult(to_version=binding.memory_version)
    with _job_stopped(Path(state_dir)):
        for d in layout.dirs:
            if not (d / DB_NAME).exists():
                continue
            one = _migrate_one(d, binding, on_progress, clock, batch, whole_job=False)
            total.migrated += one.migrated
            total.waiting += one.waiting
            total.upgraded_from = total.upgraded_from or one.upgraded_from
    return total


@contextlib.contextmanager
def _job_stopped(sdir: Path) -> Iterator[None]:
    """Both locks of a job's directory: the supervisor's, which a supervised job holds also
    while its worker is down between restarts (its new worker would be refused the engine's
    lock and the supervisor would give up), then the engine's (a job running, or the
    coordinator of a sharded one)."""

    def supervised(holder: str) -> StateError:
        pid = holder.removeprefix("pid ")
        return StateInUseError(
            f"state directory {sdir} belongs to a supervised job: its supervisor, {holder} "
            f"({SUPERVISOR_LOCK_NAME}), restarts its worker whenever it stops; stop the job "
            f"first (kill -TERM {pid}: the worker takes a final checkpoint and both exit), "
            f"then run this again",
            holder,
        )

    with _locked(sdir, SUPERVISOR_LOCK_NAME, supervised), _locked(sdir, LOCK_NAME):
        yield


@contextlib.contextmanager
def _locked(
    sdir: Path, name: str, busy: Callable[[str], StateError] | None = None
) -> Iterator[None]:
    """One lock file of `sdir`; one that cannot be opened is a one-line StateError."""
    lock = StateLock(sdir, name, busy)
    try:
        lock.acquire()  # held by another process: refused, naming its pid
    except OSError as exc:
        raise state_dir_error(sdir, exc) from exc  # as `ratchet run` says it
    try:
        yield
    finally:
        lock.release()


def _migrate_one(
    state_dir: str | os.PathLike[str],
    binding: Binding,
    on_progress: Callable[[int, int], None] | None,
    clock: Clock,
    batch: int,
    *,
    whole_job: bool = True,
) -> MigrateResult:
    """Bring every key's memory to the agent's `memory_version` now, instead of lazily.

    The agent is adopted (as `ratchet run` would) just before the first batch is written, or
    at the end when there is none: a migration that is missing or raises in the first batch
    leaves the state as it was, still the previous agent's. Keys are migrated in batches,
    each written in one transaction: a kill loses at most the batch in progress, which the
    next `migrate` (or run) does again from the old memory; no key is migrated twice or half.
    Keys with a run in flight keep their memory until that run completes (it resumes on it).
    A migration that raises stops here: the batches before it are kept, its batch is not.
    """
    target = binding.memory_version
    result = MigrateResult(to_version=target)
    with stopped_state(state_dir, clock, whole_job=whole_job) as store:
        # Refusals (another agent's state, memory newer than the agent's) before anything.
        result.upgraded_from = store.adopt(binding.version, dry_run=True).upgraded_from
        adopted = False
        total, busy = store.keys_to_migrate(target)
        done = 0
        after: bytes | None = None
        if on_progress is not None:
            on_progress(0, total)
        while True:
            rows = store.old_memories(target, after, batch)
            if not rows:
                break
            after = rows[-1][0]
            out = []
            for k, _nd, mem, version in rows:
                done += 1
                key = decoded("keys", k, codec.decode, k)
                if k in busy:
                    result.waiting.append(str(key))
                    continue
                memory = decoded("keys", key, decode_memory, mem)
                new = binding.migrate(key, memory, version)
                out.append((k, version, encode_memory(new), target))
            if out:
                if not adopted:
                    # Keys at the new memory version belong to the new agent. (A kill between
                    # the two transactions leaves it adopted with this batch to do again.)
                    store.adopt(binding.version)
                    adopted = True
                store.put_migrated(out)
                result.migrated += len(out)
            if on_progress is not None:
                on_progress(done, total)
        if not adopted:
            store.adopt(binding.version)
    return result


def find_run(
    store: SqliteStore, key: str, seq: int | None, key_type: str | None = None
) -> dict[str, Any]:
    """The in-flight run of `key` (by its text; of `key_type` 'str' or 'int' when given, as
    `run_key_type` chose it), or of input `seq` of that key."""
    runs = store.runs_in_flight()
    mine = [r for r in runs if _is_key(r, key, key_type)]
    if seq is not None:
        mine = [r for r in mine if r["seq"] == seq]
    if not mine:
        held = ", ".join(f"{_shown(r)} (input {r['seq']})" for r in runs[:10]) or "none"
        what = _typed(key, key_type) + (f" input {seq}" if seq is not None else "")
        raise StateError(
            f"{store.path.parent} has no run in flight for {what}; runs in flight: {held} "
            f"(`ratchet runs list --state {store.path.parent}` lists them all)"
        )
    return mine[0]


def _is_key(run: dict[str, Any], text: str, key_type: str | None) -> bool:
    return str(run["key"]) == text and key_type in (None, signal_key_type(run["key"]))


def _typed(text: str, key_type: str | None) -> str:
    return f"key {text!r}" if key_type is None else f"the {key_type} key {text!r}"


def _shown(run: dict[str, Any]) -> str:
    """A run's key as the messages show it: the integer key 7 and the string key "7" apart."""
    text = str(run["key"])
    return f"{text} ({signal_key_type(run['key'])})" if int_text(text) else text


def run_key_type(
    runs: list[dict[str, Any]], text: str, seq: int | None, key_type: str, where: Path | str
) -> str | None:
    """Which of the two keys of a text like "7" `runs restart`/`abandon --key` mean (`runs`:
    those in flight): as `ratchet signal` decides it (`chosen_key_type`), from the runs in
    flight, so a state with runs of both keys is refused until --key-type says which (it
    took whichever was listed first). With `seq`, which names one run, it is that run's key."""
    return chosen_key_type(
        text,
        key_type,
        lambda: {
            signal_key_type(r["key"])
            for r in runs
            if str(r["key"]) == text and seq in (None, r["seq"])
        },
        where,
        "say which run (--key-type str or --key-type int; `ratchet runs list` shows each "
        "one's key type)",
    )


def discard_run(
    state_dir: str | os.PathLike[str],
    key: str,
    seq: int | None,
    *,
    dead_letter_reason: str | None = None,
    key_type: str = "auto",
    clock: Clock = SYSTEM_CLOCK,
) -> dict[str, Any]:
    """`runs restart` (no reason) or `runs abandon` (a reason): what was discarded. Of a
    sharded job: in the shard whose runs hold it. `key_type`: which of the keys of a text
    like "7" (`run_key_type`)."""
    layout = read_layout(state_dir)
    if layout.workers == 1:
        with stopped_state(state_dir, clock) as store:
            typed = run_key_type(store.runs_in_flight(), key, seq, key_type, Path(state_dir))
            run = find_run(store, key, seq, typed)
            counts = store.discard_run(run["seq"], dead_letter_reason)
        return {"key": str(run["key"]), "key_type": signal_key_type(run["key"]), "seq": run["seq"],
                **counts}  # fmt: skip
    with _job_stopped(Path(state_dir)):
        dirs = [d for d in layout.dirs if (d / DB_NAME).exists()]
        flying: list[dict[str, Any]] = []
        for d in dirs:  # every shard's: the string key "7" and the integer key 7 may be in two
            reader = SqliteStore.open_readonly(d)
            try:
                flying += reader.runs_in_flight()
            finally:
                reader.close()
        typed = run_key_type(flying, key, seq, key_type, Path(state_dir))
        for d in dirs:
            with stopped_state(d, clock, whole_job=False) as store:
                try:
                    run = find_run(store, key, seq, typed)
                except StateError:
                    continue
                counts = store.discard_run(run["seq"], dead_letter_reason)
            return {"key": str(run["key"]), "key_type": signal_key_type(run["key"]),
                    "seq": run["seq"], "shard": d.name, **counts}  # fmt: skip
    what = _typed(key, typed) + (f" input {seq}" if seq is not None else "")
    raise StateError(
        f"no shard of {state_dir} has a run in flight for {what} (`ratchet runs list --state "
        f"{state_dir}` lists them all)"
    )


def list_runs(state_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Runs in flight and dead letters; read-only, so it works while the job runs. Of a
    sharded job: every shard's (each run with its `shard`), in input order."""
    from ratchet.runtime._deadletters import list_dead_letters

    runs: list[dict[str, Any]] = []
    layout = read_layout(state_dir)
    for d in layout.dirs:
        if layout.workers > 1 and not (d / DB_NAME).exists():
            continue
        store = SqliteStore.open_readonly(d)
        try:
            found = store.runs_in_flight()
        finally:
            store.close()
        if layout.workers > 1:
            for r in found:
                r["shard"] = d.name
        runs += found
    runs.sort(key=lambda r: r["seq"])
    return {"in_flight": runs, "dead_letters": list_dead_letters(state_dir)}
