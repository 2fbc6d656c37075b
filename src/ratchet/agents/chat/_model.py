"""The chat-model interface, retries, and the connection/setup split Flink Agents uses."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from ratchet._errors import ConfigError
from ratchet.agents._resource import Resource
from ratchet.agents.chat._errors import ModelCallError
from ratchet.agents.chat._messages import ChatMessage
from ratchet.agents.chat._prompt import Prompt
from ratchet.agents.chat._ratelimit import RateLimit, estimate_tokens
from ratchet.agents.chat._tools import Tool
from ratchet.store import codec

T = TypeVar("T")


@dataclass
class RetryPolicy:
    """Exponential backoff for transient provider errors (429, 5xx, timeouts, connection drops).

    Delay before retry n (1-based) is `initial_backoff * multiplier**(n-1)`, capped at
    `max_backoff`, with up to `jitter` (a fraction) added; a server's Retry-After wins when it
    is longer, up to `max_backoff` (a longer outage ends in the connection's pause and probes,
    where it shows in `ratchet status`, not in a call held in memory). Non-transient errors (400, 401, 403, 404, ...) are never retried. `sleep` and
    `rng` are injectable so tests can run without waiting.
    """

    max_attempts: int = 4
    initial_backoff: float = 0.5
    max_backoff: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.1
    sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep, repr=False)
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def __post_init__(self) -> None:
        # Checked here, at construction: a wrong value otherwise failed at the first retry,
        # mid-job, as a dead letter (or a negative jitter shortened every wait).
        if type(self.max_attempts) is not int or self.max_attempts < 1:
            raise ConfigError(
                f"RetryPolicy(max_attempts=) is the number of attempts in all, an int >= 1; "
                f"got {self.max_attempts!r}"
            )
        for name in ("initial_backoff", "max_backoff", "multiplier", "jitter"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"RetryPolicy({name}=) takes a number >= 0, got {value!r}")
        if self.multiplier < 1:
            raise ConfigError(f"RetryPolicy(multiplier=) is a factor >= 1, got {self.multiplier!r}")

    def delay(self, attempt: int, retry_after: float | None) -> float:
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        base += base * self.jitter * self.rng.random()
        if retry_after is not None:
            base = max(base, min(retry_after, self.max_backoff))
        return base


class ChatModel(ABC):
    """What every provider implements: one call from messages (and tools, and an optional
    output schema) to an assistant `ChatMessage` carrying its token usage.

    Subclasses implement `_chat_once`, raising `ModelCallError` (with `transient` set) on
    failure; `chat` adds the retry policy. A model is also a *connection* resource in Flink
    Agents terms: `ChatModelSetup` binds one to a model name, a prompt and tools.
    """

    provider: str = "model"

    def __init__(
        self,
        *,
        model: str | None = None,
        retry: RetryPolicy | None = None,
        rate_limit: RateLimit | None = None,
        resource_name: str | None = None,
        probe_delay: float = 1.0,
        max_probe_delay: float = 60.0,
        timeout: float | None = None,
    ) -> None:
        """`timeout`: seconds one request may take in all, its reply's last byte included
        (None: no bound); past it the attempt fails as a transient timeout."""
        self.model = model
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError(
                f"retry= takes a ratchet.agents.chat.RetryPolicy(max_attempts=..., "
                f"initial_backoff=..., ...), got {retry!r}"
            )
        self.retry = retry or RetryPolicy()
        if timeout is not None and (
            type(timeout) not in (int, float) or not math.isfinite(timeout) or timeout <= 0
        ):
            raise ConfigError(
                f"{type(self).__name__}: timeout= takes seconds > 0 (or None for no bound), "
                f"got {timeout!r}"
            )
        self.timeout = timeout
        if rate_limit is not None and not isinstance(rate_limit, RateLimit):
            raise ConfigError(
                f"rate_limit= takes a ratchet.RateLimit(requests_per_minute=..., "
                f"tokens_per_minute=..., concurrency=...), got {rate_limit!r}"
            )
        self.rate_limit = rate_limit
        if resource_name is not None and (not isinstance(resource_name, str) or not resource_name):
            raise ConfigError(f"resource_name= takes a non-empty str, got {resource_name!r}")
        self._resource_name = resource_name
        try:
            self._pause = Resource(
                resource_name or "chat", probe_delay=probe_delay, max_probe_delay=max_probe_delay
            )
        except Exception as exc:
            raise ConfigError(
                f"{type(self).__name__}: probe_delay= and max_probe_delay= take seconds > 0: {exc}"
            ) from exc

    def endpoint(self) -> str:
        """Where this connection sends requests (a base URL or host); names its resource."""
        return self.model or type(self).__name__

    @property
    def resource(self) -> Resource:
        """The `ratchet.Resource` model calls wait on when the provider is down past the
        retries: named `resource_name=` or `chat:<provider>:<endpoint>`, so every connection
        to one server shares one circuit (it is down for all of them)."""
        pause: Resource = getattr(self, "_pause", None) or Resource("chat")  # no super().__init__
        name = getattr(self, "_resource_name", None) or f"chat:{self.provider}:{self.endpoint()}"
        if pause.name != name:
            pause = Resource(
                name,
                transient=pause.transient,
                probe_delay=pause.probe_delay,
                max_probe_delay=pause.max_probe_delay,
            )
        self._pause = pause
        return pause

    @abstractmethod
    async def _chat_once(
        self,
        messages: Sequence[ChatMessage],
        *,
        model: str | None,
        tools: Sequence[Tool],
        output_schema: type[BaseModel] | None,
        options: Mapping[str, Any],
    ) -> ChatMessage: ...

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Tool] = (),
        output_schema: type[BaseModel] | None = None,
        model: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> ChatMessage:
        """Ask the model; transient failures are retried per `self.retry`, and every attempt
        waits for `self.rate_limit` (a 429's Retry-After holds the whole connection)."""
        return await with_retries(
            self.retry,
            getattr(self, "rate_limit", None),
            lambda: self._attempt(messages, tools, output_schema, model, options or {}),
        )

    async def _attempt(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Tool],
        output_schema: type[BaseModel] | None,
        model: str | None,
        options: Mapping[str, Any],
    ) -> ChatMessage:
        def once() -> Awaitable[ChatMessage]:
            return self._chat_once(
                messages, model=model or self.model, tools=tools,
                output_schema=output_schema, options=options,
            )  # fmt: skip

        limit = getattr(self, "rate_limit", None)
        if limit is None:
            return await self._timed(once)
        merged = {**getattr(self, "options", {}), **options}
        cap = getattr(self, "max_tokens", None)  # Anthropic's reply cap
        if isinstance(cap, int):
            merged.setdefault("max_tokens", cap)
        estimate = estimate_tokens(messages, [t.spec() for t in tools], merged)
        async with limit.slot(estimate) as usage:
            reply = await self._timed(once)
            used = reply.usage.total_tokens if reply.usage is not None else 0
            usage.used = used or estimate
            return reply

    async def _timed(self, once: Callable[[], Awaitable[ChatMessage]]) -> ChatMessage:
        """One request, bounded in all by `timeout`: the SDKs' timeouts bound each read, so a
        reply that trickles in held the run for as long as it kept coming."""
        timeout = getattr(self, "timeout", None)  # a subclass that skipped super().__init__
        if timeout is None:
            return await once()
        try:
            async with asyncio.timeout(timeout):
                return await once()
        except TimeoutError as exc:
            raise ModelCallError(
                f"{self.provider}: request timed out: no whole reply within {timeout} s",
                provider=self.provider,
                transient=True,
            ) from exc


