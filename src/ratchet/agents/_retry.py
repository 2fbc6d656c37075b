"""`ratchet.Retry`: how often, and how far apart, a failed action or durable call is tried again.

The waits between attempts are durable timers (`ctx.sleep`'s): each failed attempt is recorded
with the time the next one may start, so a kill during the backoff resumes the same wait after
the restart, neither resetting it nor skipping it, and the attempt count carries over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ratchet._errors import InvalidArgumentError, InvalidTypeError


@dataclass(frozen=True)
class Retry:
    """Try again on `on` exceptions, up to `max_attempts` in all, waiting `initial_delay`
    seconds after the first failure, then `backoff` times longer each time, at most
    `max_delay`. An exception not in `on` fails at once."""

    max_attempts: int = 3
    initial_delay: float = 1.0
    max_delay: float = 60.0
    backoff: float = 2.0
    on: tuple[type[BaseException], ...] = field(default=(Exception,))

    def __post_init__(self) -> None:
        if type(self.max_attempts) is not int or self.max_attempts < 1:
            raise InvalidArgumentError(
                f"Retry(max_attempts=) is the number of attempts in all, an int >= 1; got "
                f"{self.max_attempts!r}"
            )
        for name in ("initial_delay", "max_delay", "backoff"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                raise InvalidArgumentError(f"Retry({name}=) takes a number >= 0, got {value!r}")
        if self.backoff < 1:
            raise InvalidArgumentError(f"Retry(backoff=) is a factor >= 1, got {self.backoff!r}")
        on = self.on if isinstance(self.on, tuple) else (self.on,)
        for cls in on:
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise InvalidTypeError(
                    f"Retry(on=) takes exception classes, e.g. on=(TimeoutError,), got {cls!r}"
                )
        object.__setattr__(self, "on", on)

    def delay(self, failed_attempt: int) -> float:
        """Seconds to wait after attempt number `failed_attempt` (from 1) failed."""
        return float(min(self.max_delay, self.initial_delay * self.backoff ** (failed_attempt - 1)))

    def retries(self, exc: BaseException, failed_attempt: int) -> bool:
        return failed_attempt < self.max_attempts and isinstance(exc, self.on)
