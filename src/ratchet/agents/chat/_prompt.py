"""`Prompt`: a template (text or messages) with named `{arguments}`."""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any

from ratchet._errors import InvalidTypeError
from ratchet.agents.chat._errors import PromptArgumentError
from ratchet.agents.chat._messages import ChatMessage

_FORMATTER = string.Formatter()


def _fields(text: str) -> list[str]:
    names = []
    for _, field, _, _ in _FORMATTER.parse(text):
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise PromptArgumentError(
                f"prompt placeholder {{{field}}} is positional; name it, e.g. {{ticket}}"
            )
        names.append(root)
    return names


class Prompt:
    """A reusable template. Placeholders are `{name}` (write `{{` for a literal brace).

    Formatting without one of the arguments raises `PromptArgumentError` naming it, rather
    than sending a model a half-filled prompt.
    """

    def __init__(self, template: str | Sequence[ChatMessage], *, name: str = "prompt") -> None:
        if isinstance(template, str):
            self.messages: tuple[ChatMessage, ...] = (ChatMessage.user(template),)
            self._text: str | None = template
        else:
            self.messages = tuple(template)
            self._text = None
            if not all(isinstance(m, ChatMessage) for m in self.messages):
                raise InvalidTypeError("Prompt takes a str or a list of ChatMessage")
        self.name = name
        self.arguments: frozenset[str] = frozenset(
            n for m in self.messages for n in _fields(m.content)
        )

    @classmethod
    def from_text(cls, text: str, *, name: str = "prompt") -> Prompt:
        return cls(text, name=name)

    @classmethod
    def from_messages(cls, messages: Sequence[ChatMessage], *, name: str = "prompt") -> Prompt:
        return cls(list(messages), name=name)

    def _check(self, args: Mapping[str, Any]) -> None:
        missing = sorted(self.arguments - set(args))
        if missing:
            given = ", ".join(sorted(args)) or "none"
            raise PromptArgumentError(
                f"prompt {self.name!r} needs argument {missing[0]!r}"
                + (f" (and {', '.join(map(repr, missing[1:]))})" if len(missing) > 1 else "")
                + f"; arguments given: {given}"
            )

    def format_messages(
        self, args: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> list[ChatMessage]:
        """The template's messages with every placeholder filled."""
        values = {**(args or {}), **kwargs}
        self._check(values)
        return [
            m.model_copy(update={"content": m.content.format_map(values)}) if m.content else m
            for m in self.messages
        ]

    def format_string(self, args: Mapping[str, Any] | None = None, **kwargs: Any) -> str:
        """The template as one string (a text template, or the messages' contents joined)."""
        msgs = self.format_messages(args, **kwargs)
        if self._text is not None:
            return msgs[0].content
        return "\n".join(f"{m.role.value}: {m.content}" for m in msgs)

    def __repr__(self) -> str:
        return f"Prompt({self.name!r}, arguments={sorted(self.arguments)})"
