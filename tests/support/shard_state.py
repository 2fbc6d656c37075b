"""What a killed `ratchet run` (one process or `--workers N`) left committed in its state."""

from __future__ import annotations

from pathlib import Path

from ratchet.runtime._multiproc import wait_for_lock
from ratchet.runtime._shards import read_layout, shard_of, state_dirs
from ratchet.store import codec
from ratchet.store._sqlite import SqliteStore


def committed(
    state: Path, keys: int
) -> tuple[set[int], set[tuple[int, str]], set[tuple[int, str]]]:
    """Completed inputs, journaled tasks and recorded calls over every shard of `state`, for
    inputs keyed `k{seq % keys}` (how a shard tells which of the numbers below its position
    were its own)."""
    done: set[int] = set()
    journaled: set[tuple[int, str]] = set()
    recorded: set[tuple[int, str]] = set()
    for sdir in state_dirs(state):
        store = SqliteStore.open_readonly(sdir)
        try:
            loaded = store.load()
        finally:
            store.close()
        if sdir == state:
            admitted = set(range(int(loaded.source.get("next_seq", 0))))
        else:  # shard i of n: its inputs below its position's "next"
            index, n = (int(x) for x in sdir.name.split("-of-"))
            below = int((loaded.source.get("position") or {}).get("next", 0))
            admitted = {s for s in range(below) if shard_of(f"k{s % keys}", n) == index}
        done |= admitted - {seq for seq, _, _ in loaded.inputs}
        for seq, _key, _base, journal in loaded.runs:
            for entry in codec.decode(journal):
                journaled.add((seq, entry[0]))
        recorded |= {(r.seq, r.task_id) for r in loaded.calls if r.status == "ok"}
    return done, journaled, recorded


def workers_gone(state: Path) -> None:
    """A killed coordinator's workers die with it (parent-death signal); wait until their
    shard locks are free before reading what they committed."""
    if (state / "shards" / "layout.json").exists():
        for d in read_layout(state).dirs:
            if d.exists():
                wait_for_lock(d)
