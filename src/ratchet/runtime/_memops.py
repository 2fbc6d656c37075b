"""Flat memory maps and the ops that change them: applied by the run machine at commit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ratchet._errors import CorruptDataError


class _ObjectNode:
    """Marks a path that holds an object (children), not a value."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<memory object>"


OBJECT = _ObjectNode()

# Ops recorded by a task and stored in the journal.
SET = "s"
DELETE = "d"
NEW_OBJECT = "o"
EXPIRE = "e"  # (EXPIRE, path, expires_at or None): a time-to-live for a path (or none)
# Long-term memory writes ride in the same op list (so they are journaled, replayed and
# committed with the run like memory writes) but change no memory map: the engine collects
# them when the run completes and writes them with that checkpoint.
LTM_ADD = "L"  # (LTM_ADD, scope, id, text, metadata, float32 vector bytes, added at)
LTM_DELETE = "X"  # (LTM_DELETE, scope, id)
LTM_OPS = (LTM_ADD, LTM_DELETE)

# Where a memory map keeps the expiry times of paths set with a ttl: {path: expires_at}.
# Not a path an action can name ("!" is reserved), so `keys()` and `get()` never see it.
EXPIRES = "!expires"


def parents(path: str) -> Iterator[str]:
    idx = path.find(".")
    while idx != -1:
        yield path[:idx]
        idx = path.find(".", idx + 1)


def apply_op(data: dict[str, Any], op: tuple[Any, ...]) -> None:
    """Apply one recorded op to a flat map in place (used at commit and in replay)."""
    kind, path = op[0], op[1]
    if kind == LTM_ADD or kind == LTM_DELETE:
        return
    if kind == EXPIRE:
        expires = dict(data.get(EXPIRES) or {})
        if op[2] is None:
            expires.pop(path, None)
        else:
            expires[path] = op[2]
        if expires:
            data[EXPIRES] = expires
        else:
            data.pop(EXPIRES, None)
        return
    if EXPIRES in data:
        _forget_expiry(data, path)
    if kind == SET or kind == NEW_OBJECT:
        for parent in parents(path) if "." in path else ():
            if data.get(parent) is not OBJECT:
                data[parent] = OBJECT
        if kind == NEW_OBJECT or data.get(path) is OBJECT:
            _drop_children(data, path)
        data[path] = OBJECT if kind == NEW_OBJECT else op[2]
    elif kind == DELETE:
        data.pop(path, None)
        _drop_children(data, path)
    else:
        raise CorruptDataError(
            f"unknown memory op {kind!r} in stored state; it was written by another program"
        )


def _forget_expiry(data: dict[str, Any], path: str) -> None:
    """A path written or deleted loses its ttl, and so do the paths under it."""
    expires = data[EXPIRES]
    prefix = path + "."
    gone = [p for p in expires if p == path or p.startswith(prefix)]
    if gone:
        kept = {p: t for p, t in expires.items() if p not in gone}
        if kept:
            data[EXPIRES] = kept
        else:
            del data[EXPIRES]


def expire(data: dict[str, Any], now: float) -> dict[str, Any] | None:
    """The memory a run starting at `now` sees: without the paths whose ttl ran out.

    None when nothing in `data` has a ttl (then the time a run starts does not matter)."""
    expires = data.get(EXPIRES)
    if not expires:
        return None
    view = dict(data)
    for path, at in sorted(expires.items()):
        if at <= now:
            apply_op(view, (DELETE, path))
    return view


def _drop_children(data: dict[str, Any], path: str) -> None:
    prefix = path + "."
    for k in [k for k in data if k.startswith(prefix)]:
        del data[k]


def to_wire(data: dict[str, Any]) -> dict[str, Any]:
    """A codec-admissible form of a flat map (object markers listed apart)."""
    values = {k: v for k, v in data.items() if v is not OBJECT}
    objects = [k for k, v in data.items() if v is OBJECT]
    return {"v": values, "o": objects}


def from_wire(wire: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {k: OBJECT for k in wire["o"]}
    data.update(wire["v"])
    return data
