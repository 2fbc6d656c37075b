"""Process-local metrics: counters in total and per key.

They are observations of this process, not state: they are not checkpointed, start at zero
in a restarted process (as Flink's metrics do), and a task replayed from the journal does
not count again. Durable per-key totals belong in memory instead.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from ratchet._errors import InvalidArgumentError


class Metrics:
    """Thread-safe counters; sync actions on worker threads update them too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, float] = {}
        self._per_key: dict[Any, dict[str, float]] = {}

    def add(self, key: Any, name: str, value: float = 1) -> None:
        with self._lock:
            self._totals[name] = self._totals.get(name, 0) + value
            mine = self._per_key.setdefault(key, {})
            mine[name] = mine.get(name, 0) + value

    def count(self) -> int:
        """How many counters have a value (read without the lock: a new name is what a
        caller polls for, and a dict's length is read atomically). Not `__len__`: an empty
        registry must stay truthy (`metrics or Metrics()`)."""
        return len(self._totals)

    def total(self, name: str) -> float:
        with self._lock:
            return self._totals.get(name, 0)

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(sorted(self._totals.items()))

    def for_key(self, key: Any) -> dict[str, float]:
        with self._lock:
            return dict(sorted(self._per_key.get(key, {}).items()))


# Prefixes of the counters ratchet keeps itself: the supervisor's /metrics turns
# `chat.model_calls[SETUP]` into ratchet_model_calls_total{model}, and the others are the
# engine's own counts, so an action's counter with one of them would fake ratchet's numbers.
RESERVED_PREFIXES = ("chat.", "durable_calls.", "actions.", "outputs.")


class KeyMetrics:
    """What an action sees as `ctx.metrics`: counters attributed to its key."""

    __slots__ = ("_registry", "_key")

    def __init__(self, registry: Metrics, key: Any) -> None:
        self._registry = registry
        self._key = key

    def inc(self, name: str, value: float = 1) -> None:
        """Add `value` to counter `name`, in total and for this key. A counter only grows, so
        `value` is a finite number >= 0 (a bool is refused: True is a mistake, not 1)."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"metric name must be a non-empty str, got {name!r}")
        if name.startswith(RESERVED_PREFIXES):
            raise InvalidArgumentError(
                f"ctx.metrics.inc({name!r}, value): names starting with "
                f"{', '.join(repr(p) for p in RESERVED_PREFIXES)} are ratchet's own counters; "
                "choose another name"
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise InvalidArgumentError(
                f"ctx.metrics.inc({name!r}, value): value must be a finite int or float >= 0 "
                f"(a counter only grows), got {value!r}"
            )
        self._registry.add(self._key, name, value)

    def _inc_own(self, name: str, value: float = 1) -> None:
        """Ratchet's own counting (the chat actions' `chat.*` counters), past the reserved
        names `inc` refuses; not for actions."""
        self._registry.add(self._key, name, value)
