"""Chat model resources: a connection (talks to a provider) and a setup (model, prompt, tools)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field, PrivateAttr

from ratchet.compat.flink_agents.api.chat_message import ChatMessage, MessageRole
from ratchet.compat.flink_agents.api.prompts.prompt import Prompt
from ratchet.compat.flink_agents.api.resource import Resource, ResourceType
from ratchet.compat.flink_agents.api.tools.tool import Tool


class BaseChatModelConnection(Resource, ABC):
    """Talks to a model provider; `chat` is synchronous and returns the model's message."""

    @classmethod
    def resource_type(cls) -> ResourceType:
        return ResourceType.CHAT_MODEL_CONNECTION

    @abstractmethod
    def chat(
        self, messages: Sequence[ChatMessage], tools: list[Tool] | None = None, **kwargs: Any
    ) -> ChatMessage:
        """The model's answer to `messages`, offered `tools`."""


class BaseChatModelSetup(Resource):
    """A model on a connection, with an optional prompt and tools (by resource name)."""

    connection: str = Field(description="The name of the connection resource.")
    model: str = Field(default="", description="The model to use.")
    prompt: Prompt | str | None = None
    tools: list[Any] = Field(default_factory=list)
    _resolved_connection: Any = PrivateAttr(default=None)

    @classmethod
    def resource_type(cls) -> ResourceType:
        return ResourceType.CHAT_MODEL

    @property
    def model_kwargs(self) -> dict[str, Any]:
        """Extra arguments passed to the connection's `chat`."""
        return {}

    def open(self) -> None:
        context = self.resource_context
        if context is None:
            return
        self._resolved_connection = context.get_resource(
            self.connection, ResourceType.CHAT_MODEL_CONNECTION
        )
        if isinstance(self.prompt, str):
            self.prompt = context.get_resource(self.prompt, ResourceType.PROMPT)
        self.tools = [
            t if isinstance(t, Tool) else context.get_resource(t, ResourceType.TOOL)
            for t in self.tools
        ]

    def chat(
        self,
        messages: Sequence[ChatMessage],
        prompt_args: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ChatMessage:
        """Fill the prompt (if any) with `prompt_args`, put it before `messages`, and ask the
        connection with this setup's tools."""
        to_send = list(messages)
        if isinstance(self.prompt, Prompt):
            args = {k: str(v) for k, v in (prompt_args or {}).items()}
            kept = [m for m in to_send if m.content or m.role == MessageRole.ASSISTANT]
            to_send = self.prompt.format_messages(MessageRole.SYSTEM, **args) + kept
        merged = dict(self.model_kwargs)
        merged.update(kwargs)
        connection = self._resolved_connection
        if connection is None:
            raise TypeError(
                f"chat model setup {type(self).__name__}: connection {self.connection!r} is not "
                f"resolved; get the setup with ctx.get_resource(...) (it opens it)"
            )
        return connection.chat(to_send, tools=list(self.tools), **merged)  # type: ignore[no-any-return]
