"""`ChatAgent`: an Agent with the built-in chat and tool actions and named resources."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic
import pydantic_core

from ratchet._errors import ConfigError
from ratchet.agents._agent import Agent, action
from ratchet.agents._context import RunnerContext, last_call_replayed
from ratchet.agents._events import ErrorEvent, Event, OutputEvent
from ratchet.agents.chat._approval import (
    ApprovalDecision,
    approval_call_id,
    approval_request_record,
    approval_signal,
)
from ratchet.agents.chat._errors import (
    ChatError,
    StructuredOutputError,
    TokenBudgetExceededError,
    TurnLimitError,
)
from ratchet.agents.chat._events import (
    ChatRequestEvent,
    ChatResponseEvent,
    ToolApprovalRequestEvent,
    ToolRequestEvent,
    ToolResponseEvent,
)
from ratchet.agents.chat._mcp import MCPPrompt
from ratchet.agents.chat._messages import ChatMessage, MessageRole, TokenUsage, ToolCall
from ratchet.agents.chat._model import parse_structured
from ratchet.agents.chat._prompt import Prompt
from ratchet.agents.chat._resources import Resources, ResourceType
from ratchet.agents.chat._tools import (
    Tool,
    ToolContext,
    format_validation_error,
    render_result,
)

log = logging.getLogger("ratchet.chat")

_ROOT = "ratchet_chat"
_USAGE = f"{_ROOT}.usage"


@dataclass(frozen=True)
class TokenBudget:
    """Token limits; a model call is not made once a limit is reached.

    `per_run` counts the tokens of one input's run; `per_key` all tokens of a key, across runs
    (it lives in the key's short-term memory, so it survives restarts). None means no limit.
    """

    per_run: int | None = None
    per_key: int | None = None


def chat_usage(ctx: RunnerContext) -> dict[str, TokenUsage]:
    """Tokens used so far by this run and by this key (as this task sees memory)."""
    return {
        "run": ctx.sensory_memory.get(_USAGE) or TokenUsage(),
        "key": ctx.short_term_memory.get(_USAGE) or TokenUsage(),
    }


def _request_id(task_id: str) -> str:
    return hashlib.sha256(task_id.encode()).hexdigest()[:16]


def _run_seq(ctx: RunnerContext) -> Any:
    # The run's input sequence number makes ids unique across a key's runs (task ids repeat).
    return ctx.seq


def idempotency_key(ctx: RunnerContext, index: int, call: ToolCall) -> str:
    """The stable id of one tool call: the same after recovery, distinct from every other."""
    raw = f"{ctx.key!r}|{_run_seq(ctx)}|{ctx.task_id}|{index}|{call.id}"
    return "rt-" + hashlib.sha256(raw.encode()).hexdigest()[:32]


def _tool_message(call: ToolCall, content: str, *, error: bool = False) -> ChatMessage:
    return ChatMessage(
        role=MessageRole.TOOL,
        content=content,
        tool_call_id=call.id,
        name=call.name,
        extras={"is_error": True} if error else {},
    )


class ChatAgent(Agent):
    """An `Agent` with the built-in chat and tool actions, and resources declared by name.

    Declare resources as staticmethods marked `@chat_model_connection`, `@chat_model_setup`,
    `@prompt` and `@tool` (as in Flink Agents), or pass `resources={name: obj}`. They are
    built when the agent is constructed, so a missing API key or an unknown name fails at
    start. Then any action may `ctx.send_event(ChatRequestEvent(model="setup name", ...))`
    and handle the `ChatResponseEvent`; tool calls in between run durably.

    `max_turns` bounds model calls per request (a setup's own `max_turns` wins);
    `token_budget` limits tokens per run and per key; `structured_retries` is how often a
    reply that fails its output schema is sent back to the model with the validation errors.
    """

    max_turns: int = 10
    token_budget: TokenBudget | None = None
    structured_retries: int = 1

    def __init__(
        self,
        *,
        resources: Mapping[str, Any] | None = None,
        max_turns: int | None = None,
        token_budget: TokenBudget | None = None,
        structured_retries: int | None = None,
    ) -> None:
        if max_turns is not None:
            if max_turns < 1:
                raise ConfigError("max_turns must be >= 1")
            self.max_turns = max_turns
        if token_budget is not None:
            self.token_budget = token_budget
        if structured_retries is not None:
            self.structured_retries = structured_retries
        self._resources = Resources.from_agent(self, resources)

    @property
    def resources(self) -> Resources:
        res = self.__dict__.get("_resources")
        if res is None:  # a subclass __init__ that did not call super().__init__()
            res = self._resources = Resources.from_agent(self)
        return res

    def get_resource(self, name: str, kind: ResourceType) -> Any:
        """A declared resource by name (Flink Agents' `get_resource`)."""
        return self.resources.get(name, kind)

    # -- durable calls (their qualified names are stored in the journal: keep them) ---------

    async def _call_model(
        self, setup_name: str, messages: list[ChatMessage], output_schema: str | None
    ) -> ChatMessage:
        setup = self.resources.setup(setup_name)
        return await setup.model.chat(
            messages,
            tools=list((await setup.all_tools()).values()),  # with its MCP servers' tools
            output_schema=setup.schema(output_schema),
            model=setup.model_name,
            options=setup.options,
        )

    async def _call_tool(
        self, setup_name: str, call: ToolCall, key: str, invalid: str | None, run_key: Any
    ) -> ChatMessage:
        setup = self.resources.setup(setup_name)
        tools = setup.tools
        if call.name not in tools and setup.mcp_servers:
            try:
                tools = await setup.all_tools()
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - the model reads the failure
                return _tool_message(
                    call,
                    f"ERROR: tool {call.name!r} is unavailable: cannot list the tools of this "
                    f"setup's MCP servers ({type(exc).__name__}: {exc})",
                    error=True,
                )
        tool_obj = tools.get(call.name)
        if tool_obj is None:
            known = ", ".join(sorted(tools)) or "none"
            return _tool_message(
                call, f"ERROR: there is no tool named {call.name!r}; available: {known}", error=True
            )
        if invalid:
            return _tool_message(call, f"ERROR: tool {call.name!r}: {invalid}", error=True)
        context = ToolContext(call.name, call.id, key, run_key)
        try:
            value = await tool_obj.invoke(call.arguments, context)
        except pydantic.ValidationError as exc:
            return _tool_message(
                call,
                f"ERROR: invalid arguments for tool {call.name!r}: {format_validation_error(exc)}",
                error=True,
            )
        except Exception as exc:  # noqa: BLE001 - the model reads the failure
            log.info("tool %s failed: %s: %s", call.name, type(exc).__name__, exc)
            return _tool_message(
                call,
                f"ERROR: tool {call.name!r} raised {type(exc).__name__}: {exc}",
                error=True,
            )
        try:
            text = render_result(value)
        except (pydantic_core.PydanticSerializationError, TypeError, ValueError) as exc:
            # The tool ran (its side effect happened): the model reads why its value cannot
            # be sent, as for any tool failure. Failing the run instead made a redrive run
            # the tool again under a new idempotency key.
            log.info("tool %s returned a value JSON cannot hold: %s", call.name, exc)
            return _tool_message(
                call,
                f"ERROR: tool {call.name!r} returned a value that cannot be sent as JSON "
                f"({type(value).__name__}): {exc}",
                error=True,
            )
        return _tool_message(call, text)

    async def _call_prompt(self, setup_name: str, prompt_args: dict[str, Any]) -> list[ChatMessage]:
        prompt = self.resources.setup(setup_name).prompt
        assert isinstance(prompt, MCPPrompt)
        return await prompt.fetch(prompt_args)

    # -- built-in actions -------------------------------------------------------------------

    @action(ChatRequestEvent, ToolResponseEvent, name="ratchet_chat")
    async def _ratchet_chat(self, event: Event, ctx: RunnerContext) -> None:
        """Start a chat request or continue it with tool results; call the model once."""
        if isinstance(event, ChatRequestEvent):
            rid = _request_id(ctx.task_id)
            setup = self.resources.setup(event.model)
            if isinstance(setup.prompt, MCPPrompt):  # fetched from its server, durably
                fetched = await ctx.durable_execute_async(
                    self._call_prompt,
                    event.model,
                    dict(event.prompt_args),
                    resource=setup.prompt.server.resource,
                )
                messages = fetched + list(event.messages)
            else:
                messages = self._initial_messages(setup.prompt, event)
            state: dict[str, Any] = {
                "model": event.model,
                "messages": messages,
                "turns": 0,
                "fixes": 0,
                "schema": event.output_schema or setup.output_schema,
                "usage": TokenUsage(),
            }
        else:
            assert isinstance(event, ToolResponseEvent)
            rid = event.request_id
            state = ctx.sensory_memory.get(f"{_ROOT}.requests.{rid}")
            if state is None:
                raise ChatError(
                    f"tool results arrived for chat request {rid}, which has no transcript in "
                    f"sensory memory (was the ToolResponseEvent sent by hand?)"
                )
            state["messages"].extend(event.responses)
        try:
            await self._turn(rid, state, event, ctx)
        except (TurnLimitError, TokenBudgetExceededError, StructuredOutputError) as exc:
            ctx.sensory_memory.delete(f"{_ROOT}.requests.{rid}")
            ctx.send_event(
                ErrorEvent(
                    action="ratchet_chat",
                    error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                    message=str(exc),
                    event_type=type(event).event_name,
                )
            )

    def _initial_messages(
        self, prompt: Prompt | None, event: ChatRequestEvent
    ) -> list[ChatMessage]:
        if prompt is not None:
            return prompt.format_messages(event.prompt_args) + list(event.messages)
        if event.prompt_args:
            return Prompt(list(event.messages), name="request").format_messages(event.prompt_args)
        return list(event.messages)

    def _limits(self, ctx: RunnerContext) -> TokenBudget | None:
        raw = ctx.config.get("token_budget") if isinstance(ctx.config, dict) else None
        if isinstance(raw, dict):
            return TokenBudget(per_run=raw.get("per_run"), per_key=raw.get("per_key"))
        return self.token_budget

    def _check_budget(self, rid: str, model: str, ctx: RunnerContext) -> None:
        budget = self._limits(ctx)
        if budget is None:
            return
        used = chat_usage(ctx)
        for scope, limit in (("run", budget.per_run), ("key", budget.per_key)):
            spent = used[scope].total_tokens
            if limit is not None and spent >= limit:
                raise TokenBudgetExceededError(
                    f"token budget per {scope} exhausted: {spent} of {limit} tokens used "
                    f"(key {ctx.key!r}); chat request {rid} on {model!r} makes no further model "
                    f"call. Raise TokenBudget.per_{scope} to allow more"
                )

    async def _turn(
        self, rid: str, state: dict[str, Any], event: Event, ctx: RunnerContext
    ) -> None:
        path = f"{_ROOT}.requests.{rid}"
        setup = self.resources.setup(state["model"])
        limit = setup.max_turns or self.max_turns
        while True:
            if state["turns"] >= limit:
                raise TurnLimitError(
                    f"chat request {rid} on {state['model']!r} reached its turn limit of {limit} "
                    f"model calls without a final reply; the model keeps calling tools. Raise "
                    f"max_turns (on the ChatModelSetup or the agent) if this is legitimate"
                )
            self._check_budget(rid, state["model"], ctx)
            state["turns"] += 1
            # resource=: a provider down past its RetryPolicy pauses the stream (the call
            # waits, probing) instead of failing the run.
            reply = await ctx.durable_execute_async(
                self._call_model,
                state["model"],
                state["messages"],
                state["schema"],
                resource=setup.model.resource,
            )
            usage = reply.usage or TokenUsage()
            ctx.trace_note(
                "model_call",
                model=state["model"],
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                finish_reason=(reply.extras or {}).get("finish_reason"),
                replayed=last_call_replayed(),
            )
            if not last_call_replayed():
                # Tokens paid for by this process; a reply from the journal cost nothing now.
                ctx.metrics._inc_own("chat.model_calls")
                ctx.metrics._inc_own("chat.tokens.input", usage.input_tokens)
                ctx.metrics._inc_own("chat.tokens.output", usage.output_tokens)
                # The same per model (the setup name): NAME[model], read by the supervisor's
                # /metrics as a `model` label.
                ctx.metrics._inc_own(f"chat.model_calls[{state['model']}]")
                ctx.metrics._inc_own(f"chat.tokens.input[{state['model']}]", usage.input_tokens)
                ctx.metrics._inc_own(f"chat.tokens.output[{state['model']}]", usage.output_tokens)
            state["usage"] = state["usage"] + usage
            for mem in (ctx.sensory_memory, ctx.short_term_memory):
                mem.set(_USAGE, (mem.get(_USAGE) or TokenUsage()) + usage)
            log.debug("model %s: %s tokens (request %s)", state["model"], usage.total_tokens, rid)
            state["messages"].append(reply)
            if reply.tool_calls:
                ctx.sensory_memory.set(path, state)
                ctx.send_event(
                    ToolRequestEvent(
                        request_id=rid, model=state["model"], tool_calls=reply.tool_calls
                    )
                )
                return
            structured = None
            schema = setup.schema(state["schema"])
            if schema is not None:
                try:
                    structured = parse_structured(reply.content, schema)
                except pydantic.ValidationError as exc:
                    problem = format_validation_error(exc)
                    if state["fixes"] >= self.structured_retries:
                        raise StructuredOutputError(
                            f"the reply of {state['model']!r} to chat request {rid} does not "
                            f"validate against output schema {state['schema']!r}: {problem}"
                        ) from None
                    state["fixes"] += 1
                    state["messages"].append(
                        ChatMessage.user(
                            f"Your reply does not validate against the required JSON schema "
                            f"({problem}). Reply again with only the corrected JSON object."
                        )
                    )
                    continue
            ctx.sensory_memory.delete(path)
            ctx.send_event(
                ChatResponseEvent(
                    request_id=rid,
                    model=state["model"],
                    response=reply,
                    messages=state["messages"],
                    output_schema=state["schema"],
                    structured=structured,
                    usage=state["usage"],
                )
            )
            return

    @action(ToolRequestEvent, name="ratchet_tools")
    async def _ratchet_tools(self, event: ToolRequestEvent, ctx: RunnerContext) -> None:
        """Run the requested tools, concurrently, each through a durable call.

        If a call needs approval, nothing runs here: this task asks for the approvals (its
        outputs are released when it commits) and the `ratchet_tool_approval` action, which
        hears the `ToolApprovalRequestEvent`, waits for them and runs the calls.
        """
        reply_extras = self._invalid_arguments(event.request_id, ctx)
        approval_ids = self._approvals_needed(event, reply_extras, ctx)
        if any(approval_ids):
            self._request_approvals(event, approval_ids, ctx)
            return
        calls = [
            ctx.durable_execute_async(
                self._call_tool,
                event.model,
                call,
                idempotency_key(ctx, i, call),
                reply_extras.get(call.id),
                ctx.key,
            )
            for i, call in enumerate(event.tool_calls)
        ]
        results = await asyncio.gather(*calls)
        ctx.send_event(
            ToolResponseEvent(request_id=event.request_id, model=event.model, responses=results)
        )

    def _invalid_arguments(self, request_id: str, ctx: RunnerContext) -> dict[str, str]:
        """{tool call id: problem} for calls whose arguments the provider could not parse."""
        state = ctx.sensory_memory.get(f"{_ROOT}.requests.{request_id}")
        if state is not None and state["messages"]:
            return state["messages"][-1].extras.get("invalid_arguments", {}) or {}
        return {}

    # -- tool calls that need approval --------------------------------------------------------

    def _approvals_needed(
        self, event: ToolRequestEvent, invalid: Mapping[str, str], ctx: RunnerContext
    ) -> list[str | None]:
        """The approval call id of each call that needs one, None for the others.

        A call of an unknown tool, or with arguments that do not validate, needs none: it
        cannot run, and the model is told so at once, as without approval.
        """
        tools = self.resources.setup(event.model).tools
        ids: list[str | None] = []
        for i, call in enumerate(event.tool_calls):
            tool_obj = tools.get(call.name)
            needed = (
                tool_obj is not None
                and tool_obj.requires_approval
                and not invalid.get(call.id)
                and _validates(tool_obj.validate_arguments, call.arguments)
            )
            ids.append(approval_call_id(ctx.key, ctx.seq, ctx.task_id, i, call) if needed else None)
        return ids

    def _request_approvals(
        self, event: ToolRequestEvent, approval_ids: list[str | None], ctx: RunnerContext
    ) -> None:
        tools = self.resources.setup(event.model).tools
        for call, call_id in zip(event.tool_calls, approval_ids, strict=True):
            if call_id is not None:
                description = tools[call.name].description
                record = approval_request_record(call_id, call, event.request_id, description)
                ctx.send_event(OutputEvent(output=record))
        ctx.send_event(
            ToolApprovalRequestEvent(
                request_id=event.request_id,
                model=event.model,
                tool_calls=event.tool_calls,
                approval_ids=approval_ids,
            )
        )

    @action(ToolApprovalRequestEvent, name="ratchet_tool_approval")
    async def _ratchet_tool_approval(
        self, event: ToolApprovalRequestEvent, ctx: RunnerContext
    ) -> None:
        """Wait for each approval, then run the approved calls (and those that need none).

        Waits are durable (the run is parked while it waits, and a restart waits again for
        the same signals); the calls then go through durable calls like any tool call.
        Rejected calls, and approved ones whose edited arguments do not validate, are answered
        with a tool message saying so; the model reads it and goes on.
        """
        decisions: dict[int, ApprovalDecision] = {}
        for i, call_id in enumerate(event.approval_ids):
            if call_id is not None:
                value = await ctx.wait_for_signal(approval_signal(call_id))
                decisions[i] = ApprovalDecision.from_signal(call_id, value)
                if decisions[i].malformed:
                    log.warning("key %r: %s", ctx.key, decisions[i].reason)
        tools = self.resources.setup(event.model).tools
        reply_extras = self._invalid_arguments(event.request_id, ctx)
        pending: list[Awaitable[ChatMessage]] = []
        ran: dict[int, ApprovalDecision] = {}
        for i, call in enumerate(event.tool_calls):
            decision = decisions.get(i)
            if decision is None:  # needed no approval: as in the flow without approvals
                run_call, invalid = call, reply_extras.get(call.id)
            else:
                decided = _decided_call(call, decision, tools.get(call.name))
                if isinstance(decided, ChatMessage):  # rejected, or an invalid edit
                    pending.append(_ready(decided))
                    continue
                run_call, invalid, ran[i] = decided, None, decision
            pending.append(
                ctx.durable_execute_async(
                    self._call_tool,
                    event.model,
                    run_call,
                    idempotency_key(ctx, i, call),  # of the model's call: stable under edits
                    invalid,
                    ctx.key,
                )
            )
        results = list(await asyncio.gather(*pending))
        for i, decision in ran.items():
            results[i] = _approved(results[i], decision)
        ctx.send_event(
            ToolResponseEvent(request_id=event.request_id, model=event.model, responses=results)
        )


def _validates(validate: Callable[[dict[str, Any]], Any], arguments: dict[str, Any]) -> bool:
    try:
        validate(arguments)
    except pydantic.ValidationError:
        return False
    return True


def _decided_call(
    call: ToolCall, decision: ApprovalDecision, tool_obj: Tool | None
) -> ToolCall | ChatMessage:
    """The call to run as decided (edited arguments in place), or the answer to the model."""
    if not decision.approved:
        text = (
            f"REJECTED: a reviewer did not approve this call of tool {call.name!r}; it did not run."
        )
        if decision.reason:
            text += f" Reason: {decision.reason}"
        return _with_approval(_tool_message(call, text, error=True), decision)
    if decision.arguments is None:
        return call
    if tool_obj is not None:  # (a tool the agent no longer has is reported by _call_tool)
        try:
            tool_obj.validate_arguments(decision.arguments)
        except pydantic.ValidationError as exc:
            text = (
                f"ERROR: a reviewer approved this call of tool {call.name!r} with changed "
                f"arguments {_json(decision.arguments)}, which are invalid "
                f"({format_validation_error(exc)}); the tool did not run."
            )
            return _with_approval(_tool_message(call, text, error=True), decision)
    return call.model_copy(update={"arguments": decision.arguments})


async def _ready(message: ChatMessage) -> ChatMessage:
    return message


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)


def _with_approval(message: ChatMessage, decision: ApprovalDecision) -> ChatMessage:
    extras = {**message.extras, "approval": decision.extras()}
    return message.model_copy(update={"extras": extras})


def _approved(message: ChatMessage, decision: ApprovalDecision) -> ChatMessage:
    """The result of an approved call, saying so (and telling the model of changed arguments)."""
    if decision.arguments is not None:
        note = "NOTE: a reviewer approved this call with changed arguments: "
        message = message.model_copy(
            update={"content": f"{note}{_json(decision.arguments)}\n{message.content}"}
        )
    return _with_approval(message, decision)
