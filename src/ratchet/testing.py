"""Test doubles for users of ratchet and for its own suite.

- `FakeClock` implements `ratchet.Clock` and moves only when told: sleepers (async or
  blocking) wake when `advance` or `jump_to` moves virtual time past their deadline, so timers
  and timeouts are tested at exact virtual times with no real waiting.
- `MemoryStore` is the reference `CheckpointStore` (dicts; `reopen()` models a restart).
- `FaultyStore` wraps any store and fails or delays chosen calls from a seed.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading

from ratchet._errors import ConfigError
from ratchet.store._faulty import FaultyStore, Injected
from ratchet.store._memory import MemoryStore

__all__ = ["FakeClock", "FaultyStore", "Injected", "MemoryStore"]


def _seconds(what: str, value: object) -> None:
    if type(value) not in (int, float) or value != value:  # bool and NaN refused too
        raise ConfigError(f"{what}: takes a number of seconds, got {value!r}")


class FakeClock:
    """A clock for tests: virtual wall time and monotonic time, moved by `advance`.

    With `autojump=True` a sleep moves the clock to its own deadline at once (useful for code
    that sleeps between retries when the test only cares about the order of events).
    """

    def __init__(self, start: float = 1_800_000_000.0, *, autojump: bool = False) -> None:
        _seconds("FakeClock(start=)", start)
        self._epoch = float(start)
        self._offset = 0.0
        self.autojump = autojump
        self._lock = threading.Lock()
        self._order = itertools.count()
        # (deadline, order, waker) where waker() wakes the sleeper; heap by deadline then order.
        self._sleepers: list[tuple[float, int, _Waker]] = []

    def now(self) -> float:
        with self._lock:
            return self._epoch + self._offset

    def monotonic(self) -> float:
        with self._lock:
            return self._offset

    def advance(self, seconds: float) -> None:
        """Move virtual time forward by `seconds`, waking every sleeper now due."""
        _seconds(f"FakeClock.advance({seconds!r})", seconds)
        if seconds < 0:
            raise ConfigError(f"FakeClock.advance({seconds}): time only moves forward")
        with self._lock:
            self._offset += seconds
            due = self._pop_due()
        for waker in due:
            waker.wake()

    def jump_to(self, monotonic: float) -> None:
        """Move virtual monotonic time to `monotonic`. A time already passed does nothing
        (the clock never goes back; a driver thread may jump to a deadline another passed)."""
        _seconds(f"FakeClock.jump_to({monotonic!r})", monotonic)
        self.advance(max(0.0, monotonic - self.monotonic()))

    def next_deadline(self) -> float | None:
        """The monotonic time the earliest sleeper wakes at, or None with nobody asleep."""
        with self._lock:
            self._drop_cancelled()
            return self._sleepers[0][0] if self._sleepers else None

    @property
    def sleepers(self) -> int:
        """How many are asleep on this clock now (a cancelled sleep does not count)."""
        with self._lock:
            return sum(1 for _, _, w in self._sleepers if not w.cancelled)

    def _drop_cancelled(self) -> None:
        while self._sleepers and self._sleepers[0][2].cancelled:
            heapq.heappop(self._sleepers)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        if self.autojump:
            self.advance(seconds)
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        waker = _Waker(loop=loop, future=fut)
        self._register(seconds, waker)
        try:
            await fut
        finally:
            waker.cancelled = True  # woken or cancelled: either way no longer asleep

    def sleep_sync(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.autojump:
            self.advance(seconds)
            return
        event = threading.Event()
        self._register(seconds, _Waker(event=event))
        event.wait()

    def _register(self, seconds: float, waker: _Waker) -> None:
        with self._lock:
            heapq.heappush(self._sleepers, (self._offset + seconds, next(self._order), waker))

    def _pop_due(self) -> list[_Waker]:
        due = []
        while self._sleepers and self._sleepers[0][0] <= self._offset:
            waker = heapq.heappop(self._sleepers)[2]
            if not waker.cancelled:
                due.append(waker)
        return due

    def __repr__(self) -> str:
        return f"FakeClock(now={self.now()!r}, monotonic={self.monotonic()!r})"


class _Waker:
    __slots__ = ("loop", "future", "event", "cancelled")

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        future: asyncio.Future[None] | None = None,
        event: threading.Event | None = None,
    ) -> None:
        self.loop = loop
        self.future = future
        self.event = event
        self.cancelled = False

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()
        elif self.future is not None and self.loop is not None and not self.cancelled:
            fut = self.future

            def settle() -> None:
                if not fut.done():
                    fut.set_result(None)

            try:
                self.loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop closed: nobody is waiting any more
                pass
