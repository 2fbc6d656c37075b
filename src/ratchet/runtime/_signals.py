"""Sending a signal to a job's state: `ratchet.send_signal`, `ratchet signal`, the REST API.

A signal is one row in the state's `signals` table, committed by the sender in its own
transaction (SQLite serialises it with the engine's writer), so it is durable when this
returns, whether the job is running or stopped. A running engine reads new rows at every
checkpoint tick; a stopped one at its next start. A waiting task consumes a signal in the
same transaction that records its value as the task's call record: exactly once. A sharded job
keeps a key's signals in the key's shard (the same hash that routes its inputs).
"""

from __future__ import annotations

import math
import os
import sqlite3
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import (
    BadInputError,
    ConfigError,
    InvalidArgumentError,
    InvalidTypeError,
    StateError,
)
from ratchet.runtime._shards import (
    Moved,
    chosen_key_type,
    int_text,
    read_layout,
    shard_for_text,
    write_in_force,
)
from ratchet.store import codec
from ratchet.store._base import signal_key_type
from ratchet.store._sqlite import DB_NAME, SqliteStore, StateLock, state_dir_error

SIGNALS_SCHEMA = 11  # the state schema whose signals table records the key's type


def signal_key(key: Any) -> str:
    """A key as signals name it: its text, as `ratchet inspect` and `runs list` show it."""
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise InvalidTypeError(f"a signal's key is a str or an int, got {key!r}")
    text = str(key)
    if not text:
        raise InvalidArgumentError("a signal's key must not be empty")
    return text


