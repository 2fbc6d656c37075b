"""`ScriptedChatModel`: deterministic replies, no network, for tests, demos and users' tests."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from pydantic import BaseModel

from ratchet._errors import InvalidArgumentError, InvalidTypeError
from ratchet.agents.chat._errors import ModelCallError
from ratchet.agents.chat._messages import ChatMessage, MessageRole, TokenUsage, ToolCall
from ratchet.agents.chat._model import ChatModel, RetryPolicy
from ratchet.agents.chat._ratelimit import RateLimit
from ratchet.agents.chat._tools import Tool

Reply: TypeAlias = str | ChatMessage | ToolCall | list[ToolCall] | BaseModel | dict[str, Any]


def _words(text: str) -> int:
    return len(text.split())


def count_tokens(messages: Sequence[ChatMessage]) -> int:
    """A stand-in token count (whitespace words, plus tool-call arguments)."""
    n = 0
    for m in messages:
        n += _words(m.content) + 1
        for tc in m.tool_calls:
            n += 1 + _words(json.dumps(tc.arguments, sort_keys=True))
    return n


def as_reply(reply: Reply) -> ChatMessage:
    if isinstance(reply, ChatMessage):
        return reply
    if isinstance(reply, str):
        return ChatMessage.assistant(reply)
    if isinstance(reply, ToolCall):
        return ChatMessage.assistant(tool_calls=[reply])
    if isinstance(reply, list):
        return ChatMessage.assistant(tool_calls=list(reply))
    if isinstance(reply, BaseModel):
        return ChatMessage.assistant(reply.model_dump_json())
    if isinstance(reply, dict):
        return ChatMessage.assistant(json.dumps(reply, sort_keys=True))
    raise InvalidTypeError(
        f"a scripted reply must be a str, ChatMessage, ToolCall(s) or model: {reply!r}"
    )


class ScriptedChatModel(ChatModel):
    """Replies from a script, chosen by the conversation itself, so a replay gets the same one.

    `replies[i]` answers a conversation that already holds `i` assistant messages (the first
    call gets `replies[0]`; after one tool round trip, `replies[1]`). Or pass
    `respond(messages) -> reply` to compute a reply. A reply is a str, a `ChatMessage`, a
    `ToolCall` or a list of them (the model asks for tools), or a pydantic model / dict (sent
    as JSON). `fail_first` lists errors raised by the first calls, for retry tests; `calls`
    records every conversation the model was asked about.
    """

    provider = "scripted"

    def __init__(
        self,
        replies: Sequence[Reply] = (),
        *,
        respond: Callable[[list[ChatMessage]], Reply] | None = None,
        fail_first: Sequence[ModelCallError] = (),
        model: str | None = "scripted",
        retry: RetryPolicy | None = None,
        rate_limit: RateLimit | None = None,
        resource_name: str | None = None,
        probe_delay: float = 1.0,
        max_probe_delay: float = 60.0,
    ) -> None:
        super().__init__(
            model=model, retry=retry, rate_limit=rate_limit, resource_name=resource_name,
            probe_delay=probe_delay, max_probe_delay=max_probe_delay,
        )  # fmt: skip
        if isinstance(replies, str | bytes):  # a str is a sequence: it answered "h" for "hello"
            raise InvalidTypeError(
                f"ScriptedChatModel(replies=) takes a list of replies, one per turn: write "
                f"replies=[{replies!r}], not replies={replies!r}"
            )
        if replies and respond is not None:
            raise InvalidArgumentError(
                "ScriptedChatModel takes replies=[...] or respond=..., not both"
            )
        if not replies and respond is None:
            raise InvalidArgumentError("ScriptedChatModel needs replies=[...] or respond=...")
        for i, reply in enumerate(replies):  # a bad one fails here, not at its turn mid-job
            try:
                as_reply(reply)
            except InvalidTypeError as exc:
                raise InvalidTypeError(f"ScriptedChatModel replies[{i}]: {exc}") from None
        self.replies = list(replies)
        self.respond = respond
        self.fail_first = list(fail_first)
        self.calls: list[list[ChatMessage]] = []

    @staticmethod
    def tool_call(tool_name: str, call_id: str | None = None, /, **arguments: Any) -> ToolCall:
        """A scripted request for tool `tool_name` with `arguments` (id: `call_<tool_name>`)."""
        return ToolCall(id=call_id or f"call_{tool_name}", name=tool_name, arguments=arguments)

    def reply_for(self, messages: Sequence[ChatMessage]) -> ChatMessage:
        """The scripted reply to `messages` (without usage): usable by test servers too."""
        msgs = list(messages)
        if self.respond is not None:
            return as_reply(self.respond(msgs))
        turn = sum(1 for m in msgs if m.role == MessageRole.ASSISTANT)
        if turn >= len(self.replies):
            raise ModelCallError(
                f"ScriptedChatModel has {len(self.replies)} replies but was asked for reply "
                f"#{turn + 1}; add replies to the script",
                provider=self.provider,
            )
        return as_reply(self.replies[turn])

    async def _chat_once(
        self,
        messages: Sequence[ChatMessage],
        *,
        model: str | None,
        tools: Sequence[Tool],
        output_schema: type[BaseModel] | None,
        options: Mapping[str, Any],
    ) -> ChatMessage:
        self.calls.append(list(messages))
        if self.fail_first:
            raise self.fail_first.pop(0)
        reply = self.reply_for(messages)
        usage = TokenUsage(input_tokens=count_tokens(messages), output_tokens=count_tokens([reply]))
        return reply.model_copy(update={"usage": usage})
