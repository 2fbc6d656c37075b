"""`ReActAgent`: a ready agent that answers each input through the tool loop."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from ratchet.agents._agent import action
from ratchet.agents._context import RunnerContext
from ratchet.agents._events import InputEvent, OutputEvent
from ratchet.agents.chat._agent import ChatAgent, TokenBudget
from ratchet.agents.chat._events import ChatRequestEvent, ChatResponseEvent
from ratchet.agents.chat._messages import ChatMessage
from ratchet.agents.chat._model import ChatModel, ChatModelSetup
from ratchet.agents.chat._prompt import Prompt
from ratchet.agents.chat._tools import Tool

REACT_MODEL = "react_model"


class ReActAgent(ChatAgent):
    """Answer every input by reasoning and acting: the model calls tools until it can reply.

    How an input becomes the conversation: with no `prompt`, the input (a str, or a dict /
    model rendered as JSON) is the user message. A `prompt` without placeholders is the
    instructions, followed by the input as the user message. A `prompt` with placeholders is
    filled from the input's fields (a dict or model), or from `{input}` for a plain value.

    The output is the reply's text, or, with `output_schema`, the validated object as a dict.
    Declare it at module level (`agent = ReActAgent(...)`) and run `ratchet run file.py:agent`.
    """

    def __init__(
        self,
        model: ChatModel | ChatModelSetup,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        prompt: Prompt | str | None = None,
        output_schema: type[BaseModel] | None = None,
        *,
        max_turns: int | None = None,
        token_budget: TokenBudget | None = None,
        resources: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(model, ChatModelSetup):
            if tools or output_schema is not None:
                setup = ChatModelSetup(
                    model.connection,
                    model.model,
                    prompt=model.prompt,
                    tools=[*model.tools, *tools],
                    output_schema=output_schema or _schema_of(model),
                    max_turns=model.max_turns,
                    **model.options,
                )
            else:
                setup = model
        else:
            setup = ChatModelSetup(model, tools=list(tools), output_schema=output_schema)
        self.prompt = Prompt(prompt, name="react_prompt") if isinstance(prompt, str) else prompt
        super().__init__(
            resources={**(resources or {}), REACT_MODEL: setup},
            max_turns=max_turns,
            token_budget=token_budget,
        )

    def _messages(self, value: Any) -> list[ChatMessage]:
        as_text = value if isinstance(value, str) else json.dumps(_plain(value), sort_keys=True)
        p = self.prompt
        if p is None:
            return [ChatMessage.user(as_text)]
        if not p.arguments:
            return [*p.messages, ChatMessage.user(as_text)]
        args = _plain(value)
        if not isinstance(args, dict):
            args = {"input": value}
        return p.format_messages(args)

    @action(InputEvent, name="react_input")
    async def _react_input(self, event: InputEvent, ctx: RunnerContext) -> None:
        messages = self._messages(event.input)
        ctx.send_event(ChatRequestEvent(model=REACT_MODEL, messages=messages))

    @action(ChatResponseEvent, name="react_output")
    async def _react_output(self, event: ChatResponseEvent, ctx: RunnerContext) -> None:
        if isinstance(event.structured, BaseModel):
            ctx.send_event(OutputEvent(output=event.structured.model_dump(mode="json")))
        else:
            ctx.send_event(OutputEvent(output=event.response.content))


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


def _schema_of(setup: ChatModelSetup) -> Any:
    from ratchet.agents.chat._model import schema_class

    return schema_class(setup.output_schema) if setup.output_schema else None
