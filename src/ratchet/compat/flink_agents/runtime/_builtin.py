"""The built-in chat and tool actions every Flink Agents agent has.

The chat action answers a `ChatRequestEvent` (and, after tools ran, their
`ToolResponseEvent`) with the chat model setup it names; a reply with tool calls becomes a
`ToolRequestEvent`, a reply without one a `ChatResponseEvent`. The tool action runs the calls
and answers with a `ToolResponseEvent`. Every model and tool call is a durable call, so after a
crash a call that returned is not paid for again. The conversation of a request lives in the
run's sensory memory.
"""

from __future__ import annotations

import json
import re
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from ratchet.compat.flink_agents.api.agents.agent import STRUCTURED_OUTPUT
from ratchet.compat.flink_agents.api.chat_message import ChatMessage, MessageRole
from ratchet.compat.flink_agents.api.core_options import (
    AgentExecutionOptions,
    ErrorHandlingStrategy,
)
from ratchet.compat.flink_agents.api.events.chat_event import ChatRequestEvent, ChatResponseEvent
from ratchet.compat.flink_agents.api.events.event import Event
from ratchet.compat.flink_agents.api.events.tool_event import ToolRequestEvent, ToolResponseEvent
from ratchet.compat.flink_agents.api.memory_object import MemoryObject
from ratchet.compat.flink_agents.api.resource import ResourceType
from ratchet.compat.flink_agents.api.runner_context import RunnerContext
from ratchet.compat.flink_agents.api.tools.tool import FunctionTool
from ratchet.compat.flink_agents.api.tools.tool_parameter_injection import (
    InjectedArg,
    ToolParameterSource,
)

_CONVERSATIONS = "_flink_chat"  # request id -> the messages so far
_PENDING = "_flink_tool_requests"  # tool request id -> what to continue with


def _conversation(memory: MemoryObject, request_id: UUID) -> list[ChatMessage]:
    return list(memory.get(f"{_CONVERSATIONS}.{request_id}") or [])


def _strategy(ctx: RunnerContext) -> ErrorHandlingStrategy:
    value = ctx.config.get(AgentExecutionOptions.ERROR_HANDLING_STRATEGY)
    if isinstance(value, ErrorHandlingStrategy):
        return value
    return ErrorHandlingStrategy(str(value).lower())


def _structured(response: ChatMessage, schema: Any) -> ChatMessage:
    target = getattr(schema, "output_schema", schema)
    text = response.content.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    data = json.loads(fenced[1] if fenced else text)
    if isinstance(target, type) and issubclass(target, BaseModel):
        data = target.model_validate(data)
    extra = dict(response.extra_args)
    extra[STRUCTURED_OUTPUT] = data
    return response.model_copy(update={"extra_args": extra})


async def _chat(
    ctx: RunnerContext,
    request_id: UUID,
    model: str,
    messages: list[ChatMessage],
    prompt_args: dict[str, Any],
    output_schema: Any,
) -> None:
    setup: Any = ctx.get_resource(model, ResourceType.CHAT_MODEL)
    strategy = _strategy(ctx)
    attempts = 1
    if strategy is ErrorHandlingStrategy.RETRY:
        attempts += max(0, int(ctx.config.get(AgentExecutionOptions.MAX_RETRIES)))
    response: ChatMessage | None = None
    for attempt in range(attempts):
        try:
            response = await ctx.durable_execute_async(
                setup.chat, messages, prompt_args=prompt_args
            )
            break
        except Exception:
            if strategy is ErrorHandlingStrategy.IGNORE:
                return
            if attempt + 1 == attempts:
                raise
    assert response is not None
    memory = ctx.sensory_memory
    if response.tool_calls:
        request = ToolRequestEvent(model=model, tool_calls=response.tool_calls)
        memory.set(f"{_CONVERSATIONS}.{request_id}", [*messages, response])
        memory.set(
            f"{_PENDING}.{request.id}",
            {
                "request_id": request_id,
                "model": model,
                "prompt_args": dict(prompt_args),
                "output_schema": output_schema if _storable(output_schema) else None,
            },
        )
        ctx.send_event(request)
        return
    if output_schema is not None:
        response = _structured(response, output_schema)
    ctx.send_event(ChatResponseEvent(request_id=request_id, response=response))


def _storable(value: Any) -> bool:
    try:
        from ratchet.store import codec

        codec.check_admissible(value)
    except TypeError:
        return False
    return True


