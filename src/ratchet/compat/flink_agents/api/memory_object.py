"""`MemoryObject`: Flink Agents' view of a memory, on ratchet's per-task buffered memory.

Paths are dotted (`"order.total"`); setting a path creates the objects on it. Reads see the
memory as it was when the task was dispatched plus the task's own writes; writes commit with
the task (docs/runtime.md). Values are checked when set: anything ratchet's codec stores with
its exact type is admitted (more than Flink's primitives-only rule), the rest is refused with
a `TypeError` naming the path.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any

from ratchet.agents._memory import MemoryObject as _RatchetMemory
from ratchet.store import codec

if TYPE_CHECKING:
    from ratchet.compat.flink_agents.api.memory_reference import MemoryRef

NESTED_OBJECT = "NestedObject"


class MemoryType(Enum):
    """Which memory: per run (sensory) or per key across runs (short-term)."""

    SENSORY = "sensory"
    SHORT_TERM = "short_term"


codec.register(MemoryType, "flink_agents.MemoryType")


class MemoryObject:
    """An object in a memory: `get`, `set` (returns a `MemoryRef`), `new_object`, `is_exist`,
    `get_field_names`, `get_fields`."""

    def __init__(self, memory_type: MemoryType, root: _RatchetMemory, prefix: str = "") -> None:
        self._type = memory_type
        self._root = root
        self._prefix = prefix

    def _full(self, path: str) -> str:
        if not isinstance(path, str):
            raise TypeError(f"memory path must be a str, got {path!r}")
        if not path:
            return self._prefix
        return f"{self._prefix}.{path}" if self._prefix else path

    def _wrap(self, full: str, value: Any) -> Any:
        if isinstance(value, _RatchetMemory):
            return MemoryObject(self._type, self._root, full)
        return value

    def get(self, path_or_ref: str | MemoryRef) -> Any:
        """The value at a relative path (or a `MemoryRef`), a `MemoryObject` for an object,
        or None if nothing is there."""
        from ratchet.compat.flink_agents.api.memory_reference import MemoryRef

        if isinstance(path_or_ref, MemoryRef):
            full = path_or_ref.path
        else:
            full = self._full(path_or_ref)
        if not full:
            return self
        return self._wrap(full, self._root.get(full))

    def set(self, path: str, value: Any) -> MemoryRef:
        """Set the value at a relative path (creating the objects on it); returns a reference."""
        from ratchet.compat.flink_agents.api.memory_reference import MemoryRef

        if isinstance(value, MemoryObject):
            raise TypeError(
                f"memory value at {path!r} is a MemoryObject; use new_object({path!r}) for a "
                f"nested object"
            )
        full = self._full(path)
        if isinstance(self._root.get(full), _RatchetMemory):
            raise ValueError(f"memory path {full!r} is an object; it cannot be set to a value")
        self._make_parents(full)
        self._root.set(full, value)
        return MemoryRef(memory_type=self._type, path=full)

    def _make_parents(self, full: str) -> None:
        parts = full.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if not self._root.exists(parent):
                self._root.new_object(parent)

    def new_object(self, path: str, *, overwrite: bool = False) -> MemoryObject:
        """Create an object at a relative path; an existing object is kept, an existing value
        is replaced only with `overwrite=True`."""
        full = self._full(path)
        existing = self._root.get(full)
        if isinstance(existing, _RatchetMemory):
            return MemoryObject(self._type, self._root, full)
        if self._root.exists(full) and not overwrite:
            raise ValueError(
                f"memory path {full!r} holds a value, not an object; pass overwrite=True to "
                f"replace it"
            )
        self._make_parents(full)
        self._root.new_object(full, overwrite=True)
        return MemoryObject(self._type, self._root, full)

    def is_exist(self, path: str) -> bool:
        """Whether something (a value or an object) is at a relative path."""
        return self._root.exists(self._full(path))

    def get_field_names(self) -> list[str]:
        """The direct fields' names, sorted."""
        if not self._prefix:
            return self._root.keys()
        node = self._root.get(self._prefix)
        return node.keys() if isinstance(node, _RatchetMemory) else []

    def get_fields(self) -> dict[str, Any]:
        """The direct fields; a nested object shows as the text "NestedObject"."""
        out: dict[str, Any] = {}
        for name in self.get_field_names():
            value = self.get(name)
            out[name] = NESTED_OBJECT if isinstance(value, MemoryObject) else value
        return out

    def __repr__(self) -> str:
        return f"MemoryObject({self._type.value}:{self._prefix or '<root>'})"
