"""A support agent whose tools and instructions come from an MCP server (server.py), and
which remembers each customer's earlier conversations in long-term memory.

The model is scripted by default (no network, no key): it looks the order up, refunds it
when the message asks for a refund, then answers with what the tools said. Before asking the
model, the agent searches the customer's long-term memory for earlier conversations and
gives the best ones to the model; after the answer it remembers this one (the scripted
embedding model is a hash of the text: deterministic, not semantic; use
OpenAIEmbeddingModel or OllamaEmbeddingModel for real similarity).
MCP_TOOLS_PROVIDER=openai uses OpenAI (OPENAI_API_KEY) instead; MCP_URL=http://.../mcp
reaches the server over streamable HTTP instead of starting it over stdio.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from ratchet import InputEvent, LongTermMemoryConfig, OutputEvent, RunnerContext, action
from ratchet.agents.chat import (
    ChatAgent,
    ChatMessage,
    ChatModel,
    ChatModelSetup,
    ChatRequestEvent,
    ChatResponseEvent,
    MCPPrompt,
    MCPServer,
    MessageRole,
    OpenAIChatModel,
    ScriptedChatModel,
    ScriptedEmbeddingModel,
    chat_model_connection,
    chat_model_setup,
    mcp_server,
    prompt,
)

SERVER = str(Path(__file__).resolve().with_name("server.py"))


def scripted_reply(messages: list[ChatMessage]) -> object:
    """What a model would do here: look up, maybe refund, then answer from the results."""
    asked = [m.content for m in messages if m.role == MessageRole.USER][-1]
    order = (re.findall(r"A-\d+", asked) or ["A-0000"])[0]
    done = [m.content for m in messages if m.role == MessageRole.TOOL]
    if not done:
        return ScriptedChatModel.tool_call("orders_lookup_order", "look", order_id=order)
    if "refund" in asked.lower() and len(done) == 1 and not done[0].startswith("ERROR"):
        return ScriptedChatModel.tool_call(
            "orders_refund", "refund", order_id=order, amount_cents=500
        )
    return " ".join(_sentence(text) for text in done)


def _sentence(tool_result: str) -> str:
    try:
        order = json.loads(tool_result)
    except ValueError:
        return tool_result if tool_result.startswith("ERROR") else f"I {tool_result}."
    carrier = f" with {order['carrier']}" if order.get("carrier") else ""
    return f"Order {order['order_id']} is {order['status']}{carrier}."


class SupportAgent(ChatAgent):
    @mcp_server
    @staticmethod
    def orders() -> MCPServer:
        url = os.environ.get("MCP_URL")
        if url:
            return MCPServer(url=url, prefix="orders_", name="orders")
        ledger = os.environ.get("ORDERS_LEDGER", "orders-ledger.jsonl")
        return MCPServer(
            sys.executable,
            [SERVER],
            env={"ORDERS_LEDGER": ledger},
            prefix="orders_",  # the model sees orders_lookup_order and orders_refund
            name="orders",
        )

    @prompt
    @staticmethod
    def instructions() -> MCPPrompt:
        return MCPPrompt("orders", "support_instructions")

    @chat_model_connection
    @staticmethod
    def model() -> ChatModel:
        if os.environ.get("MCP_TOOLS_PROVIDER") == "openai":
            return OpenAIChatModel(os.environ.get("MCP_TOOLS_MODEL", "gpt-4o-mini"))
        return ScriptedChatModel(respond=scripted_reply)

    @chat_model_setup
    @staticmethod
    def support() -> ChatModelSetup:
        return ChatModelSetup("model", prompt="instructions", tools=["orders"])

    # Each customer's earlier conversations, found again by meaning.
    long_term_memory = LongTermMemoryConfig(embedding=ScriptedEmbeddingModel(dimensions=64))

    @action(InputEvent)
    @staticmethod
    async def ask(event: InputEvent, ctx: RunnerContext) -> None:
        text = event.input["text"]
        earlier = await ctx.long_term_memory.search(text, k=2)
        remembered = [hit["text"] for hit in earlier]
        ctx.sensory_memory.set("question", text)
        ctx.sensory_memory.set("remembered", remembered)
        context = [ChatMessage.system(f"Earlier with this customer: {r}") for r in remembered]
        ctx.send_event(
            ChatRequestEvent(
                model="support",
                messages=[*context, ChatMessage.user(text)],
                prompt_args={"shop": "Acme"},
            )
        )

    @action(ChatResponseEvent)
    @staticmethod
    async def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        reply = event.response.content
        question = ctx.sensory_memory.get("question")
        await ctx.long_term_memory.add(f"Q: {question} A: {reply}", {"kind": "conversation"})
        remembered = ctx.sensory_memory.get("remembered")
        ctx.send_event(OutputEvent(output={"reply": reply, "remembered": remembered}))