async def chat_model_action(event: Event, ctx: RunnerContext) -> None:
    """Built-in: ask the model for a chat request, or go on after its tools answered."""
    if event.type == ChatRequestEvent.EVENT_TYPE:
        request = ChatRequestEvent.from_event(event)
        assert request.id is not None
        await _chat(
            ctx,
            request.id,
            request.model,
            request.messages,
            request.prompt_args,
            request.output_schema,
        )
        return
    answer = ToolResponseEvent.from_event(event)
    memory = ctx.sensory_memory
    pending = memory.get(f"{_PENDING}.{answer.request_id}")
    if pending is None:
        return  # a tool response this action did not ask for
    state = pending.get_fields() if isinstance(pending, MemoryObject) else pending
    request_id = state["request_id"]
    messages = _conversation(memory, request_id)
    external = answer.external_ids
    for call_id, result in answer.responses.items():
        ext = external.get(call_id)
        messages.append(
            ChatMessage(
                role=MessageRole.TOOL,
                content=str(result),
                extra_args={"external_id": ext} if ext else {},
            )
        )
    await _chat(
        ctx,
        request_id,
        state["model"],
        messages,
        dict(state.get("prompt_args") or {}),
        state.get("output_schema"),
    )


def _injected(tool: Any, ctx: RunnerContext) -> dict[str, Any]:
    if not isinstance(tool, FunctionTool):
        return {}
    values: dict[str, Any] = {}
    for name, arg in tool.injected_args.items():
        values[name] = _inject(name, arg, ctx)
    return values


def _inject(name: str, arg: InjectedArg, ctx: RunnerContext) -> Any:
    key = arg.key or name
    if arg.source is ToolParameterSource.CONFIG:
        data = ctx.config.conf_data
        if key not in data:
            raise ValueError(
                f"tool argument {name!r} is injected from config key {key!r}, which is not set; "
                f"set it with env.get_config().set_str({key!r}, ...)"
            )
        return data[key]
    memory = (
        ctx.sensory_memory
        if arg.source is ToolParameterSource.SENSORY_MEMORY
        else ctx.short_term_memory
    )
    if not memory.is_exist(key):
        raise ValueError(
            f"tool argument {name!r} is injected from {arg.source.value} path {key!r}, which "
            f"holds nothing"
        )
    value = memory.get(key)
    if isinstance(value, MemoryObject):
        raise TypeError(
            f"tool argument {name!r}: {arg.source.value} path {key!r} is an object, not a value"
        )
    return value


async def tool_call_action(event: Event, ctx: RunnerContext) -> None:
    """Built-in: run the tool calls of a `ToolRequestEvent`."""
    request = ToolRequestEvent.from_event(event)
    responses: dict[Any, Any] = {}
    success: dict[Any, bool] = {}
    errors: dict[Any, str] = {}
    external: dict[Any, str | None] = {}
    for call in request.tool_calls:
        call_id = call.get("id")
        function = call.get("function") or {}
        name = str(function.get("name"))
        external[call_id] = call.get("original_id")
        try:
            tool: Any = ctx.get_resource(name, ResourceType.TOOL)
        except Exception as exc:  # noqa: BLE001 - reported to the model, as Flink Agents does
            responses[call_id] = f"Tool `{name}` does not exist."
            success[call_id] = False
            errors[call_id] = str(exc)
            continue
        try:
            kwargs = dict(function.get("arguments") or {})
            kwargs.update(_injected(tool, ctx))
            fn = tool.func if isinstance(tool, FunctionTool) else tool.call
            responses[call_id] = await ctx.durable_execute_async(fn, **kwargs)
            success[call_id] = True
        except Exception as exc:  # noqa: BLE001 - reported to the model, as Flink Agents does
            responses[call_id] = f"Tool `{name}` execute failed."
            success[call_id] = False
            errors[call_id] = str(exc)
    assert request.id is not None
    ctx.send_event(
        ToolResponseEvent(
            request_id=request.id,
            responses=responses,
            external_ids=external,
            success=success,
            error=errors,
        )
    )


ACTIONS = (
    (
        "chat_model_action",
        (ChatRequestEvent.EVENT_TYPE, ToolResponseEvent.EVENT_TYPE),
        chat_model_action,
    ),
    ("tool_call_action", (ToolRequestEvent.EVENT_TYPE,), tool_call_action),
)
