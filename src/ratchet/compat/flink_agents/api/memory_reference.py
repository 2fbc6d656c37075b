"""`MemoryRef`: a pointer to a value in memory, small enough to carry inside events."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ratchet.compat.flink_agents.api.memory_object import MemoryType
from ratchet.store import codec


class MemoryRef(BaseModel):
    """The memory (`memory_type`) and absolute `path` of a value."""

    memory_type: MemoryType = MemoryType.SHORT_TERM
    path: str

    @staticmethod
    def create(memory_type: MemoryType, path: str) -> MemoryRef:
        return MemoryRef(memory_type=memory_type, path=path)

    def resolve(self, ctx: Any) -> Any:
        """The value this points to, read through `ctx`'s memories."""
        if self.memory_type == MemoryType.SENSORY:
            return ctx.sensory_memory.get(self)
        return ctx.short_term_memory.get(self)


codec.register(MemoryRef, "flink_agents.MemoryRef")
