"""The `Clock` protocol, apart from `ratchet._clock` so that reading the system clock does
not import `typing` (see `ratchet._clock`'s `__getattr__`)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Clock"]


@runtime_checkable
class Clock(Protocol):
    """The three things ratchet asks of time."""

    def now(self) -> float:
        """Wall-clock seconds since the epoch (stored in checkpoints and receipts)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (durations, deadlines)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` on this clock (in an event loop)."""
        ...

    def sleep_sync(self, seconds: float) -> None:
        """Block the calling thread for `seconds` on this clock."""
        ...
