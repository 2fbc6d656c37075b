"""Prompts: a template text or template messages, filled with `{name}` arguments."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from ratchet.compat.flink_agents.api.chat_message import ChatMessage, MessageRole
from ratchet.compat.flink_agents.api.resource import ResourceType, SerializableResource

_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def fill(template: str, /, **kwargs: Any) -> str:
    """`template` with each `{name}` given in `kwargs` replaced; other braces are left as
    they are (a missing argument is not an error)."""
    return _FIELD.sub(lambda m: str(kwargs[m[1]]) if m[1] in kwargs else m[0], template)


class Prompt(SerializableResource, ABC):
    """A prompt resource."""

    @staticmethod
    def from_messages(messages: Sequence[ChatMessage]) -> Prompt:
        """A prompt of template messages (each keeps its role)."""
        return LocalPrompt(template=list(messages))

    @staticmethod
    def from_text(text: str) -> Prompt:
        """A prompt of one template text (formatted as a SYSTEM message by default)."""
        return LocalPrompt(template=text)

    @abstractmethod
    def format_string(self, **kwargs: Any) -> str:
        """The prompt filled in, as text."""

    @abstractmethod
    def format_messages(
        self, role: MessageRole = MessageRole.SYSTEM, **kwargs: Any
    ) -> list[ChatMessage]:
        """The prompt filled in, as messages."""

    @classmethod
    def resource_type(cls) -> ResourceType:
        return ResourceType.PROMPT


class LocalPrompt(Prompt):
    """A prompt held in memory."""

    template: list[ChatMessage] | str

    def format_string(self, **kwargs: Any) -> str:
        if isinstance(self.template, str):
            return fill(self.template, **kwargs)
        return "\n".join(f"{m.role.value}: {fill(m.content, **kwargs)}" for m in self.template)

    def format_messages(
        self, role: MessageRole = MessageRole.SYSTEM, **kwargs: Any
    ) -> list[ChatMessage]:
        if isinstance(self.template, str):
            return [ChatMessage(role=role, content=fill(self.template, **kwargs))]
        return [
            ChatMessage(
                role=m.role,
                content=fill(m.content, **kwargs),
                tool_calls=list(m.tool_calls),
                extra_args=dict(m.extra_args),
            )
            for m in self.template
        ]
