"""Anthropic's Messages API through the official `anthropic` SDK."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from ratchet.agents.chat._errors import ModelCallError
from ratchet.agents.chat._messages import ChatMessage, MessageRole, TokenUsage, ToolCall
from ratchet.agents.chat._model import ChatModel, RetryPolicy, schema_instruction
from ratchet.agents.chat._providers._common import require_key, require_sdk, sdk_error
from ratchet.agents.chat._ratelimit import RateLimit
from ratchet.agents.chat._tools import Tool


def to_anthropic(messages: Sequence[ChatMessage]) -> tuple[str, list[dict[str, Any]]]:
    """(system text, messages): consecutive tool results merge into one user turn."""
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == MessageRole.SYSTEM:
            system.append(m.content)
        elif m.role == MessageRole.TOOL:
            block = {
                "type": "tool_result",
                "tool_use_id": m.tool_call_id,
                "content": m.content,
                "is_error": m.is_error,
            }
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        elif m.role == MessageRole.ASSISTANT:
            blocks: list[dict[str, Any]] = []
            if m.content:
                blocks.append({"type": "text", "text": m.content})
            for tc in m.tool_calls:
                blocks.append(
                    {"type": "tool_use", "id": tc.id, "name": tc.name, "input": tc.arguments}
                )
            out.append({"role": "assistant", "content": blocks})
        else:
            out.append({"role": "user", "content": m.content})
    return "\n\n".join(system), out


class AnthropicChatModel(ChatModel):
    """Claude through the official `anthropic` SDK (extra `anthropic`).

    The key comes from `api_key` or `ANTHROPIC_API_KEY`, checked at start. Structured output
    is asked for with an instruction in the system prompt and validated by ratchet.
    """

    provider = "anthropic"

    def __init__(
        self,
        model: str | None = "claude-sonnet-4-5",
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: float = 60.0,
        max_tokens: int = 1024,
        retry: RetryPolicy | None = None,
        rate_limit: RateLimit | None = None,
        resource_name: str | None = None,
        probe_delay: float = 1.0,
        max_probe_delay: float = 60.0,
        **options: Any,
    ) -> None:
        super().__init__(
            model=model, retry=retry, rate_limit=rate_limit, resource_name=resource_name,
            probe_delay=probe_delay, max_probe_delay=max_probe_delay, timeout=timeout,
        )  # fmt: skip
        anthropic = require_sdk("anthropic", "anthropic")
        self._sdk = anthropic
        self.max_tokens = max_tokens
        self.options = options
        self.client = anthropic.AsyncAnthropic(
            api_key=require_key(api_key, "ANTHROPIC_API_KEY", type(self).__name__),
            base_url=base_url,
            timeout=timeout,
            max_retries=0,
        )

    def endpoint(self) -> str:
        return str(self.client.base_url).rstrip("/")

    def _error(self, exc: Exception) -> ModelCallError:
        return sdk_error(self._sdk, "anthropic", exc, (408, 409, 429, 529))

    async def _chat_once(
        self,
        messages: Sequence[ChatMessage],
        *,
        model: str | None,
        tools: Sequence[Tool],
        output_schema: type[BaseModel] | None,
        options: Mapping[str, Any],
    ) -> ChatMessage:
        system, wire = to_anthropic(messages)
        if output_schema is not None:
            system = f"{system}\n\n{schema_instruction(output_schema)}".strip()
        kwargs: dict[str, Any] = {"max_tokens": self.max_tokens, **self.options, **options}
        if system:
            kwargs["system"] = system
        if tools:
            kwargs["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters}
                for t in tools
            ]
        try:
            resp = await self.client.messages.create(model=model, messages=wire, **kwargs)
            blocks = list(resp.content)
            text = "".join(b.text for b in blocks if b.type == "text")
            calls = [
                ToolCall(id=b.id, name=b.name, arguments=dict(b.input or {}))
                for b in blocks
                if b.type == "tool_use"
            ]
            usage = TokenUsage(
                input_tokens=resp.usage.input_tokens or 0,
                output_tokens=resp.usage.output_tokens or 0,
            )
            stop = resp.stop_reason
        except self._sdk.AnthropicError as exc:
            raise self._error(exc) from exc
        except (ValueError, TypeError, AttributeError) as exc:
            raise self._error(exc) from exc
        return ChatMessage(
            role=MessageRole.ASSISTANT,
            content=text,
            tool_calls=calls,
            extras={"finish_reason": stop},
            usage=usage,
        )
