"""`RateLimit` on a chat model connection, on the fake clock: requests and tokens per minute
are token buckets, concurrency a semaphore, and a 429's Retry-After holds every call through
the connection. Also: a connection's `Resource` (the circuit its calls wait on when the
provider is down) and the configuration errors. No real time passes in these tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import pytest
from _chat_wire import sync
from pydantic import BaseModel

from ratchet._errors import ConfigError
from ratchet.agents.chat import (
    ChatMessage,
    ChatModel,
    MessageRole,
    ModelCallError,
    OpenAIChatModel,
    RateLimit,
    RetryPolicy,
    ScriptedChatModel,
    TokenUsage,
    Tool,
    estimate_tokens,
)
from ratchet.testing import FakeClock


class Recorder(ChatModel):
    """A provider answering at once (or when `gate` opens), recording when each call started."""

    provider = "fake"

    def __init__(self, clock: FakeClock, *, used: int = 0, **kwargs: Any) -> None:
        super().__init__(model="m", **kwargs)
        self.clock = clock
        self.used = used
        self.starts: list[float] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.gate: asyncio.Event | None = None
        self.fail: list[ModelCallError] = []

    async def _chat_once(
        self,
        messages: Sequence[ChatMessage],
        *,
        model: str | None,
        tools: Sequence[Tool],
        output_schema: type[BaseModel] | None,
        options: Mapping[str, Any],
    ) -> ChatMessage:
        self.starts.append(self.clock.monotonic())
        if self.fail:
            raise self.fail.pop(0)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.in_flight -= 1
        return ChatMessage(
            role=MessageRole.ASSISTANT, content="ok", usage=TokenUsage(input_tokens=self.used)
        )


async def drive(clock: FakeClock, jobs: Sequence[Awaitable[Any]], steps: int = 10_000) -> None:
    """Run `jobs` to the end, moving the fake clock to the next sleeper whenever all wait."""
    tasks = [asyncio.ensure_future(j) for j in jobs]
    for _ in range(steps):
        for _ in range(20):
            await asyncio.sleep(0)
        if all(t.done() for t in tasks):
            await asyncio.gather(*tasks)
            return
        deadline = clock.next_deadline()
        if deadline is not None:
            clock.jump_to(deadline)
    raise AssertionError("the calls did not finish")


def ask(model: ChatModel, text: str = "hi") -> Awaitable[ChatMessage]:
    return model.chat([ChatMessage.user(text)])


@sync
async def test_requests_per_minute_are_held() -> None:
    clock = FakeClock()
    model = Recorder(clock, rate_limit=RateLimit(requests_per_minute=60, clock=clock))
    await drive(clock, [ask(model) for _ in range(5)])
    # One second's worth of burst (one request), then one a second.
    assert model.starts == pytest.approx([0, 1, 2, 3, 4])


@sync
async def test_a_burst_of_one_second_then_the_configured_rate() -> None:
    clock = FakeClock()
    model = Recorder(clock, rate_limit=RateLimit(requests_per_minute=600, clock=clock))
    await drive(clock, [ask(model) for _ in range(40)])
    assert model.starts[:10] == [0.0] * 10  # the burst: 600/60 = 10
    assert model.starts[-1] == pytest.approx(3.0)  # then 10 a second: 30 more in 3 s
    for i, t in enumerate(model.starts):  # never above the rate plus one burst
        assert i + 1 <= 10 + 10 * t + 1e-9


@sync
async def test_tokens_per_minute_use_the_estimate_corrected_by_the_reported_usage() -> None:
    clock = FakeClock()
    # 6000 tokens a minute: 100 a second, a burst of 100. Each request is estimated at
    # 160/4 + 4 = 44 tokens and reported at 50.
    limit = RateLimit(tokens_per_minute=6000, clock=clock)
    model = Recorder(clock, used=50, rate_limit=limit)
    text = "x" * 160
    assert estimate_tokens([ChatMessage.user(text)]) == 44
    await drive(clock, [ask(model, text) for _ in range(4)])
    # 100 -> 56 -> (corrected) 50 -> 6 -> 0: two at once; the third waits for 44 more tokens
    # (0.44 s), leaving -6 after correction; the fourth waits for 50 (0.5 s).
    assert model.starts == pytest.approx([0, 0, 0.44, 0.94])


@sync
async def test_a_failed_request_gives_its_estimated_tokens_back() -> None:
    clock = FakeClock()
    limit = RateLimit(tokens_per_minute=6000, clock=clock)
    model = Recorder(clock, used=44, rate_limit=limit, retry=RetryPolicy(max_attempts=1))
    model.fail = [ModelCallError("HTTP 400", status=400)] * 2
    text = "x" * 160
    for _ in range(2):
        with pytest.raises(ModelCallError):
            await ask(model, text)
    await drive(clock, [ask(model, text) for _ in range(2)])
    assert model.starts == [0.0] * 4  # the failures cost nothing


def test_the_estimate_counts_text_tool_specs_and_the_reply_cap() -> None:
    msgs = [ChatMessage.system("a" * 8), ChatMessage.user("b" * 8)]
    assert estimate_tokens(msgs) == 4 + 2 * 4
    assert estimate_tokens(msgs, options={"max_tokens": 100}) == 4 + 8 + 100
    spec = {"name": "t", "description": "", "parameters": {}}
    assert estimate_tokens(msgs, [spec]) > estimate_tokens(msgs)


@sync
async def test_concurrency_is_a_semaphore() -> None:
    clock = FakeClock()
    model = Recorder(clock, rate_limit=RateLimit(concurrency=2, clock=clock))
    model.gate = asyncio.Event()
    tasks = [asyncio.ensure_future(ask(model)) for _ in range(5)]
    for _ in range(50):
        await asyncio.sleep(0)
    assert model.in_flight == 2 and len(model.starts) == 2
    model.gate.set()
    await asyncio.gather(*tasks)
    assert model.most_in_flight == 2 and len(model.starts) == 5


@sync
async def test_a_429_retry_after_holds_every_call_through_the_connection() -> None:
    clock = FakeClock()
    limit = RateLimit(clock=clock)  # no rate configured: only the Retry-After hold
    policy = RetryPolicy(max_attempts=3, jitter=0, initial_backoff=0.5, sleep=clock.sleep)
    model = Recorder(clock, rate_limit=limit, retry=policy)
    model.fail = [ModelCallError("HTTP 429", status=429, transient=True, retry_after=10)]
    first = asyncio.ensure_future(ask(model))
    for _ in range(20):
        await asyncio.sleep(0)
    assert model.starts == [0.0] and limit.held_until == 10.0
    clock.advance(1)
    # Another call, on another key, say: it did not get the 429, but waits out the hold too.
    await drive(clock, [first, ask(model), ask(model)])
    assert model.starts[0] == 0.0
    assert min(model.starts[1:]) >= 10.0, model.starts
    assert len(model.starts) == 4


@sync
async def test_a_connection_without_a_rate_limit_is_unchanged() -> None:
    model = ScriptedChatModel(["hello"])
    assert model.rate_limit is None
    assert (await ask(model)).content == "hello"


def test_the_connection_names_the_resource_its_calls_wait_on() -> None:
    model = OpenAIChatModel("m", api_key="k", base_url="http://127.0.0.1:9/v1")
    assert model.resource.name == "chat:openai:http://127.0.0.1:9/v1"
    assert (model.resource.probe_delay, model.resource.max_probe_delay) == (1.0, 60.0)
    named = OpenAIChatModel(
        "m", api_key="k", resource_name="llm", probe_delay=0.5, max_probe_delay=5
    )
    assert named.resource.name == "llm"
    assert (named.resource.probe_delay, named.resource.max_probe_delay) == (0.5, 5)
    assert ScriptedChatModel(["x"]).resource.name == "chat:scripted:scripted"
    transient = ModelCallError("HTTP 503", status=503, transient=True)
    assert model.resource.transient(transient) and model.resource.transient(TimeoutError())
    assert model.resource.transient(ConnectionRefusedError())
    assert not model.resource.transient(ModelCallError("HTTP 400", status=400))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"requests_per_minute": 0}, r"requests_per_minute=\) takes a number > 0"),
        ({"tokens_per_minute": -5}, r"tokens_per_minute=\) takes a number > 0"),
        ({"concurrency": 0}, r"concurrency=\) takes an int >= 1"),
        ({"concurrency": 1.5}, r"concurrency=\) takes an int >= 1"),
        ({"burst_seconds": 0}, r"burst_seconds=\) takes seconds > 0"),
        ({"clock": "now"}, r"clock=\) takes a ratchet Clock"),
    ],
)
def test_bad_limits_are_config_errors_naming_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RateLimit(**kwargs)


def test_bad_connection_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"rate_limit= takes a ratchet.RateLimit"):
        ScriptedChatModel(["x"], rate_limit={"requests_per_minute": 5})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="probe_delay"):
        ScriptedChatModel(["x"], probe_delay=0)
    with pytest.raises(ConfigError, match="resource_name"):
        ScriptedChatModel(["x"], resource_name="")
