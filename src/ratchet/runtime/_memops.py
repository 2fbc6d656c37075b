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


def parents(path: str) -> Iterator[str]:
    idx = path.find(".")
    while idx != -1:
        yield path[:idx]
        idx = path.find(".", idx + 1)


def apply_op(data: dict[str, Any], op: tuple[Any, ...]) -> None:
    """Apply one recorded op to a flat map in place (used at commit and in replay)."""
    kind, path = op[0], op[1]
    if kind == SET or kind == NEW_OBJECT:
        for parent in parents(path):
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


def _drop_children(data: dict[str, Any], path: str) -> None:
    prefix = path + "."
    for k in [k for k in data if k.startswith(prefix)]:
        del data[k]


def apply_ops(data: dict[str, Any], ops: list[tuple[Any, ...]]) -> None:
    for op in ops:
        apply_op(data, op)


def to_wire(data: dict[str, Any]) -> dict[str, Any]:
    """A codec-admissible form of a flat map (object markers listed apart)."""
    values = {k: v for k, v in data.items() if v is not OBJECT}
    objects = [k for k, v in data.items() if v is OBJECT]
    return {"v": values, "o": objects}


def from_wire(wire: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {k: OBJECT for k in wire["o"]}
    data.update(wire["v"])
    return data
