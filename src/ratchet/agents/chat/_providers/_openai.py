"""OpenAI and every OpenAI-compatible server (vLLM, llama.cpp, LM Studio) through `openai`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from ratchet.agents.chat._errors import ModelCallError
from ratchet.agents.chat._messages import ChatMessage, MessageRole, TokenUsage, ToolCall
from ratchet.agents.chat._model import ChatModel, RetryPolicy
from ratchet.agents.chat._providers._common import (
    loads_arguments,
    require_key,
    require_sdk,
    sdk_error,
)
from ratchet.agents.chat._ratelimit import RateLimit
from ratchet.agents.chat._tools import Tool


def to_openai_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == MessageRole.TOOL:
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content})
        elif m.role == MessageRole.ASSISTANT and m.tool_calls:
            out.append(
                {
                    "role": "assistant",
                    "content": m.content or None,
                    "tool_calls": [
                        {
                            "id": tc.id,
                            "type": "function",
                            "function": {
                                "name": tc.name,
                                "arguments": json.dumps(tc.arguments, sort_keys=True),
                            },
                        }
                        for tc in m.tool_calls
                    ],
                }
            )
        else:
            out.append({"role": m.role.value, "content": m.content})
    return out


class OpenAIChatModel(ChatModel):
    """Chat completions through the official `openai` SDK (extra `openai`).

    The key comes from `api_key` or `OPENAI_API_KEY` and is checked here, at start. `base_url`
    (or `OPENAI_BASE_URL`) points it at any OpenAI-compatible server. The SDK's own retries are
    off: `retry` (a `RetryPolicy`) decides, so retry behaviour is the same for every provider.
    """

    provider = "openai"

    def __init__(
        self,
        model: str | None = "gpt-4o-mini",
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: float = 60.0,
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
        openai = require_sdk("openai", "openai")
        self._sdk = openai
        self.options = options
        self.client = openai.AsyncOpenAI(
            api_key=require_key(api_key, "OPENAI_API_KEY", type(self).__name__),
            base_url=base_url,
            timeout=timeout,
            max_retries=0,
        )

    def endpoint(self) -> str:
        return str(self.client.base_url).rstrip("/")

    def _error(self, exc: Exception) -> ModelCallError:
        return sdk_error(self._sdk, "openai", exc, (408, 409, 429))

    async def _chat_once(
        self,
        messages: Sequence[ChatMessage],
        *,
        model: str | None,
        tools: Sequence[Tool],
        output_schema: type[BaseModel] | None,
        options: Mapping[str, Any],
    ) -> ChatMessage:
        kwargs: dict[str, Any] = {**self.options, **options}
        if tools:
            kwargs["tools"] = [{"type": "function", "function": t.spec()} for t in tools]
        if output_schema is not None:
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": output_schema.__name__,
                    "schema": output_schema.model_json_schema(),
                },
            }
        try:
            resp = await self.client.chat.completions.create(
                model=model, messages=to_openai_messages(messages), **kwargs
            )
        except self._sdk.OpenAIError as exc:
            raise self._error(exc) from exc
        except (ValueError, TypeError, AttributeError, IndexError) as exc:
            raise self._error(exc) from exc
        try:  # a reply of the wrong shape (no message, a tool call without id) is malformed
            choice = resp.choices[0]
            msg = choice.message
            calls: list[ToolCall] = []
            extras: dict[str, Any] = {"finish_reason": choice.finish_reason}
            for tc in msg.tool_calls or []:
                args, err = loads_arguments(tc.function.arguments)
                calls.append(ToolCall(id=tc.id, name=tc.function.name, arguments=args))
                if err:
                    extras.setdefault("invalid_arguments", {})[tc.id] = err
            usage = TokenUsage(
                input_tokens=getattr(resp.usage, "prompt_tokens", 0) or 0,
                output_tokens=getattr(resp.usage, "completion_tokens", 0) or 0,
            )
            return ChatMessage(
                role=MessageRole.ASSISTANT,
                content=msg.content or "",
                tool_calls=calls,
                extras=extras,
                usage=usage,
            )
        except (ValueError, TypeError, AttributeError, IndexError) as exc:  # pydantic's too
            raise self._error(exc) from exc
