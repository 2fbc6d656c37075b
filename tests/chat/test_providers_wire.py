"""Each provider through its official SDK against a real HTTP server speaking its protocol."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _chat_wire import AnthropicServer, Fault, OllamaServer, OpenAIServer, WireServer, sync
from pydantic import BaseModel

from ratchet import ConfigError
from ratchet.agents.chat import (
    AnthropicChatModel,
    ChatMessage,
    ChatModel,
    MessageRole,
    ModelCallError,
    OllamaChatModel,
    OpenAIChatModel,
    RetryPolicy,
    ScriptedChatModel,
    Tool,
)


def lookup_order(order_id: str) -> dict[str, str]:
    """Look up an order by id.

    Args:
        order_id: The order's id, like "A-1".
    """
    return {"order_id": order_id, "status": "shipped"}


class Verdict(BaseModel):
    category: str
    urgent: bool


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def _openai(url: str, retry: RetryPolicy, timeout: float) -> ChatModel:
    return OpenAIChatModel(
        "gpt-test", api_key="sk-test", base_url=f"{url}/v1", timeout=timeout, retry=retry
    )


def _anthropic(url: str, retry: RetryPolicy, timeout: float) -> ChatModel:
    return AnthropicChatModel(
        "claude-test", api_key="ak-test", base_url=url, timeout=timeout, retry=retry
    )


def _ollama(url: str, retry: RetryPolicy, timeout: float) -> ChatModel:
    return OllamaChatModel("llama-test", host=url, timeout=timeout, retry=retry)


PROVIDERS: dict[str, tuple[type[WireServer], Callable[[str, RetryPolicy, float], ChatModel]]] = {
    "openai": (OpenAIServer, _openai),
    "anthropic": (AnthropicServer, _anthropic),
    "ollama": (OllamaServer, _ollama),
}

SCRIPT = [
    ScriptedChatModel.tool_call("lookup_order", order_id="A-1"),
    "Your order A-1 has shipped.",
]


@pytest.fixture(params=sorted(PROVIDERS))
def provider(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[str, WireServer, Sleeps, Callable[..., ChatModel]]]:
    server_cls, factory = PROVIDERS[request.param]
    sleeps = Sleeps()
    with server_cls(ScriptedChatModel(SCRIPT)) as server:

        def make(timeout: float = 5.0, attempts: int = 4) -> ChatModel:
            retry = RetryPolicy(
                max_attempts=attempts, initial_backoff=0.5, jitter=0.0, sleep=sleeps
            )
            return factory(server.url, retry, timeout)

        yield request.param, server, sleeps, make


ASK = [ChatMessage.system("You are support."), ChatMessage.user("Where is order A-1?")]
TOOLS = [Tool.from_function(lookup_order)]


async def _round_trip(model: ChatModel) -> tuple[ChatMessage, ChatMessage]:
    first = await model.chat(ASK, tools=TOOLS)
    call = first.tool_calls[0]
    result = ChatMessage(
        role=MessageRole.TOOL,
        content='{"order_id": "A-1", "status": "shipped"}',
        tool_call_id=call.id,
        name=call.name,
    )
    second = await model.chat([*ASK, first, result], tools=TOOLS)
    return first, second


@sync
async def test_tool_call_round_trip_and_usage(provider: Any) -> None:
    name, server, _, make = provider
    first, second = await _round_trip(make())
    assert first.role == MessageRole.ASSISTANT
    assert [(c.name, c.arguments) for c in first.tool_calls] == [
        ("lookup_order", {"order_id": "A-1"})
    ]
    assert second.content == "Your order A-1 has shipped."
    assert second.tool_calls == []
    assert first.usage is not None
    assert first.usage.input_tokens > 0
    assert first.usage.output_tokens > 0
    assert len(server.requests) == 2
    # the tool's schema went over the wire, from the function's hints and docstring
    spec = server.requests[0]["tools"][0]
    spec = spec.get("function", spec)
    assert spec["name"] == "lookup_order"
    assert spec["description"] == "Look up an order by id."
    params = spec.get("parameters") or spec["input_schema"]
    assert params["required"] == ["order_id"]
    assert params["properties"]["order_id"] == {
        "type": "string",
        "description": 'The order\'s id, like "A-1".',
    }
    if name == "anthropic":
        sent = server.headers[0]
        assert "ak-test" in (sent.get("x-api-key", "") + sent.get("authorization", ""))
        assert server.requests[0]["system"] == "You are support."
        assert server.requests[1]["messages"][-1]["content"][0]["type"] == "tool_result"
    elif name == "openai":
        assert server.headers[0]["authorization"] == "Bearer sk-test"
        assert server.requests[1]["messages"][-1]["role"] == "tool"
        assert server.requests[1]["messages"][-1]["tool_call_id"] == first.tool_calls[0].id


@sync
async def test_429_with_retry_after_is_retried_after_the_server_hint(provider: Any) -> None:
    _, server, sleeps, make = provider
    server.fail_next(Fault(429, {"retry-after": "7"}))
    reply = await make().chat(ASK, tools=TOOLS)
    assert reply.tool_calls
    assert len(server.requests) == 2
    assert sleeps.delays == [7.0]


@sync
async def test_500_is_retried_with_exponential_backoff(provider: Any) -> None:
    _, server, sleeps, make = provider
    server.fail_next(Fault(500), Fault(503))
    reply = await make().chat(ASK, tools=TOOLS)
    assert reply.tool_calls
    assert len(server.requests) == 3
    assert sleeps.delays == [0.5, 1.0]


@sync
async def test_persistent_5xx_gives_up_after_max_attempts(provider: Any) -> None:
    _, server, _, make = provider
    server.fail_next(*(Fault(500) for _ in range(3)))
    with pytest.raises(ModelCallError, match="gave up after 3 attempts") as info:
        await make(attempts=3).chat(ASK)
    assert info.value.transient
    assert info.value.status == 500
    assert len(server.requests) == 3


@pytest.mark.parametrize(
    ("fault", "seconds"),
    # A reply that does not come; and one sent a byte every 50 ms: the SDKs' timeouts bound
    # each read, so it held the call for as long as it kept coming (about 9 s in the review's
    # case). `timeout` is the whole request's now.
    [(Fault(delay=1.5), 0.4), (Fault(trickle=0.05), 1.0)],
    ids=["silent", "trickling"],
)
@sync
async def test_a_reply_past_the_timeout_is_transient_and_retried(
    provider: Any, fault: Fault, seconds: float
) -> None:
    _, server, sleeps, make = provider
    server.fail_next(fault)
    reply = await make(timeout=seconds).chat(ASK, tools=TOOLS)
    assert reply.tool_calls
    assert len(server.requests) == 2  # the late reply timed out; the retry's came whole
    assert len(sleeps.delays) == 1


@sync
async def test_401_fails_fast_with_the_providers_message(provider: Any) -> None:
    _, server, sleeps, make = provider
    server.fail_next(Fault(401, body=server.error_body(401, "invalid key sk-...x")))
    with pytest.raises(ModelCallError, match="401.*invalid key") as info:
        await make().chat(ASK)
    assert not info.value.transient
    assert info.value.status == 401
    assert len(server.requests) == 1
    assert sleeps.delays == []


@sync
async def test_400_fails_fast(provider: Any) -> None:
    _, server, _, make = provider
    server.fail_next(Fault(400, body=server.error_body(400, "messages: bad role")))
    with pytest.raises(ModelCallError, match="bad role"):
        await make().chat(ASK)
    assert len(server.requests) == 1


@sync
async def test_malformed_body_is_a_clear_error(provider: Any) -> None:
    _, server, _, make = provider
    server.fail_next(Fault(200, {"content-type": "application/json"}, body=b'{"choices": [oops'))
    with pytest.raises(ModelCallError, match="malformed|JSON|json|Expecting"):
        await make().chat(ASK)


@sync
async def test_structured_output_request_shape(provider: Any) -> None:
    name, server, _, make = provider
    server.script.replies = ['{"category": "shipping", "urgent": false}']
    reply = await make().chat(ASK, output_schema=Verdict)
    assert Verdict.model_validate_json(reply.content) == Verdict(category="shipping", urgent=False)
    body = server.requests[0]
    if name == "openai":
        assert body["response_format"]["json_schema"]["schema"]["properties"]["urgent"]
    elif name == "ollama":
        assert body["format"]["properties"]["category"]
    else:
        assert "JSON schema" in body["system"]
        assert "urgent" in body["system"]


@pytest.mark.parametrize(
    ("cls", "env"), [(OpenAIChatModel, "OPENAI_API_KEY"), (AnthropicChatModel, "ANTHROPIC_API_KEY")]
)
def test_missing_api_key_is_a_clear_error_at_construction(
    cls: type[ChatModel], env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(env, raising=False)
    with pytest.raises(ConfigError, match=f"set the {env} environment variable"):
        cls()  # type: ignore[call-arg]


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "ak-env")
    assert OpenAIChatModel().client.api_key == "sk-env"  # type: ignore[attr-defined]
    assert AnthropicChatModel().client.api_key == "ak-env"  # type: ignore[attr-defined]


def _openai_reply(choice: dict[str, Any]) -> bytes:
    return json.dumps(
        {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    ).encode()


@pytest.mark.parametrize(
    "choice",
    [
        {"index": 0, "finish_reason": "stop"},  # no message
        {"index": 0, "finish_reason": "tool_calls",
         "message": {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                          "function": None}]}},
        {"index": 0, "finish_reason": "tool_calls",
         "message": {"role": "assistant", "tool_calls": [{"type": "function",
                     "function": {"name": "lookup_order", "arguments": "{}"}}]}},
    ],
    ids=["no-message", "function-null", "tool-call-without-id"],
)  # fmt: skip
@sync
async def test_an_openai_reply_of_the_wrong_shape_is_a_malformed_response(
    choice: dict[str, Any],
) -> None:
    # They surfaced as a raw AttributeError or pydantic ValidationError (its URL and all).
    with OpenAIServer(ScriptedChatModel(SCRIPT)) as server:
        server.fail_next(Fault(200, {"content-type": "application/json"}, _openai_reply(choice)))
        model = OpenAIChatModel("gpt-test", api_key="sk", base_url=f"{server.url}/v1")
        with pytest.raises(ModelCallError, match=r"^openai: malformed response \(") as info:
            await model.chat(ASK, tools=TOOLS)
    assert not info.value.transient
    assert "pydantic.dev" not in str(info.value)


@pytest.mark.parametrize("timeout", [-1, 0, float("nan"), float("inf"), "5", True])
@pytest.mark.parametrize("cls", [OpenAIChatModel, AnthropicChatModel, OllamaChatModel])
def test_a_timeout_that_is_not_seconds_above_zero_is_refused_at_construction(
    cls: type[ChatModel], timeout: Any
) -> None:
    # A negative one made every request time out at once: the stream paused forever.
    with pytest.raises(ConfigError, match=r"timeout= takes seconds > 0 \(or None"):
        cls(api_key="k", timeout=timeout) if cls is not OllamaChatModel else cls(timeout=timeout)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_attempts": 2.5}, r"RetryPolicy\(max_attempts=\) .* got 2.5"),
        ({"max_attempts": "3"}, r"RetryPolicy\(max_attempts=\) .* got '3'"),
        ({"initial_backoff": -1}, r"RetryPolicy\(initial_backoff=\) takes a number >= 0"),
        ({"jitter": -5}, r"RetryPolicy\(jitter=\) takes a number >= 0"),
        ({"max_backoff": float("inf")}, r"RetryPolicy\(max_backoff=\) takes a number >= 0"),
        ({"multiplier": 0.5}, r"RetryPolicy\(multiplier=\) is a factor >= 1"),
    ],
)
def test_a_retry_policy_out_of_range_is_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RetryPolicy(**kwargs)


def test_retry_must_be_a_retry_policy() -> None:
    # A dict was accepted and failed at the first retry, mid-job, as a dead letter.
    with pytest.raises(ConfigError, match=r"retry= takes a ratchet.agents.chat.RetryPolicy"):
        OpenAIChatModel(api_key="k", retry={"max_attempts": 2})  # type: ignore[arg-type]
