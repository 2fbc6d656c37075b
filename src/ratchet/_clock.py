"""Time as an input: every read of the wall clock, the monotonic clock or a sleep goes here.

Engines, stores, the supervisor and the check runner take a `Clock`; production code passes
`SYSTEM_CLOCK`, tests pass `ratchet.testing.FakeClock`, which only moves when told to, so a
timer or a timeout is tested at an exact virtual time without sleeping.
"""

from __future__ import annotations

import math
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ratchet._clock_protocol import Clock as Clock


def __getattr__(name: str) -> object:
    # `Clock` is a `typing.Protocol` (engines check `isinstance` against it): made on first
    # use, so that a `ratchet checks` start-up, which only reads the clock, does not import
    # `typing`.
    if name == "Clock":
        from ratchet._clock_protocol import Clock

        return Clock
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SystemClock:
    """The real clocks of the machine."""

    __slots__ = ()

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        import asyncio  # here: `ratchet checks` reads the clock and never needs asyncio

        await asyncio.sleep(max(seconds, 0.0))

    def sleep_sync(self, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))

    def __repr__(self) -> str:
        return "SystemClock()"


SYSTEM_CLOCK: Clock = SystemClock()


def utc_iso(clock: Clock, timespec: str = "milliseconds") -> str:
    """`clock.now()` as an ISO-8601 UTC timestamp ending in Z (receipts, logs).

    The same text as `datetime.fromtimestamp(t, UTC).isoformat(timespec)` (microseconds
    rounded half to even, then truncated), made with `time` so that `ratchet checks` does not
    import `datetime` at start-up."""
    t = clock.now()
    if timespec not in ("seconds", "milliseconds"):
        import datetime

        stamp = datetime.datetime.fromtimestamp(t, datetime.UTC)
        return stamp.isoformat(timespec=timespec).replace("+00:00", "Z")
    frac, whole = math.modf(t)
    micros = round(frac * 1e6)
    seconds = int(whole)
    if micros >= 1_000_000:
        seconds, micros = seconds + 1, micros - 1_000_000
    elif micros < 0:
        seconds, micros = seconds - 1, micros + 1_000_000
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    if timespec == "milliseconds":
        text += f".{micros // 1000:03d}"
    return text + "Z"
