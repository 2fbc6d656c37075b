"""Small chat agents several test files run (one definition, so none drifts)."""

from __future__ import annotations

from ratchet import InputEvent, OutputEvent, RunnerContext, action
from ratchet.agents.chat import (
    ChatAgent,
    ChatMessage,
    ChatModelSetup,
    ChatRequestEvent,
    ChatResponseEvent,
    ScriptedChatModel,
    chat_model_setup,
)


class Asker(ChatAgent):
    """One model call per input (a scripted model, setup "m"), then one output."""

    @chat_model_setup
    @staticmethod
    def m() -> ChatModelSetup:
        return ChatModelSetup(ScriptedChatModel(respond=lambda msgs: "a short answer"))

    @action(InputEvent)
    @staticmethod
    def ask(event: InputEvent, ctx: RunnerContext) -> None:
        ctx.send_event(ChatRequestEvent(model="m", messages=[ChatMessage.user("hi")]))

    @action(ChatResponseEvent)
    @staticmethod
    def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        ctx.send_event(OutputEvent(output="ok"))
