"""`ratchet.Resource`: an external service whose outage pauses the stream instead of failing it.

A durable call made with `resource=` that fails with a transient error past its retries does
not fail its action: the call waits (durably, parked) while the resource's circuit is open,
the engine stops admitting new inputs, and one waiting call probes the resource at growing
intervals; when a probe succeeds the circuit closes, the waiting calls go on and so does the
stream. An error that retrying cannot fix still fails the call at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ratchet._errors import InvalidArgumentError, InvalidTypeError, ModelCallError


def transient_error(exc: BaseException) -> bool:
    """The default: a provider error marked transient (429, 5xx, a timeout, a dropped
    connection), a timeout, or a refused or reset connection."""
    if isinstance(exc, ModelCallError):
        return exc.transient
    return isinstance(exc, TimeoutError | ConnectionError)


@dataclass(frozen=True)
class Resource:
    """A named external service: `transient(exc)` says whether an error may pass with time;
    probes of an unavailable one start `probe_delay` seconds apart and double up to
    `max_probe_delay`."""

    name: str
    transient: Callable[[BaseException], bool] = field(default=transient_error)
    probe_delay: float = 1.0
    max_probe_delay: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidTypeError(f"Resource(name=) is a non-empty str, got {self.name!r}")
        if not callable(self.transient):
            raise InvalidTypeError("Resource(transient=) takes a function of the exception")
        for name in ("probe_delay", "max_probe_delay"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(f"Resource({name}=) takes seconds > 0, got {value!r}")
