"""A user type registered in a module that only an action imports (see chat_agent.py)."""

from __future__ import annotations

import dataclasses

from ratchet import register_type


@dataclasses.dataclass
class Note:
    text: str
    tags: tuple[str, ...]


register_type(Note, "inspect_test.Note")
