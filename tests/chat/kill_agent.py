"""The agent the kill tests run in a subprocess: Flink-style resources, one tool, the real
`openai` SDK against the test's server. Markers in $CHAT_MARKS tell the test where it is."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ratchet import InputEvent, OutputEvent, RunnerContext, action
from ratchet.agents.chat import (
    ChatAgent,
    ChatMessage,
    ChatModelSetup,
    ChatRequestEvent,
    ChatResponseEvent,
    OpenAIChatModel,
    Prompt,
    ResourceDescriptor,
    ToolContext,
    chat_model_connection,
    chat_model_setup,
    prompt,
    tool,
)

MARKS = Path(os.environ.get("CHAT_MARKS", "."))
HOLD_TOOL = os.environ.get("CHAT_HOLD_TOOL") == "1"


class KillAgent(ChatAgent):
    @tool
    @staticmethod
    def lookup_order(order_id: str, context: ToolContext) -> dict[str, Any]:
        """Look up an order's shipping status.

        Args:
            order_id: The order's id.
        """
        n = len(list(MARKS.glob("tool_start_*"))) + 1
        (MARKS / f"tool_start_{n}").write_text(context.idempotency_key)
        if HOLD_TOOL and n == 1:
            time.sleep(60)  # the test kills the process here
        (MARKS / f"tool_done_{n}").write_text(context.idempotency_key)
        return {"order_id": order_id, "status": "shipped", "carrier": "DHL"}

    @chat_model_connection
    @staticmethod
    def server() -> ResourceDescriptor:
        return ResourceDescriptor(
            OpenAIChatModel,
            model="gpt-test",
            api_key="sk-test",
            base_url=os.environ["CHAT_SERVER"] + "/v1",
            timeout=120,
        )

    @prompt
    @staticmethod
    def support_prompt() -> Prompt:
        return Prompt.from_messages([ChatMessage.system("You are the support desk of {shop}.")])

    @chat_model_setup
    @staticmethod
    def support() -> ResourceDescriptor:
        return ResourceDescriptor(
            ChatModelSetup, connection="server", prompt="support_prompt", tools=["lookup_order"]
        )

    @action(InputEvent)
    @staticmethod
    def ask(event: InputEvent, ctx: RunnerContext) -> None:
        ctx.send_event(
            ChatRequestEvent(
                model="support",
                messages=[ChatMessage.user(event.input["text"])],
                prompt_args={"shop": "Acme"},
            )
        )

    @action(ChatResponseEvent)
    @staticmethod
    def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        ctx.send_event(
            OutputEvent(
                output={
                    "reply": event.response.content,
                    "transcript": [m.model_dump(mode="json") for m in event.messages],
                    "tokens": event.usage.total_tokens,
                }
            )
        )
