"""The agent of the supervised end-to-end recovery test (the flow of the Flink Agents e2e).

It writes a non-UTF-8 blob to short-term memory, bumps a process-local counter, and asks the
scripted model, which calls one tool. The tool marks `tool-entered` and blocks until the
test writes `release`. When the reply arrives (in whichever process), the agent checks what
survived and writes `verdict.json` before raising on any mismatch.
"""

from __future__ import annotations

import json
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
    MessageRole,
    ScriptedChatModel,
    ToolCall,
    chat_model_connection,
    chat_model_setup,
    tool,
)

HANDSHAKE = Path(os.environ.get("E2E_DIR", "."))
BLOB = b"\xff\xfe\x00\x80ratchet\xc3\x28"  # not valid UTF-8
ROUND_ONE = "round-1-marker"
SENTINEL = "released-sentinel"

# Process-local: never checkpointed. A restored process starts them at 0.
COUNTERS = {"inputs_seen": 0, "tool_entries": 0}


class RecoveryAgent(ChatAgent):
    @chat_model_connection
    @staticmethod
    def scripted() -> ScriptedChatModel:
        return ScriptedChatModel(
            replies=[
                ChatMessage(
                    role=MessageRole.ASSISTANT,
                    content=ROUND_ONE,
                    tool_calls=[ToolCall(id="call_wait", name="wait_for_release", arguments={})],
                ),
                "all done",
            ]
        )

    @tool
    @staticmethod
    def wait_for_release() -> str:
        """Block until the test releases it, then return the sentinel."""
        COUNTERS["tool_entries"] += 1
        (HANDSHAKE / "tool-entered").write_text(str(os.getpid()))
        while not (HANDSHAKE / "release").exists():
            time.sleep(0.02)
        return SENTINEL

    @chat_model_setup
    @staticmethod
    def setup() -> ChatModelSetup:
        return ChatModelSetup("scripted", tools=["wait_for_release"])

    @action(InputEvent)
    @staticmethod
    def start(event: InputEvent, ctx: RunnerContext) -> None:
        COUNTERS["inputs_seen"] += 1
        ctx.short_term_memory.set("blob", BLOB)
        ctx.send_event(
            ChatRequestEvent(model="setup", messages=[ChatMessage.user("please wait for release")])
        )

    @action(ChatResponseEvent)
    @staticmethod
    def verify(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        blob = ctx.short_term_memory.get("blob")
        transcript: list[Any] = list(event.messages)
        checks = {
            "blob is bytes": type(blob) is bytes,
            "blob content exact": blob == BLOB,
            "transcript carries round one": any(
                m.role == MessageRole.ASSISTANT and m.content == ROUND_ONE for m in transcript
            ),
            "tool returned the sentinel": any(
                m.role == MessageRole.TOOL and SENTINEL in (m.content or "") for m in transcript
            ),
            # The input action ran in the killed process only: here it was replayed, not run.
            "input counter is 0 here": COUNTERS["inputs_seen"] == 0,
            "tool entered once here": COUNTERS["tool_entries"] == 1,
        }
        verdict = {
            "verdict": "pass" if all(checks.values()) else "fail",
            "checks": checks,
            "pid": os.getpid(),
            "blob_type": type(blob).__name__,
        }
        (HANDSHAKE / "verdict.json").write_text(json.dumps(verdict, indent=2))
        if verdict["verdict"] != "pass":
            failed = [k for k, v in checks.items() if not v]
            raise AssertionError(f"recovery checks failed: {failed}")
        ctx.send_event(OutputEvent(output={"verdict": "pass", "reply": event.response.content}))
