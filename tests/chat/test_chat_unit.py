"""Messages, prompts, tools and schemas, without running an agent."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel

from ratchet import ConfigError
from ratchet.agents.chat import (
    ChatMessage,
    MessageRole,
    Prompt,
    PromptArgumentError,
    ScriptedChatModel,
    TokenUsage,
    Tool,
    ToolCall,
    ToolContext,
)
from ratchet.agents.chat._tools import render_result
from ratchet.store import codec


def test_messages_and_tool_calls_round_trip_the_codec_with_exact_types() -> None:
    msg = ChatMessage.assistant(
        "checking", [ToolCall(id="c1", name="lookup", arguments={"ids": ["a", "b"], "n": 2})]
    )
    msg = msg.model_copy(update={"usage": TokenUsage(input_tokens=3, output_tokens=4)})
    back = codec.decode(codec.encode({"m": [msg], "role": MessageRole.TOOL}))
    assert back["m"][0] == msg
    assert type(back["m"][0]) is ChatMessage
    assert type(back["m"][0].tool_calls[0]) is ToolCall
    assert back["role"] is MessageRole.TOOL
    assert back["m"][0].usage.total_tokens == 7


def test_prompt_formats_text_and_messages() -> None:
    p = Prompt.from_text("Ticket from {customer}: {text}")
    assert p.arguments == {"customer", "text"}
    [m] = p.format_messages(customer="ann", text="late")
    assert m.role == MessageRole.USER
    assert m.content == "Ticket from ann: late"
    p2 = Prompt.from_messages(
        [ChatMessage.system("You help {shop}. Use {{braces}}."), ChatMessage.user("{q}")]
    )
    assert [m.content for m in p2.format_messages({"shop": "Acme", "q": "hi"})] == [
        "You help Acme. Use {braces}.",
        "hi",
    ]


def test_prompt_missing_argument_names_it() -> None:
    p = Prompt.from_text("Ticket from {customer}: {text}", name="triage")
    with pytest.raises(
        PromptArgumentError, match=r"prompt 'triage' needs argument 'text'.*given: customer"
    ):
        p.format_messages(customer="ann")
    with pytest.raises(PromptArgumentError, match="positional"):
        Prompt.from_text("hello {}")


def refund(
    order_id: str, amount_cents: int, reason: Literal["late", "damaged"] = "late"
) -> dict[str, object]:
    """Refund part of an order.

    Args:
        order_id: The order to refund.
        amount_cents: How much, in cents.
        reason: Why.
    """
    return {"order_id": order_id, "refunded": amount_cents}


def test_tool_schema_from_hints_and_docstring() -> None:
    t = Tool.from_function(refund)
    assert t.name == "refund"
    assert t.description == "Refund part of an order."
    assert t.parameters == {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "order_id": {"type": "string", "description": "The order to refund."},
            "amount_cents": {"type": "integer", "description": "How much, in cents."},
            "reason": {
                "type": "string",
                "enum": ["late", "damaged"],
                "default": "late",
                "description": "Why.",
            },
        },
        "required": ["order_id", "amount_cents"],
    }


def test_tool_context_parameter_is_injected_not_described() -> None:
    seen: list[ToolContext] = []

    async def charge(amount: int, ctx: ToolContext) -> str:
        """Charge a card."""
        seen.append(ctx)
        return "ok"

    t = Tool.from_function(charge)
    assert set(t.parameters["properties"]) == {"amount"}
    import asyncio

    out = asyncio.run(t.invoke({"amount": 5}, ToolContext("charge", "c1", "rt-1", "k")))
    assert out == "ok"
    assert seen[0].idempotency_key == "rt-1"


def test_tool_arguments_are_validated() -> None:
    import pydantic

    t = Tool.from_function(refund)
    assert t.validate_arguments({"order_id": "A", "amount_cents": "5"}) == {
        "order_id": "A",
        "amount_cents": 5,
        "reason": "late",
    }
    with pytest.raises(pydantic.ValidationError):
        t.validate_arguments({"order_id": "A"})
    with pytest.raises(pydantic.ValidationError):
        t.validate_arguments({"order_id": "A", "amount_cents": 1, "extra": 1})


def test_tool_definition_errors_are_clear() -> None:
    def no_doc(x: int) -> int:
        return x

    def no_hint(x):  # type: ignore[no-untyped-def]
        """Does x."""
        return x

    with pytest.raises(ConfigError, match="no description"):
        Tool.from_function(no_doc)
    with pytest.raises(ConfigError, match="parameter 'x' has no type hint"):
        Tool.from_function(no_hint)
    with pytest.raises(ConfigError, match="tool name"):
        Tool.from_function(refund, name="has space")


def test_render_result() -> None:
    class Out(BaseModel):
        a: int

    assert render_result("plain") == "plain"
    assert render_result({"b": 1, "a": [Out(a=2)]}) == '{"a": [{"a": 2}], "b": 1}'


def test_scripted_model_replies_by_conversation_position() -> None:
    import asyncio

    m = ScriptedChatModel([ScriptedChatModel.tool_call("lookup", order_id="A"), "done"])
    first = asyncio.run(m.chat([ChatMessage.user("q")]))
    assert first.tool_calls == [
        ToolCall(id="call_lookup", name="lookup", arguments={"order_id": "A"})
    ]
    assert first.usage is not None
    # the same conversation gets the same reply again (a replay is deterministic)
    assert asyncio.run(m.chat([ChatMessage.user("q")])).tool_calls == first.tool_calls
    tool_msg = ChatMessage(role=MessageRole.TOOL, content="{}", tool_call_id="call_lookup")
    assert asyncio.run(m.chat([ChatMessage.user("q"), first, tool_msg])).content == "done"


def test_scripted_model_mistakes_are_refused_when_it_is_made() -> None:
    from ratchet import InvalidArgumentError, InvalidTypeError

    # A str is a sequence: replies="hello" answered "h", and a test asserted the wrong thing.
    with pytest.raises(InvalidTypeError, match=r"write replies=\['hello'\], not replies='hello'"):
        ScriptedChatModel(replies="hello")  # type: ignore[arg-type]
    # A reply of no known shape failed at its turn, mid-job (a dead letter, exit 4).
    with pytest.raises(InvalidTypeError, match=r"replies\[1\]: a scripted reply must be"):
        ScriptedChatModel(replies=["ok", 42])  # type: ignore[list-item]
    # Both: respond= won silently.
    with pytest.raises(InvalidArgumentError, match="replies=.* or respond=.*, not both"):
        ScriptedChatModel(replies=["ok"], respond=lambda messages: "computed")
