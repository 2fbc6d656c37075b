"""Dead letters: inputs kept instead of lost — bad lines (`--on-bad-input dead-letter`), runs
that ended in an error, runs abandoned by `ratchet runs abandon` — and their redrive.

Redriving is asked for by marking rows (`ratchet redrive`, REST, `request_redrive`), from any
process, whether the job runs or not; the engine admits each marked dead letter as a new input
in the same checkpoint that records it as redriven, so a kill neither loses nor doubles one.
A sharded job keeps each dead letter in its key's shard; listings merge them with job-wide ids.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import ConfigError, StateError
from ratchet.runtime._shards import (
    Moved,
    chosen_key_type,
    global_id,
    local_id,
    read_layout,
    write_in_force,
)
from ratchet.runtime._signals import ensure_schema
from ratchet.store import codec
from ratchet.store._sqlite import DB_NAME, SqliteStore

DEAD_LETTERS_SCHEMA = 5


def list_dead_letters(state_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every dead letter, oldest first. Of a sharded job: every shard's, by time, each with
    its `shard` and an `id` unique over the job (what `redrive --id` takes)."""
    layout = read_layout(state_dir)
    if layout.workers == 1:
        store = SqliteStore.open_readonly(state_dir)
        try:
            return store.dead_letters()
        finally:
            store.close()
    letters: list[dict[str, Any]] = []
    for i, d in enumerate(layout.dirs):
        if not (d / DB_NAME).exists():
            continue
        store = SqliteStore.open_readonly(d)
        try:
            for letter in store.dead_letters():
                letter["id"] = global_id(int(letter["id"]), i, layout.workers)
                letter["shard"] = d.name
                letters.append(letter)
        finally:
            store.close()
    letters.sort(key=lambda d: (d["at"], d["id"]))
    return letters


def request_redrive(
    state_dir: str | os.PathLike[str],
    *,
    all_letters: bool = False,
    key: str | int | None = None,
    dead_id: int | None = None,
    clock: Clock = SYSTEM_CLOCK,
    key_type: str | None = None,
) -> dict[str, Any]:
    """Mark dead letters to be admitted again (all, a key's, or one); what was marked.

    Of a sharded job: in the shard that holds each (its worker admits it); `dead_id` is the
    job-wide id `list_dead_letters` shows. The integer key 1 and the string key "1" are two
    keys: `key_type` ("str", "int" or "auto": the one the state holds, refused when it holds
    both) says which a key given as text is; None takes the type of `key` itself, as
    `send_signal` does, except that a str key is taken as "auto" (the CLI and REST give text)."""
    if sum((all_letters, key is not None, dead_id is not None)) != 1:
        raise ConfigError("redrive takes exactly one of --all, --key KEY or --id ID")
    sdir = Path(state_dir)
    layout = read_layout(sdir)
    targets: list[tuple[Path, int | None]] = [(d, dead_id) for d in layout.dirs]
    if layout.workers > 1 and dead_id is not None:
        shard, local_in_shard = local_id(dead_id, layout.workers)
        targets = [(layout.dirs[shard], local_in_shard)]
    if layout.workers == 1 and not (sdir / DB_NAME).exists():
        raise StateError(f"no ratchet state in {sdir} ({sdir / DB_NAME} does not exist)")
    typed_key: Any = None
    if key is not None:
        typed_key = _typed_key(
            sdir, [d for d in layout.dirs if (d / DB_NAME).exists()], key, key_type
        )
    marked = bad = 0
    for target, local in targets:
        if not (target / DB_NAME).exists():
            continue
        ensure_schema(target, DEAD_LETTERS_SCHEMA, "dead letters", sdir)
        try:
            m, b = write_in_force(sdir, target, _marker(key, typed_key, local, clock.now()))
        except Moved:
            raise StateError(
                f"the number of workers of {sdir} changed while dead letters were marked "
                f"({marked} marked so far); run the redrive again (marking twice is harmless)"
            ) from None
        marked += m
        bad += b
    if dead_id is not None and marked == 0 and bad == 0:
        raise ConfigError(
            f"--id {dead_id}: no dead letter with that id waits for a redrive in {sdir} "
            f"(`ratchet dead-letters --state {sdir}` lists them)"
        )
    return {"marked": marked, "bad_lines_skipped": bad, "state": str(sdir)}


def _typed_key(sdir: Path, dirs: list[Path], key: str | int, key_type: str | None) -> Any:
    """The key `redrive --key` means, as the state stores it (the str or the int of its
    text); None when the state holds neither (then no dead letter is of it)."""
    text = str(key)
    if key_type is None:
        key_type = "int" if isinstance(key, int) and not isinstance(key, bool) else "auto"

    def held() -> set[str]:
        # Over every shard: the string key "1" and the integer key 1 may live in two.
        types: set[str] = set()
        for d in dirs:
            store = SqliteStore.open_readonly(d)
            try:
                types |= store.held_key_types(text) | store.dead_letter_key_types(text)
            finally:
                store.close()
        return types

    typed = chosen_key_type(
        text,
        key_type,
        held,
        sdir,
        "say whose dead letters to redrive (--key-type str or --key-type int; REST: "
        '{"key": K, "key_type": "int"}; `ratchet dead-letters` shows each one\'s key type)',
    )
    if typed is None:
        return None
    return int(text) if typed == "int" else text


def _marker(
    key: str | int | None, typed_key: Any, dead_id: int | None, now: float
) -> Callable[[sqlite3.Connection], tuple[int, int]]:
    where = "redriven_as IS NULL AND redrive_requested IS NULL"
    params: list[Any] = []
    if key is not None:
        where += " AND key_text = ?"
        params.append(str(key))
        if typed_key is not None:
            # The exact key (the `key` column holds it encoded): its text alone is two keys'.
            where += " AND key = ?"
            params.append(codec.encode(typed_key))
    if dead_id is not None:
        where += " AND id = ?"
        params.append(dead_id)

    def mark(conn: sqlite3.Connection) -> tuple[int, int]:
        bad = conn.execute(
            f"SELECT COUNT(*) FROM dead_letters WHERE {where} AND kind = 'bad-input'", params
        ).fetchone()[0]
        marked = conn.execute(
            f"UPDATE dead_letters SET redrive_requested = ? WHERE {where} AND kind != 'bad-input'",
            [now, *params],
        ).rowcount
        return int(marked), int(bad)

    return mark
