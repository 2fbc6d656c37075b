"""The chat agent the MCP tests run (in process, and as a `ratchet run` subprocess that the
kill tests SIGKILL): a scripted model that calls the test server's tools, and the server's
`greeting` prompt as the setup's prompt.

$MCP_URL set: the server is reached over streamable HTTP; unset: it is started over stdio
with $MCP_MARKS and $MCP_GATE passed on (see mcp_server.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ratchet import InputEvent, OutputEvent, RunnerContext, action
from ratchet.agents.chat import (
    ChatAgent,
    ChatMessage,
    ChatModelSetup,
    ChatRequestEvent,
    ChatResponseEvent,
    MCPPrompt,
    MCPServer,
    MessageRole,
    ScriptedChatModel,
    chat_model_connection,
    chat_model_setup,
    mcp_server,
    prompt,
)

SERVER = str(Path(__file__).with_name("mcp_server.py"))


def respond(messages: list[ChatMessage]) -> object:
    """'quick': record, then answer. 'slow': record, block, then answer."""
    turn = sum(1 for m in messages if m.role == MessageRole.ASSISTANT)
    user = [m.content for m in messages if m.role == MessageRole.USER][-1]
    mode, _, who = user.partition(" ")
    if turn == 0:
        return ScriptedChatModel.tool_call("calc_record", "c1", text=f"{who}-1")
    if turn == 1 and mode == "slow":
        return ScriptedChatModel.tool_call("calc_block", "c2", text=f"{who}-2")
    results = [m.content for m in messages if m.role == MessageRole.TOOL]
    return "done: " + "; ".join(results)


def calc_server() -> MCPServer:
    url = os.environ.get("MCP_URL")
    if url:
        return MCPServer(url=url, tools=["record", "block"], prefix="calc_", name="calc")
    env = {k: os.environ[k] for k in ("MCP_MARKS", "MCP_GATE")}
    return MCPServer(
        sys.executable,
        [SERVER, "stdio"],
        env=env,
        tools=["record", "block"],
        prefix="calc_",
        name="calc",
    )


class MCPAgent(ChatAgent):
    @mcp_server
    @staticmethod
    def calc() -> MCPServer:
        return calc_server()

    @prompt
    @staticmethod
    def greeting() -> MCPPrompt:
        return MCPPrompt("calc", "greeting")

    @chat_model_connection
    @staticmethod
    def scripted() -> ScriptedChatModel:
        return ScriptedChatModel(respond=respond)

    @chat_model_setup
    @staticmethod
    def assistant() -> ChatModelSetup:
        return ChatModelSetup("scripted", prompt="greeting", tools=["calc"])

    @action(InputEvent)
    @staticmethod
    def ask(event: InputEvent, ctx: RunnerContext) -> None:
        text = f"{event.input['text']} {ctx.key}"
        ctx.send_event(
            ChatRequestEvent(
                model="assistant",
                messages=[ChatMessage.user(text)],
                prompt_args={"name": ctx.key},
            )
        )

    @action(ChatResponseEvent)
    @staticmethod
    def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        ctx.send_event(
            OutputEvent(
                output={
                    "reply": event.response.content,
                    "first": event.messages[0].content,
                }
            )
        )
