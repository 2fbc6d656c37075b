"""The agent of tests/kill/test_chat_outage.py: each input is one question to an
OpenAI-compatible server ($CHAT_SERVER) through the real `openai` SDK; the test takes the
server down, throttles it, and kills the job meanwhile."""

from __future__ import annotations

import os

from ratchet import InputEvent, OutputEvent, RunnerContext, action
from ratchet.agents.chat import (
    ChatAgent,
    ChatMessage,
    ChatRequestEvent,
    ChatResponseEvent,
    OpenAIChatModel,
    RateLimit,
    RetryPolicy,
    chat_model_connection,
)


class Answerer(ChatAgent):
    @chat_model_connection
    @staticmethod
    def provider() -> OpenAIChatModel:
        return OpenAIChatModel(
            "gpt-test",
            api_key="sk-test",
            base_url=os.environ["CHAT_SERVER"] + "/v1",
            timeout=10,
            retry=RetryPolicy(max_attempts=2, initial_backoff=0.05, max_backoff=2, jitter=0),
            rate_limit=RateLimit(concurrency=16),
            probe_delay=0.2,
            max_probe_delay=1.0,
        )

    @action(InputEvent)
    @staticmethod
    def ask(event: InputEvent, ctx: RunnerContext) -> None:
        question = f"question {event.input['n']}"
        ctx.send_event(ChatRequestEvent(model="provider", messages=[ChatMessage.user(question)]))

    @action(ChatResponseEvent)
    @staticmethod
    def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        ctx.send_event(OutputEvent(output={"answer": event.response.content}))
