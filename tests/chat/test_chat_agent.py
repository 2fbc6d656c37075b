"""The built-in chat/tool actions, run by the embedded engine with a ScriptedChatModel."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from ratchet import ConfigError, EngineConfig, InputEvent, OutputEvent, RunnerContext, action, run
from ratchet.agents._events import event_from_wire, event_to_wire
from ratchet.agents.chat import (
    ChatAgent,
    ChatMessage,
    ChatModelSetup,
    ChatRequestEvent,
    ChatResponseEvent,
    MessageRole,
    ModelCallError,
    Prompt,
    ReActAgent,
    RetryPolicy,
    ScriptedChatModel,
    TokenBudget,
    chat_model_setup,
    chat_usage,
    tool,
)

call = ScriptedChatModel.tool_call


class Triage(BaseModel):
    category: str
    urgent: bool


def _run(agent: Any, tmp: Path, inputs: list[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    run(
        agent,
        inputs=inputs,
        output=out.append,
        state_dir=tmp / "state",
        config=EngineConfig(checkpoint_interval=0.02),
        **kw,
    )
    return out


async def _no_sleep(delay: float) -> None:
    pass


def _model(*replies: Any, **kw: Any) -> ScriptedChatModel:
    return ScriptedChatModel(list(replies), retry=RetryPolicy(sleep=_no_sleep), **kw)


def boom(order_id: str) -> str:
    """Always fails."""
    raise RuntimeError(f"database down while reading {order_id}")


def lookup(order_id: str) -> dict[str, str]:
    """Look up an order."""
    return {"order_id": order_id, "status": "shipped"}


def test_tool_that_raises_becomes_an_error_message_the_model_reads(tmp_path: Path) -> None:
    model = _model(call("boom", order_id="A"), "Sorry, I cannot look that up.")
    out = _run(ReActAgent(model, tools=[boom]), tmp_path, [{"key": "k", "q": "?"}])
    assert [o["output"] for o in out] == ["Sorry, I cannot look that up."]
    tool_msg = model.calls[1][-1]
    assert tool_msg.role == MessageRole.TOOL
    assert tool_msg.is_error
    assert (
        tool_msg.content == "ERROR: tool 'boom' raised RuntimeError: database down while reading A"
    )


class Receipt:  # a value a tool returns that JSON cannot hold
    pass


RAN: list[str] = []


def charge(order_id: str) -> dict[str, Any]:
    """Charge an order (a side effect), returning a value JSON cannot hold."""
    RAN.append(order_id)
    return {"receipt": Receipt()}


def test_a_tool_value_json_cannot_hold_is_an_error_message_not_a_failed_run(
    tmp_path: Path,
) -> None:
    # The tool ran (its side effect happened), then rendering its value failed the run: a
    # dead letter whose redrive ran the tool again under a new idempotency key.
    RAN.clear()
    model = _model(call("charge", order_id="A"), "Charged, but I could not read the receipt.")
    out = _run(ReActAgent(model, tools=[charge]), tmp_path, [{"key": "k", "q": "?"}])
    assert [o["output"] for o in out] == ["Charged, but I could not read the receipt."]
    assert RAN == ["A"]
    tool_msg = model.calls[1][-1]
    assert tool_msg.is_error
    assert tool_msg.content.startswith(
        "ERROR: tool 'charge' returned a value that cannot be sent as JSON (dict): "
    ), tool_msg.content


def test_invalid_arguments_and_unknown_tools_are_reported_to_the_model(tmp_path: Path) -> None:
    model = _model(
        [call("lookup", "c1", order="A"), call("nope", "c2")],
        "ok",
    )
    out = _run(ReActAgent(model, tools=[lookup]), tmp_path, [{"key": "k", "q": "?"}])
    assert out[0]["output"] == "ok"
    bad_args, unknown = model.calls[1][-2:]
    assert bad_args.is_error
    assert "invalid arguments for tool 'lookup'" in bad_args.content
    assert "order_id: Field required" in bad_args.content
    assert unknown.content == "ERROR: there is no tool named 'nope'; available: lookup"


def test_several_tool_calls_run_concurrently(tmp_path: Path) -> None:
    barrier: dict[str, asyncio.Barrier] = {}

    async def meet(name: str) -> str:
        """Waits until both calls are running at once."""
        b = barrier.setdefault("b", asyncio.Barrier(2))
        await asyncio.wait_for(b.wait(), 5)
        return f"met {name}"

    model = _model([call("meet", "c1", name="a"), call("meet", "c2", name="b")], "both met")
    out = _run(ReActAgent(model, tools=[meet]), tmp_path, [{"key": "k", "q": "?"}])
    assert out[0]["output"] == "both met"
    assert [m.content for m in model.calls[1][-2:]] == ["met a", "met b"]  # in call order


def test_turn_limit_stops_a_runaway_loop_with_a_clear_error(tmp_path: Path) -> None:
    model = ScriptedChatModel(respond=lambda msgs: call("lookup", order_id="A"))
    out = _run(ReActAgent(model, tools=[lookup], max_turns=3), tmp_path, [{"key": "k", "q": "?"}])
    [rec] = out
    assert rec["output"] is None
    assert rec["error"]["type"].endswith("TurnLimitError")
    assert "reached its turn limit of 3 model calls" in rec["error"]["message"]
    assert len(model.calls) == 3


class Budgeted(ChatAgent):
    @chat_model_setup
    @staticmethod
    def m() -> ChatModelSetup:
        return ChatModelSetup(ScriptedChatModel(respond=lambda msgs: "a fairly short answer"))

    @action(InputEvent)
    @staticmethod
    def ask(event: InputEvent, ctx: RunnerContext) -> None:
        ctx.send_event(ChatRequestEvent(model="m", messages=[ChatMessage.user(event.input["q"])]))

    @action(ChatResponseEvent)
    @staticmethod
    def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        used = chat_usage(ctx)
        ctx.send_event(
            OutputEvent(output={"run": used["run"].total_tokens, "key": used["key"].total_tokens})
        )


def test_token_usage_per_run_and_per_key(tmp_path: Path) -> None:
    out = _run(Budgeted(), tmp_path, [{"key": "a", "q": "one two"}, {"key": "a", "q": "one two"}])
    # scripted usage: input = words + 1 per message (3), output = 4 words + 1 (5)
    assert [o["output"] for o in out] == [{"run": 8, "key": 8}, {"run": 8, "key": 16}]


def test_token_budget_per_key_stops_further_model_calls(tmp_path: Path) -> None:
    agent = Budgeted(token_budget=TokenBudget(per_key=8))
    inputs = [{"key": "a", "q": "x y"}, {"key": "a", "q": "x y"}, {"key": "b", "q": "x y"}]
    out = sorted(_run(agent, tmp_path, inputs), key=lambda o: (o["key"], o["seq"]))
    assert [o["output"] for o in out] == [{"run": 8, "key": 8}, None, {"run": 8, "key": 8}]
    err = out[1]["error"]
    assert err["type"].endswith("TokenBudgetExceededError")
    assert err["message"].startswith("token budget per key exhausted: 8 of 8 tokens used (key 'a')")


def test_token_budget_per_run_from_agent_config(tmp_path: Path) -> None:
    model = ScriptedChatModel(respond=lambda msgs: call("lookup", order_id="A"))
    out = _run(
        ReActAgent(model, tools=[lookup]),
        tmp_path,
        [{"key": "k", "q": "?"}],
        agent_config={"token_budget": {"per_run": 20}},
    )
    [rec] = out
    assert rec["error"]["type"].endswith("TokenBudgetExceededError")
    assert "token budget per run exhausted" in rec["error"]["message"]
    assert len(model.calls) < 10


def test_structured_output_is_validated_into_the_schema(tmp_path: Path) -> None:
    model = _model('```json\n{"category": "shipping", "urgent": true}\n```')
    out = _run(ReActAgent(model, output_schema=Triage), tmp_path, [{"key": "k", "q": "late!"}])
    assert out[0]["output"] == {"category": "shipping", "urgent": True}


def test_structured_output_error_is_sent_back_once_then_fails_clearly(tmp_path: Path) -> None:
    model = _model('{"category": "shipping"}', '{"category": "shipping", "urgent": "maybe"}')
    out = _run(ReActAgent(model, output_schema=Triage), tmp_path, [{"key": "k", "q": "late!"}])
    [rec] = out
    assert rec["error"]["type"].endswith("StructuredOutputError")
    assert "does not validate against output schema" in rec["error"]["message"]
    assert "urgent: Input should be a valid boolean" in rec["error"]["message"]
    fix = model.calls[1][-1]
    assert fix.role == MessageRole.USER
    assert "urgent: Field required" in fix.content


def test_structured_output_is_rebuilt_by_registered_name_after_a_round_trip() -> None:
    ev = ChatResponseEvent(
        request_id="r",
        model="m",
        response=ChatMessage.assistant("{}"),
        output_schema=ChatRequestEvent(model="m", output_schema=Triage).output_schema,
        structured=Triage(category="c", urgent=False),
    )
    back = event_from_wire(*event_to_wire(ev))
    assert isinstance(back, ChatResponseEvent)
    assert back.structured == Triage(category="c", urgent=False)


def test_transient_errors_are_retried_and_permanent_ones_fail_fast(tmp_path: Path) -> None:
    flaky = _model("fine", fail_first=[ModelCallError("HTTP 429", status=429, transient=True)])
    assert _run(ReActAgent(flaky), tmp_path / "a", [{"key": "k", "q": "?"}])[0]["output"] == "fine"
    assert len(flaky.calls) == 2
    denied = _model("never", fail_first=[ModelCallError("HTTP 401: invalid key", status=401)])
    [rec] = _run(ReActAgent(denied), tmp_path / "b", [{"key": "k", "q": "?"}])
    assert "HTTP 401: invalid key" in rec["error"]["message"]
    assert len(denied.calls) == 1


def test_missing_prompt_argument_is_a_clear_error_event(tmp_path: Path) -> None:
    agent = ReActAgent(_model("x"), prompt=Prompt.from_text("Customer {customer} says {text}"))
    [rec] = _run(agent, tmp_path, [{"key": "k", "text": "hello"}])
    assert "needs argument 'customer'" in rec["error"]["message"]


def test_react_prompt_modes(tmp_path: Path) -> None:
    m1 = _model("a")
    _run(ReActAgent(m1, prompt="Be brief."), tmp_path / "1", [{"key": "k", "q": "hi"}])
    assert [(m.role, m.content) for m in m1.calls[0]] == [
        (MessageRole.USER, "Be brief."),
        (MessageRole.USER, '{"key": "k", "q": "hi"}'),
    ]
    m2 = _model("b")
    _run(ReActAgent(m2, prompt="Q from {key}: {q}"), tmp_path / "2", [{"key": "k", "q": "hi"}])
    assert m2.calls[0][0].content == "Q from k: hi"


def test_unknown_resource_names_fail_at_construction() -> None:
    class Bad(ChatAgent):
        @chat_model_setup
        @staticmethod
        def m() -> ChatModelSetup:
            return ChatModelSetup("no_such_connection", tools=["nope"])

        @action(InputEvent)
        @staticmethod
        def ask(event: InputEvent, ctx: RunnerContext) -> None:
            pass

    with pytest.raises(
        ConfigError, match="no chat_model_connection resource named 'no_such_connection'"
    ):
        Bad()


def test_a_resource_factory_that_fails_inside_is_not_blamed_on_its_signature() -> None:
    # Any TypeError inside the factory read "must be a @staticmethod taking no arguments".
    class Broken(ChatAgent):
        @chat_model_setup
        @staticmethod
        def m() -> ChatModelSetup:
            return ChatModelSetup(_model("x"), options={"n": 1 + "1"})  # type: ignore[operator]

        @action(InputEvent)
        @staticmethod
        def ask(event: InputEvent, ctx: RunnerContext) -> None:
            pass

    with pytest.raises(ConfigError, match=r"resource 'm' of .*Broken failed to build: TypeError"):
        Broken()

    class NeedsArgs(ChatAgent):
        @chat_model_setup
        @staticmethod
        def m(model: str) -> ChatModelSetup:
            return ChatModelSetup(_model(model))

        @action(InputEvent)
        @staticmethod
        def ask(event: InputEvent, ctx: RunnerContext) -> None:
            pass

    with pytest.raises(ConfigError, match="must be a @staticmethod taking no arguments"):
        NeedsArgs()


def test_tools_declared_on_the_agent_by_name(tmp_path: Path) -> None:
    class Shop(ChatAgent):
        @tool
        @staticmethod
        def stock(sku: str) -> int:
            """Units in stock."""
            return 3

        @chat_model_setup
        @staticmethod
        def m() -> ChatModelSetup:
            return ChatModelSetup(_model(call("stock", sku="X"), "3 left"), tools=["stock"])

        @action(InputEvent)
        @staticmethod
        def ask(event: InputEvent, ctx: RunnerContext) -> None:
            ctx.send_event(ChatRequestEvent(model="m", messages=[ChatMessage.user("stock?")]))

        @action(ChatResponseEvent)
        @staticmethod
        def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
            ctx.send_event(OutputEvent(output=[m.content for m in event.messages]))

    out = _run(Shop(), tmp_path, [{"key": "k"}])
    assert out[0]["output"] == ["stock?", "", "3", "3 left"]


def test_token_metrics_count_only_model_calls_this_process_paid_for(tmp_path: Path) -> None:
    inputs = [{"key": "a", "q": "one two"}, {"key": "b", "q": "one two"}]
    result = run(Budgeted(), inputs=inputs, output=tmp_path / "o.jsonl", state_dir=tmp_path / "s1")
    assert result.metrics["chat.model_calls"] == 2
    assert result.metrics["chat.tokens.input"] == 6 and result.metrics["chat.tokens.output"] == 10

    class CrashesOnAnswer(Budgeted):
        @action(ChatResponseEvent)
        @staticmethod
        def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
            raise SystemExit("the process dies after the model answered")

    with pytest.raises(BaseException):  # noqa: B017, PT011 - the simulated crash
        run(
            CrashesOnAnswer(),
            inputs=inputs[:1],
            output=tmp_path / "o2.jsonl",
            state_dir=tmp_path / "s2",
        )
    resumed = run(
        Budgeted(), inputs=inputs[:1], output=tmp_path / "o2.jsonl", state_dir=tmp_path / "s2"
    )
    # The reply came from the journal: nothing was paid for in the resumed process.
    assert resumed.runs_completed == 1
    assert "chat.model_calls" not in resumed.metrics
    assert resumed.metrics.get("durable_calls.replayed", 0) + resumed.tasks_replayed >= 1
