"""Agent memory: a flat map of dotted paths, read-your-writes within a task, ops for the journal.

A task reads a snapshot taken when it was dispatched and buffers its writes as ops; the
run machine applies the ops at commit, in dispatch order. Because the snapshot is fixed at
dispatch, a replayed task reads exactly what it read the first time.
"""

from __future__ import annotations

import copy
import datetime
import math
from collections.abc import Callable
from typing import Any

from ratchet._errors import CodecError, InvalidArgumentError, InvalidTypeError
from ratchet.runtime._memops import DELETE, EXPIRE, NEW_OBJECT, OBJECT, SET, apply_op, parents
from ratchet.store import codec

_SCALARS = (type(None), bool, int, float, str, bytes)

# Containers a memory write's value is stored under: its `(op, path, value)` entry in a run's
# journal, as the Flink core keeps an in-flight run in keyed state (the embedded engine's is
# one less). A value nested deeper than the codec's limit less these is refused at `set()`,
# so the action fails there, instead of every checkpoint after it.
WRITE_DEPTH = 5
_MISSING = object()


def _check_path(path: str) -> str:
    if (
        type(path) is str
        and path
        and path[0] != "!"
        and path[0] != "."
        and path[-1] != "."
        and ".." not in path
    ):
        return path  # a well-formed path (the checks below, in one pass)
    if not isinstance(path, str) or not path:
        raise InvalidTypeError(f"memory path must be a non-empty str, got {path!r}")
    if "" in path.split("."):
        raise InvalidArgumentError(
            f"memory path {path!r} has an empty segment; use names like 'order.total'"
        )
    if path[0] == "!":
        raise InvalidArgumentError(
            f"memory path {path!r} starts with '!', which ratchet reserves; use another name"
        )
    return path


def _private_copy(value: Any) -> Any:
    return value if type(value) in _SCALARS else copy.deepcopy(value)


class MemoryBuffer:
    """The memory one task sees: its dispatch-time snapshot plus its own buffered writes."""

    __slots__ = ("_base", "_local", "ops", "kind", "now")

    def __init__(
        self, base: dict[str, Any], kind: str, now: Callable[[], float] | None = None
    ) -> None:
        self._base = base
        self._local: dict[str, Any] | None = None
        self.ops: list[tuple[Any, ...]] = []
        self.kind = kind
        self.now = now  # the engine's clock, for ttl= (None: the engine has no timers)

    @property
    def data(self) -> dict[str, Any]:
        return self._base if self._local is None else self._local

    def record(self, op: tuple[Any, ...]) -> None:
        if self._local is None:
            self._local = dict(self._base)
        apply_op(self._local, op)
        self.ops.append(op)


class MemoryObject:
    """A view of memory at a path prefix: `get`, `set`, `delete`, `exists`, `keys`, `new_object`.

    Values are validated at `set()`: only types the safe codec stores with their exact type
    are admitted, so what you read after a restart is what you wrote.
    """

    __slots__ = ("_buf", "_prefix")

    def __init__(self, buffer: MemoryBuffer, prefix: str = "") -> None:
        self._buf = buffer
        self._prefix = prefix

    def _full(self, path: str) -> str:
        _check_path(path)
        return f"{self._prefix}.{path}" if self._prefix else path

    def get(self, path: str, default: Any = None) -> Any:
        full = self._full(path)
        value = self._buf.data.get(full, _MISSING)
        if value is _MISSING:
            return default
        if value is OBJECT:
            return MemoryObject(self._buf, full)
        return _private_copy(value)

    def set(self, path: str, value: Any, *, ttl: float | datetime.timedelta | None = None) -> None:
        """Write `value` at `path`. With `ttl` (seconds or a timedelta) it expires: runs that
        start after `ttl` has passed do not see it (a run in progress keeps what it saw)."""
        full = self._full(path)
        expires_at = None
        if ttl is not None:
            expires_at = self._expiry(full, ttl)
        if isinstance(value, MemoryObject):
            raise CodecError(
                f"memory value at {full!r} is a MemoryObject; use new_object({path!r}) to create "
                f"an object, or copy its fields one by one"
            )
        if type(value) not in _SCALARS:  # an exact scalar is always admitted
            codec.check_admissible(value, full, WRITE_DEPTH)
        data = self._buf.data
        for parent in parents(full) if "." in full else ():
            existing = data.get(parent, _MISSING)
            if existing is not _MISSING and existing is not OBJECT:
                raise InvalidTypeError(
                    f"cannot set memory path {full!r}: {parent!r} holds a value "
                    f"({type(existing).__name__}), not an object; delete({parent!r}) first"
                )
        self._buf.record((SET, full, _private_copy(value)))
        if expires_at is not None:
            self._buf.record((EXPIRE, full, expires_at))

    def _expiry(self, full: str, ttl: Any) -> float:
        if self._buf.kind != "short_term":
            raise InvalidArgumentError(
                f"ttl= applies to short-term memory; {full!r} is in {self._buf.kind} memory, "
                f"which ends with its run anyway"
            )
        if isinstance(ttl, datetime.timedelta):
            ttl = ttl.total_seconds()
        if type(ttl) not in (int, float) or not math.isfinite(ttl) or ttl <= 0:
            raise InvalidArgumentError(
                f"set({full!r}, ttl=) takes seconds > 0 (an int, a float or a timedelta), got "
                f"{ttl!r}"
            )
        if self._buf.now is None:
            raise InvalidArgumentError(
                "ttl= needs an engine with a clock for memory: the embedded engine has one; the "
                "Flink engine does not yet (docs/flink.md)"
            )
        return self._buf.now() + float(ttl)

    def new_object(self, path: str, overwrite: bool = False) -> MemoryObject:
        full = self._full(path)
        existing = self._buf.data.get(full, _MISSING)
        if existing is not _MISSING and not overwrite:
            raise InvalidArgumentError(
                f"memory path {full!r} already exists; pass overwrite=True to replace it"
            )
        self._buf.record((NEW_OBJECT, full))
        return MemoryObject(self._buf, full)

    def delete(self, path: str) -> None:
        full = self._full(path)
        if full in self._buf.data:
            self._buf.record((DELETE, full))

    def exists(self, path: str) -> bool:
        return self._full(path) in self._buf.data

    def keys(self) -> list[str]:
        """Names of the direct children of this object, sorted."""
        data = self._buf.data
        if not self._prefix:
            return sorted(k for k in data if "." not in k and k[:1] != "!")
        prefix = self._prefix + "."
        n = len(prefix)
        return sorted(k[n:] for k in data if k.startswith(prefix) and "." not in k[n:])

    def to_dict(self) -> dict[str, Any]:
        """A nested plain-dict copy of this object, for display and tests."""
        out: dict[str, Any] = {}
        for name in self.keys():
            value = self.get(name)
            out[name] = value.to_dict() if isinstance(value, MemoryObject) else value
        return out

    def __repr__(self) -> str:
        where = self._prefix or "<root>"
        return f"MemoryObject({where}: {self.keys()})"


# Sent in an event or stored inside another value, a view is refused with what to do instead.
codec.advise(
    MemoryObject,
    "MemoryObject (a view of memory, not a value)",
    "pass its .to_dict() (a plain-dict copy) instead",
)


def nested(data: dict[str, Any]) -> dict[str, Any]:
    """A nested dict of a flat map (for `ratchet inspect` and tests)."""
    return MemoryObject(MemoryBuffer(data, "view")).to_dict()