def non_finite(value: Any) -> str | None:
    """The first NaN, Infinity or -Infinity in `value` (nested in dicts, lists, tuples and
    sets, keys included), as JSON-like Python writes it; None if there is none. A loop, not
    recursion: a deeply nested value must not raise RecursionError here."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            if not math.isfinite(v):
                return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple | set | frozenset):
            stack.extend(v)
    return None


def send_signal(
    state_dir: str | os.PathLike[str],
    key: Any,
    name: str,
    value: Any = None,
    *,
    clock: Clock = SYSTEM_CLOCK,
    key_type: str | None = None,
) -> dict[str, Any]:
    """Store a signal for `key` durably; a run of the key waiting for `name` gets `value`.

    Works whether the job is running or stopped. Signals of one key and name are delivered in
    the order they were stored, each exactly once; one that nobody waits for yet is kept until
    a run of that key waits for it (`ratchet status` lists them). Returns what was stored.

    A sharded job (`--workers N`) keeps it in the key's shard, whose worker delivers it.
    `key_type` routes a key given as text (the CLI, REST): "str", "int", or "auto" (whichever
    form the shards hold); None (the default) takes the type of `key` itself.
    """
    key_text = signal_key(key)
    if not isinstance(name, str) or not name:
        raise InvalidTypeError(f"a signal's name is a non-empty str, got {name!r}")
    if name.startswith("approval:"):
        # A decision of a tool approval: a malformed one would be taken as a rejection, for
        # good (a corrected one sent later is never read), so it is refused here.
        from ratchet.agents.chat._approval import DECISION_SHAPE, decision_problem

        problem = decision_problem(value)
        if problem is not None:
            raise BadInputError(
                f"signal {name!r} decides a tool approval, and its value is not a decision "
                f"({problem}); send {DECISION_SHAPE}, e.g. --value '{{\"approved\": true}}'"
            )
    where = non_finite(value)
    if where is not None:
        # The waiting run would put it in its outputs, whose JSON has no NaN or Infinity: the
        # job's sink would refuse them later, far from the sender.
        raise BadInputError(
            f"signal {name!r}: its value holds {where}, which is not JSON; send null, a "
            f"finite number or a string instead"
        )
    try:
        blob = codec.encode(value)
    except TypeError as exc:
        raise InvalidTypeError(
            f"signal {name!r}: its value cannot be stored ({exc}); send plain data (JSON values)"
        ) from None
    sdir = Path(state_dir)
    sent_at = clock.now()
    if key_type is None:  # from Python the key's own type says it
        key_type = signal_key_type(key)
    if key_type == "int" and not int_text(key_text):
        raise InvalidArgumentError(f"key {key_text!r} is not an integer (--key-type int)")
    stored_type: list[str | None] = [None]

    def insert(conn: sqlite3.Connection) -> int | None:
        # The run the signal is for: the integer key 1 and the string key "1" are two keys.
        # "auto" takes the form the state holds; a state holding both must be told which.
        typed = key_type if key_type in ("str", "int") else _held_type(conn, key_text, sdir)
        stored_type[0] = typed
        cur = conn.execute(
            "INSERT INTO signals(key_text, name, value, sent_at, key_type) VALUES (?, ?, ?, ?, ?)",
            (key_text, name, blob, sent_at, typed),
        )
        return cur.lastrowid

    for _attempt in range(5):
        layout = read_layout(sdir)
        target = sdir
        if layout.workers > 1:  # the key's shard: its worker's engine takes the signal
            try:
                target = layout.dirs[shard_for_text(sdir, layout, key_text, key_type)]
            except ConfigError as exc:
                if key_type != "auto":
                    raise
                # A text whose two keys live in two shards, neither held: the refusal names
                # the CLI's flag and Python's way; REST's is the query parameter.
                raise ConfigError(f"{exc}; REST: ?key_type=str or ?key_type=int") from None
        path = target / DB_NAME
        if not path.exists():
            raise StateError(
                f"no ratchet state in {target} ({path} does not exist); a signal goes to the "
                f"--state directory of the job whose run waits for it"
            )
        ensure_schema(target, SIGNALS_SCHEMA, "signals", sdir)
        try:
            sid = write_in_force(sdir, target, insert)
        except Moved:
            continue  # the number of workers changed meanwhile: route again
        sent = {"id": sid, "key": key_text, "name": name, "sent_at": sent_at, "state": str(sdir)}
        if stored_type[0] is not None:
            sent["key_type"] = stored_type[0]
        if layout.workers > 1:
            sent["shard"] = target.name
        return sent
    raise StateError(
        f"the number of workers of {sdir} kept changing while the signal was sent; nothing "
        f"was stored: send it again"
    )


def _held_type(conn: sqlite3.Connection, text: str, sdir: Path) -> str | None:
    """The type of the key of `text` that the state holds (None: neither form yet, so the
    first run of either that waits takes the signal); refused when it holds both."""
    forms = {"str": text, **({"int": int(text)} if int_text(text) else {})}
    held = [
        kind
        for kind, form in forms.items()
        if conn.execute(
            "SELECT 1 FROM keys WHERE key = ?1 UNION ALL SELECT 1 FROM runs WHERE key = ?1",
            (codec.encode(form),),
        ).fetchone()
    ]
    return chosen_key_type(
        text,
        "auto",
        lambda: set(held),
        sdir,
        "say which one the signal is for (--key-type str or --key-type int; REST: "
        "?key_type=str or ?key_type=int; from Python, pass the key as a str or an int)",
    )


def ensure_schema(sdir: Path, needed: int, what: str, given: Path | None = None) -> None:
    """A state from before `what` (schema `needed`) is brought up to date, if no job holds it.
    `given`: the --state directory `sdir` is a shard of (what a refusal names)."""
    store = SqliteStore.open_readonly(sdir)
    try:
        version = store.meta("schema_version")
    finally:
        store.close()
    if version >= needed:
        return
    lock = StateLock(sdir)
    try:
        lock.acquire()
    except StateError as exc:
        raise StateError(
            f"{sdir} is at state schema {version}, before {what}, and a job holds it ({exc}); "
            f"that job runs an older ratchet: stop it and try again (this ratchet upgrades the "
            f"state first)"
        ) from None
    except OSError as exc:  # a lock file that cannot be opened: a read-only directory, say
        raise StateError(
            f"{state_dir_error(given or sdir, exc)}; it is at state schema {version}, before "
            f"{what}, and this ratchet upgrades it first, under that lock"
        ) from exc
    try:
        SqliteStore.open(sdir, "", "", []).close()  # migrates the schema, nothing else
    finally:
        lock.release()
