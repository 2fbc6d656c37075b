"""Dead letters: inputs kept instead of lost — bad lines (`--on-bad-input dead-letter`), runs
that ended in an error, runs abandoned by `ratchet runs abandon` — and their redrive.

Redriving is asked for by marking rows (`ratchet redrive`, REST, `request_redrive`), from any
process, whether the job runs or not; the engine admits each marked dead letter as a new input
in the same checkpoint that records it as redriven, so a kill neither loses nor doubles one.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import ConfigError, StateError
from ratchet.runtime._signals import ensure_schema
from ratchet.store._sqlite import DB_NAME, SqliteStore

DEAD_LETTERS_SCHEMA = 5


def list_dead_letters(state_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    store = SqliteStore.open_readonly(state_dir)
    try:
        return store.dead_letters()
    finally:
        store.close()


def request_redrive(
    state_dir: str | os.PathLike[str],
    *,
    all_letters: bool = False,
    key: str | None = None,
    dead_id: int | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> dict[str, Any]:
    """Mark dead letters to be admitted again (all, a key's, or one); what was marked."""
    if sum((all_letters, key is not None, dead_id is not None)) != 1:
        raise ConfigError("redrive takes exactly one of --all, --key KEY or --id ID")
    sdir = Path(state_dir)
    if not (sdir / DB_NAME).exists():
        raise StateError(f"no ratchet state in {sdir} ({sdir / DB_NAME} does not exist)")
    ensure_schema(sdir, DEAD_LETTERS_SCHEMA, "dead letters")
    where = "redriven_as IS NULL AND redrive_requested IS NULL"
    params: list[Any] = []
    if key is not None:
        where += " AND key_text = ?"
        params.append(key)
    if dead_id is not None:
        where += " AND id = ?"
        params.append(dead_id)
    conn = sqlite3.connect(sdir / DB_NAME, timeout=30, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        bad = conn.execute(
            f"SELECT COUNT(*) FROM dead_letters WHERE {where} AND kind = 'bad-input'", params
        ).fetchone()[0]
        marked = conn.execute(
            f"UPDATE dead_letters SET redrive_requested = ? WHERE {where} AND kind != 'bad-input'",
            [clock.now(), *params],
        ).rowcount
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        raise StateError(f"could not mark dead letters in {sdir}: {exc}") from exc
    finally:
        conn.close()
    if dead_id is not None and marked == 0 and bad == 0:
        raise ConfigError(
            f"--id {dead_id}: no dead letter with that id waits for a redrive in {sdir} "
            f"(`ratchet dead-letters --state {sdir}` lists them)"
        )
    return {"marked": marked, "bad_lines_skipped": bad, "state": str(sdir)}
