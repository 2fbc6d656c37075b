"""How a completed run's trace is stored in the `traces` table: compactly, since traces are
most of a state's bytes (with the default retention, 20 runs per key).

The first format (still read) packed `{"started": ..., "tasks": [step dict, ...]}`, every
step repeating its nine field names and two 8-byte floats. The current one packs
`[3, started, base, steps]`: a step as a list in a fixed field order, its action left out
(None) when it is the task id's last part (`r>one.0>two` is action `two`), its start as
whole microseconds after `base` (the first step's start) and its duration in microseconds.
Fields a step holds beyond the fixed ones (attempts, calls, notes, ...) are kept as they
were, in a trailing dict. A trace whose steps lack the usual fields, or whose times are not
numbers, is stored in the first format. `unpack_trace` gives back the step dicts either way,
times to the microsecond. Packing runs on the engine's loop as each run completes, so it is
kept to a few list operations per step (no cheaper than the first format it replaces).
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from ratchet.store import codec

_FORMAT = 3
# An earlier form with a table of names per trace (format 2, written by this branch's first
# commit of the compact form only; it cost twice the CPU to pack): read, never written.
_FORMAT_NAMED = 2
_FIXED = ("task", "action", "index", "on", "replayed", "memory", "events", "started", "duration")
_fixed = itemgetter(*_FIXED)
_NFIXED = len(_FIXED)


def pack_trace(started: float | None, tasks: list[dict[str, Any]]) -> bytes:
    """A completed run's trace (its started time and its steps) as the store keeps it."""
    base: float | None = None
    steps: list[list[Any]] = []
    try:
        for step in tasks:
            row = list(_fixed(step))
            task, action = row[0], row[1]
            if base is None:
                base = row[7] + 0.0  # a time that is not a number: the first format
            if task[task.rfind(">") + 1 :] == action:
                row[1] = None
            elif action is None:
                raise TypeError  # None means "the task id's last part" here
            row[7] = round((row[7] - base) * 1e6)
            row[8] = round(row[8] * 1e6)
            if len(step) != _NFIXED:
                row.append({k: v for k, v in step.items() if k not in _FIXED})
            steps.append(row)
    except (KeyError, TypeError, AttributeError):
        return codec.encode_built({"started": started, "tasks": tasks})
    return codec.encode_built([_FORMAT, started, base, steps])


def pack_rows(started: float | None, base: float | None, rows: list[list[Any]]) -> bytes:
    """A trace whose steps the caller laid out as `pack_trace` would (the fixed fields in
    order, times as microseconds after `base`), packed the same way."""
    return codec.encode_built([_FORMAT, started, base, rows])


def unpack_trace(blob: bytes) -> tuple[float | None, list[dict[str, Any]]]:
    """(started, steps) of a stored trace, in either format. Raises what `codec.decode`
    raises, and `codec.CorruptDataError` for a list that is not a trace."""
    data = codec.decode(blob, unknown="generic")
    if isinstance(data, dict):
        return data.get("started"), list(data.get("tasks", []))
    try:
        names: list[str] | None = None
        if len(data) == 5 and data[0] == _FORMAT_NAMED:
            _fmt, started, base, names, steps = data
        else:
            fmt, started, base, steps = data
            if fmt != _FORMAT:
                raise ValueError(f"trace format {fmt!r}")
        tasks = []
        for row in steps:
            if names is not None:
                row = _unname(row, names)
            task, action, index, on, replayed, memory, events, began, took, *extra = row
            step: dict[str, Any] = {
                "task": task,
                "action": task.rpartition(">")[2] if action is None else action,
                "index": index,
                "on": on,
                "replayed": replayed,
                "memory": memory,
                "events": events,
                "started": base + began / 1e6,
                "duration": took / 1e6,
            }
            if extra:
                step.update(extra[0])
            tasks.append(step)
    except (ValueError, TypeError, AttributeError, IndexError) as exc:
        raise codec.CorruptDataError(f"a stored trace that is not one ({exc})") from exc
    return started, tasks


def _unname(row: list[Any], names: list[str]) -> list[Any]:
    """A step of format 2 (its strings by position in `names`) as a step of format 3."""
    own, act, index, on, replayed, memory, events, began, took, *extra = row
    task = names[own]
    action = None if act == -1 else names[act]
    return [task, action, index, names[on], replayed, memory, [names[e] for e in events],
            began, took, *extra]  # fmt: skip
