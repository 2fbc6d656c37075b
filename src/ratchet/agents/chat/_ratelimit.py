"""`RateLimit`: keep a chat model connection under its provider's limits instead of
collecting 429s.

Requests per minute and tokens per minute are token buckets refilled continuously on a
`Clock` (injectable, so tests run on `ratchet.testing.FakeClock`); concurrency is a
semaphore. A 429 with a Retry-After holds every call through the connection, not just the
one that got it: the provider's limit is per account, so the other calls would get 429s too.
"""

from __future__ import annotations

import asyncio
import json
import math
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import ConfigError
from ratchet.agents.chat._messages import ChatMessage

#: characters per token in the estimate (OpenAI's rule of thumb for English text)
CHARS_PER_TOKEN = 4
_EPSILON = 1e-9  # float error in refills must not become a sleep of 1e-17 s

#: tokens counted per message for its role and framing
TOKENS_PER_MESSAGE = 4


def estimate_tokens(
    messages: Sequence[ChatMessage],
    tools_spec: Sequence[Mapping[str, Any]] = (),
    options: Mapping[str, Any] | None = None,
) -> int:
    """What a request will cost before it is sent: one token per 4 characters of the messages'
    text, tool-call arguments and tool specs, 4 per message, plus the reply's cap
    (`max_tokens` / `max_completion_tokens` in the options) when one is set. Corrected with
    the usage the response reports."""
    chars = 0
    for m in messages:
        chars += len(m.content or "")
        for tc in m.tool_calls:
            chars += len(tc.name) + len(json.dumps(tc.arguments, sort_keys=True))
    for spec in tools_spec:
        chars += len(json.dumps(spec, sort_keys=True, default=str))
    tokens = math.ceil(chars / CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * len(messages)
    opts = options or {}
    for cap in ("max_completion_tokens", "max_tokens"):
        value = opts.get(cap)
        if isinstance(value, int) and value > 0:
            tokens += value
            break
    return max(1, tokens)


class _Bucket:
    """A token bucket of `per_minute` refilled continuously, holding at most `capacity`.

    A cost above the capacity is let through when the bucket is full and leaves it in debt,
    so the long-run rate holds whatever the request sizes."""

    def __init__(self, per_minute: float, capacity: float, now: float) -> None:
        self.rate = per_minute / 60.0
        self.capacity = capacity
        self.level = capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait(self, cost: float, now: float) -> float:
        """Seconds until `cost` may be taken (0: now)."""
        self.refill(now)
        need = min(cost, self.capacity)
        short = need - self.level
        return 0.0 if short <= _EPSILON else short / self.rate

    def take(self, cost: float) -> None:
        self.level -= cost

    def give_back(self, cost: float) -> None:
        self.level = min(self.capacity, self.level + cost)


class _LoopState:
    def __init__(self, concurrency: int | None) -> None:
        self.gate = asyncio.Lock()  # FIFO: callers take from the buckets in arrival order
        self.slots = asyncio.Semaphore(concurrency) if concurrency else None


@dataclass(eq=False)
class RateLimit:
    """Limits of one chat model connection (all calls through it, across keys and runs).

    `requests_per_minute` and `tokens_per_minute` are refilled continuously, with bursts of up
    to one second's worth (`burst_seconds`): providers enforce per-minute limits over shorter
    windows. `concurrency` caps requests in flight. `clock` is the time source (default the
    system clock; tests pass a FakeClock). None means no limit of that kind.
    """

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    concurrency: int | None = None
    burst_seconds: float = 1.0
    clock: Clock | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (
                type(value) not in (int, float) or not math.isfinite(value) or value <= 0
            ):
                raise ConfigError(
                    f"RateLimit({name}=) takes a number > 0 (or None for no limit), got {value!r}"
                )
        if self.concurrency is not None and (
            type(self.concurrency) is not int or self.concurrency < 1
        ):
            raise ConfigError(
                f"RateLimit(concurrency=) takes an int >= 1 (or None for no limit), got "
                f"{self.concurrency!r}"
            )
        if (
            type(self.burst_seconds) not in (int, float)
            or not math.isfinite(self.burst_seconds)
            or self.burst_seconds <= 0
        ):
            raise ConfigError(
                f"RateLimit(burst_seconds=) takes seconds > 0, got {self.burst_seconds!r}"
            )
        if self.clock is not None and not isinstance(self.clock, Clock):
            raise ConfigError(f"RateLimit(clock=) takes a ratchet Clock, got {self.clock!r}")
        self._clock: Clock = self.clock or SYSTEM_CLOCK
        now = self._clock.monotonic()
        self._requests = self._bucket(self.requests_per_minute, now)
        self._tokens = self._bucket(self.tokens_per_minute, now)
        self._held_until = 0.0
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
            weakref.WeakKeyDictionary()
        )

    def _bucket(self, per_minute: float | None, now: float) -> _Bucket | None:
        if per_minute is None:
            return None
        return _Bucket(per_minute, max(1.0, per_minute / 60.0 * self.burst_seconds), now)

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is None:
            state = self._loops[loop] = _LoopState(self.concurrency)
        return state

    @property
    def held_until(self) -> float:
        """The monotonic time (on `clock`) before which no call starts: a Retry-After."""
        return self._held_until

    def hold(self, seconds: float) -> None:
        """Start no call through this connection for `seconds` (a 429's Retry-After)."""
        if seconds > 0:
            self._held_until = max(self._held_until, self._clock.monotonic() + seconds)

    async def _admit(self, tokens: int) -> None:
        async with self._state().gate:
            while True:
                now = self._clock.monotonic()
                wait = self._held_until - now
                for bucket, cost in ((self._requests, 1), (self._tokens, tokens)):
                    if bucket is not None:
                        wait = max(wait, bucket.wait(cost, now))
                if wait <= _EPSILON:
                    break
                await self._clock.sleep(wait)
            if self._requests is not None:
                self._requests.take(1)
            if self._tokens is not None:
                self._tokens.take(tokens)

    @asynccontextmanager
    async def slot(self, estimate: int) -> AsyncIterator[_Usage]:
        """Wait until a request estimated at `estimate` tokens may go, and hold a concurrency
        slot while it runs; set `.used` on the yielded object to correct the estimate."""
        state = self._state()
        if state.slots is not None:
            await state.slots.acquire()
        try:
            await self._admit(estimate)
            usage = _Usage(estimate)
            try:
                yield usage
            finally:
                if self._tokens is not None:
                    if usage.used is None:
                        self._tokens.give_back(estimate)  # a failed request: nothing billed
                    elif usage.used >= estimate:
                        self._tokens.take(usage.used - estimate)
                    else:
                        self._tokens.give_back(estimate - usage.used)
        finally:
            if state.slots is not None:
                state.slots.release()


class _Usage:
    __slots__ = ("estimate", "used")

    def __init__(self, estimate: int) -> None:
        self.estimate = estimate
        self.used: int | None = None