@dataclass
class ResourceDescriptor:
    """A resource to build later from a class and its arguments (Flink Agents' descriptor)."""

    clazz: type
    arguments: dict[str, Any]

    def __init__(self, clazz: type, **arguments: Any) -> None:
        self.clazz = clazz
        self.arguments = arguments

    def build(self) -> Any:
        return self.clazz(**self.arguments)


class ChatModelSetup:
    """A named way to use a chat model: which connection, model, prompt, tools and options.

    `connection`, `prompt` and the entries of `tools` may be resource names (resolved on the
    agent) or objects. `output_schema` (a pydantic model) is registered with the codec here,
    at start, so a recovered run finds it again by name.
    """

    def __init__(
        self,
        connection: str | ChatModel,
        model: str | None = None,
        *,
        prompt: str | Prompt | None = None,
        tools: Sequence[str | Tool | Callable[..., Any]] = (),
        output_schema: type[BaseModel] | None = None,
        max_turns: int | None = None,
        **options: Any,
    ) -> None:
        self.connection = connection
        self.model = model
        self.prompt = prompt
        self.tools = list(tools)
        self.output_schema = register_schema(output_schema) if output_schema else None
        if max_turns is not None and max_turns < 1:
            raise ConfigError("max_turns must be >= 1")
        self.max_turns = max_turns
        self.options = options


def register_schema(schema: Any) -> str:
    """Register a pydantic model class as an output schema; returns its registered name."""
    if isinstance(schema, str):
        return schema
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        raise ConfigError(f"output_schema must be a pydantic BaseModel class, not {schema!r}")
    name = codec.registered_name(schema)
    if name is None:
        codec.register(schema)
        name = codec.registered_name(schema)
    assert name is not None
    return name


def schema_class(name: str) -> type[BaseModel]:
    try:
        cls = codec.lookup(name)
    except codec.UnknownTypeError:
        raise ConfigError(
            f"output schema {name!r} is not registered in this process; register it at import "
            f"time (ratchet.register_type(cls) or output_schema= on the ChatModelSetup/agent) "
            f"so a recovered run can find it"
        ) from None
    if not issubclass(cls, BaseModel):
        raise ConfigError(f"output schema {name!r} is {cls!r}, not a pydantic model")
    return cls


_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def parse_structured(text: str, schema: type[BaseModel]) -> BaseModel:
    """Validate a reply's text (JSON, possibly in a ``` fence) into `schema`."""
    m = _FENCE.match(text)
    body = m.group(1) if m else text.strip()
    return schema.model_validate_json(body)


def schema_instruction(schema: type[BaseModel]) -> str:
    """For providers without native structured output: the instruction to reply in JSON."""
    return (
        "Reply with only a JSON object (no prose, no code fence) that validates against this "
        f"JSON schema:\n{json.dumps(schema.model_json_schema(), sort_keys=True)}"
    )


async def with_retries(
    policy: RetryPolicy, limit: Any, attempt_once: Callable[[], Awaitable[T]]
) -> T:
    """Call `attempt_once` until it succeeds, retrying transient `ModelCallError`s per `policy`
    (a 429's Retry-After holds the whole rate limit `limit`); the last transient error says
    how many attempts were made. Chat and embedding models share it."""
    attempt = 1
    while True:
        try:
            return await attempt_once()
        except ModelCallError as exc:
            if exc.status == 429 and exc.retry_after and limit is not None:
                limit.hold(exc.retry_after)
            if not exc.transient or attempt >= policy.max_attempts:
                if exc.transient:
                    raise ModelCallError(
                        f"{exc} (gave up after {attempt} attempts)",
                        provider=exc.provider,
                        status=exc.status,
                        transient=True,
                        retry_after=exc.retry_after,
                    ) from exc
                raise
            await policy.sleep(policy.delay(attempt, exc.retry_after))
            attempt += 1
