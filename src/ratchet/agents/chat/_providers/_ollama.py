"""Local models through the official `ollama` SDK."""

from __future__ import annotations

import contextvars
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from ratchet.agents.chat._errors import ModelCallError
from ratchet.agents.chat._messages import ChatMessage, MessageRole, TokenUsage, ToolCall
from ratchet.agents.chat._model import ChatModel, RetryPolicy
from ratchet.agents.chat._providers._common import (
    loads_arguments,
    malformed,
    parse_retry_after,
    require_sdk,
)
from ratchet.agents.chat._ratelimit import RateLimit
from ratchet.agents.chat._tools import Tool

# The SDK's ResponseError drops the headers; a response hook keeps Retry-After for us.
_retry_after: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ratchet_ollama_retry_after", default=None
)


async def _keep_retry_after(response: Any) -> None:
    _retry_after.set(response.headers.get("retry-after"))


def to_ollama_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role.value, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = [
                {"function": {"name": tc.name, "arguments": tc.arguments}} for tc in m.tool_calls
            ]
        if m.role == MessageRole.TOOL and m.name:
            msg["tool_name"] = m.name
        out.append(msg)
    return out


class OllamaChatModel(ChatModel):
    """A model served by Ollama (extra `ollama`). No API key; `host` defaults to `OLLAMA_HOST`
    or http://127.0.0.1:11434. Structured output uses Ollama's `format` (a JSON schema)."""

    provider = "ollama"

    def __init__(
        self,
        model: str | None = "qwen3:8b",
        *,
        host: str | None = None,
        timeout: float = 120.0,
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
        ollama = require_sdk("ollama", "ollama")
        self._sdk = ollama
        self.options = options
        self.client = ollama.AsyncClient(
            host=host, timeout=timeout, event_hooks={"response": [_keep_retry_after]}
        )

    def endpoint(self) -> str:
        return str(self.client._client.base_url).rstrip("/")

    def _error(self, exc: Exception) -> ModelCallError:
        sdk = self._sdk
        if isinstance(exc, sdk.ResponseError):
            status = exc.status_code
            return ModelCallError(
                f"ollama: HTTP {status}: {exc.error}",
                provider="ollama",
                status=status,
                transient=status in (408, 409, 429) or status >= 500,
                retry_after=parse_retry_after(_retry_after.get()),
            )
        if isinstance(exc, ConnectionError) or type(exc).__name__.endswith(
            ("TimeoutException", "Timeout", "ConnectError", "ReadError", "RemoteProtocolError")
        ):
            return ModelCallError(
                f"ollama: {type(exc).__name__}: {exc}", provider="ollama", transient=True
            )
        return malformed("ollama", exc)

    async def _chat_once(
        self,
        messages: Sequence[ChatMessage],
        *,
        model: str | None,
        tools: Sequence[Tool],
        output_schema: type[BaseModel] | None,
        options: Mapping[str, Any],
    ) -> ChatMessage:
        merged = {**self.options, **options}
        kwargs: dict[str, Any] = {}
        if merged:
            kwargs["options"] = merged
        if tools:
            kwargs["tools"] = [{"type": "function", "function": t.spec()} for t in tools]
        if output_schema is not None:
            kwargs["format"] = output_schema.model_json_schema()
        _retry_after.set(None)
        try:
            resp = await self.client.chat(
                model=model or "", messages=to_ollama_messages(messages), **kwargs
            )
            msg = resp.message
            calls = []
            for i, tc in enumerate(msg.tool_calls or []):
                args, _ = loads_arguments(tc.function.arguments)
                calls.append(
                    ToolCall(id=f"ollama_{i}", name=tc.function.name, arguments=dict(args))
                )
            usage = TokenUsage(
                input_tokens=resp.prompt_eval_count or 0, output_tokens=resp.eval_count or 0
            )
        except Exception as exc:  # noqa: BLE001 - the SDK raises httpx and pydantic errors raw
            raise self._error(exc) from exc
        return ChatMessage(
            role=MessageRole.ASSISTANT,
            content=msg.content or "",
            tool_calls=calls,
            extras={"finish_reason": resp.done_reason},
            usage=usage,
        )
