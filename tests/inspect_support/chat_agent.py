"""A chat agent (scripted model) whose memory holds ratchet's chat types and user-registered
types, for tests/test_inspect.py.

`Verdict` and `Mood` are registered when this module is loaded (`inspect --agent` loads it);
`Note` is registered by `inspect_extra`, which only the action imports, so `inspect --agent`
does not load it.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel

from ratchet import InputEvent, OutputEvent, RunnerContext, action, register_type
from ratchet.agents.chat import (
    ChatAgent,
    ChatMessage,
    ChatModelSetup,
    ChatRequestEvent,
    ChatResponseEvent,
    MessageRole,
    ScriptedChatModel,
    ToolCall,
    chat_model_setup,
)


class Verdict(BaseModel):
    label: str
    score: int


class Mood(StrEnum):
    CALM = "calm"
    ANGRY = "angry"


register_type(Verdict, "inspect_test.Verdict")
register_type(Mood, "inspect_test.Mood")


def verdict_for(messages: list[ChatMessage]) -> Verdict:
    question = next(m.content for m in messages if m.role == MessageRole.USER)
    return Verdict(label=question.split()[0], score=len(question.split()))


class InspectedAgent(ChatAgent):
    @chat_model_setup
    @staticmethod
    def judge() -> ChatModelSetup:
        return ChatModelSetup(ScriptedChatModel(respond=verdict_for), output_schema=Verdict)

    @action(InputEvent)
    @staticmethod
    def ask(event: InputEvent, ctx: RunnerContext) -> None:
        ctx.send_event(
            ChatRequestEvent(model="judge", messages=[ChatMessage.user(event.input["q"])])
        )

    @action(ChatResponseEvent)
    @staticmethod
    def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        from inspect_extra import Note  # registers inspect_test.Note only when this runs

        verdict = event.structured
        assert isinstance(verdict, Verdict)
        mem = ctx.short_term_memory
        mem.set("verdict", verdict)
        mem.set("reply", event.response)
        mem.set("call", ToolCall(id="c1", name="lookup", arguments={"order": "A-1"}))
        mem.set("moods", {(ctx.key, Mood.CALM): [Mood.ANGRY]})
        mem.set("note", Note(text=verdict.label, tags=("a", "b")))
        ctx.send_event(OutputEvent(output={"label": verdict.label}))
