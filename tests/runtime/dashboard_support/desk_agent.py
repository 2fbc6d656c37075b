"""The agent of the dashboard tests: memory of several types, a run that fails (a dead letter),
and a tool call that waits for a person's approval."""

from dataclasses import dataclass

from ratchet import InputEvent, OutputEvent, action, register_type
from ratchet.agents.chat import (
    ChatAgent,
    ChatMessage,
    ChatModelSetup,
    ChatRequestEvent,
    ChatResponseEvent,
    MessageRole,
    ScriptedChatModel,
    chat_model_setup,
    tool,
)


@dataclass
class Ticket:
    title: str
    priority: int


register_type(Ticket, name="demo.Ticket")


def respond(messages):
    if any(m.role == MessageRole.TOOL for m in messages):
        return "refund handled"
    return [ScriptedChatModel.tool_call("refund", "c1", order_id="A-1", amount_cents=500)]


class Desk(ChatAgent):
    @chat_model_setup
    @staticmethod
    def desk():
        return ChatModelSetup(ScriptedChatModel(respond=respond), tools=["refund"])

    @tool(requires_approval=True)
    @staticmethod
    def refund(order_id: str, amount_cents: int) -> str:
        """Refund an order."""
        return f"refunded {amount_cents} on {order_id}"

    @action(InputEvent)
    @staticmethod
    def on_input(event, ctx):
        mem = ctx.short_term_memory
        mem.set("count", (mem.get("count") or 0) + 1)
        mem.set("last", event.input.get("text", ""))
        mem.set("ticket", Ticket(event.input.get("text", ""), 2))
        if event.input.get("fail"):
            raise ValueError("cannot handle this ticket")
        if event.input.get("ask"):
            ctx.send_event(
                ChatRequestEvent(model="desk", messages=[ChatMessage.user("refund please")])
            )
        else:
            ctx.send_event(OutputEvent(output={"ok": event.input.get("text")}))

    @action(ChatResponseEvent)
    @staticmethod
    def answer(event, ctx):
        ctx.send_event(OutputEvent(output={"reply": event.messages[-1].content}))
