"""How a completed run's trace is stored in the `traces` table: compactly, since traces are
most of a state's bytes (with the default retention, 20 runs per key, over 90% of the file).

The first format (still read) packed `{"started": ..., "tasks": [step dict, ...]}`, every
step repeating its field names, its event and task names, and two 8-byte floats. The second
packs `[2, started, base, names, steps]`: every distinct string once in `names`, a step as a
list in a fixed field order that refers to its strings by position, its start as
microseconds after `base` (the first step's start) and its duration in microseconds. Fields
a step holds beyond the fixed ones (attempts, calls, notes, ...) are kept as they were, in a
trailing dict. A trace whose steps do not have the usual fields and types is stored in the
first format. `unpack_trace` gives back the step dicts either way; times to the microsecond.
"""

from __future__ import annotations

from typing import Any

from ratchet.store import codec

_FORMAT = 2
_FIXED = ("task", "action", "index", "on", "replayed", "memory", "events", "started", "duration")


def pack_trace(started: float | None, tasks: list[dict[str, Any]]) -> bytes:
    """A completed run's trace (its started time and its steps) as the store keeps it."""
    names: dict[str, int] = {}

    def name(text: Any) -> int:
        if type(text) is not str:
            raise TypeError
        at = names.get(text)
        if at is None:
            at = names[text] = len(names)
        return at

    base: float | None = None
    steps: list[list[Any]] = []
    try:
        for step in tasks:
            began, took = step["started"], step["duration"]
            if type(began) is not float or type(took) is not float:
                raise TypeError
            if base is None:
                base = began
            task = step["task"]
            action = step["action"]
            own = name(task)
            # The action is the task id's last part ("r>one.0>two" is action "two"): -1 then.
            act = -1 if task.rpartition(">")[2] == action else name(action)
            row = [
                own, act, step["index"], name(step["on"]), step["replayed"], step["memory"],
                [name(e) for e in step["events"]],
                round((began - base) * 1e6), round(took * 1e6),
            ]  # fmt: skip
            if type(row[2]) is not int or type(row[4]) is not bool:
                raise TypeError
            extra = {k: v for k, v in step.items() if k not in _FIXED}
            if extra:
                row.append(extra)
            steps.append(row)
    except (KeyError, TypeError, AttributeError):
        return codec.encode_built({"started": started, "tasks": tasks})
    return codec.encode_built([_FORMAT, started, base, list(names), steps])


def unpack_trace(blob: bytes) -> tuple[float | None, list[dict[str, Any]]]:
    """(started, steps) of a stored trace, in either format. Raises what `codec.decode`
    raises, and `codec.CorruptDataError` for a list that is not a trace."""
    data = codec.decode(blob, unknown="generic")
    if isinstance(data, dict):
        return data.get("started"), list(data.get("tasks", []))
    try:
        fmt, started, base, names, steps = data
        if fmt != _FORMAT:
            raise ValueError(f"trace format {fmt!r}")
        tasks = []
        for row in steps:
            own, act, index, on, replayed, memory, events, began, took, *extra = row
            task = names[own]
            step: dict[str, Any] = {
                "task": task,
                "action": task.rpartition(">")[2] if act == -1 else names[act],
                "index": index,
                "on": names[on],
                "replayed": replayed,
                "memory": memory,
                "events": [names[e] for e in events],
                "started": base + began / 1e6,
                "duration": took / 1e6,
            }
            if extra:
                step.update(extra[0])
            tasks.append(step)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise codec.CorruptDataError(f"a stored trace that is not one ({exc})") from exc
    return started, tasks
