"""Process-local metrics: counters in total and per key.

They are observations of this process, not state: they are not checkpointed, start at zero
in a restarted process (as Flink's metrics do), and a task replayed from the journal does
not count again. Durable per-key totals belong in memory instead.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from typing import Any

from ratchet._errors import InvalidArgumentError

# Bounds on what a long-running job keeps in memory (docs/runtime.md, "Metrics"): counters
# per key for the keys counted most recently, and distinct names an action may count under (a
# name made from an id, `orders.<id>`, would otherwise grow without end, on /metrics too).
MAX_KEYS = 10_000
MAX_NAMES = 1_000
DROPPED = "actions.metric_names_dropped"  # how many counts past MAX_NAMES were dropped

log = logging.getLogger("ratchet.metrics")


class Metrics:
    """Thread-safe counters; sync actions on worker threads update them too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, float] = {}
        # Least recently counted key first: the oldest goes past MAX_KEYS.
        self._per_key: collections.OrderedDict[Any, dict[str, float]] = collections.OrderedDict()
        self._user_names = 0
        self._warned = False

    def add(self, key: Any, name: str, value: float = 1) -> None:
        with self._lock:
            self._add(key, name, value)

    def _add(self, key: Any, name: str, value: float) -> None:
        self._totals[name] = self._totals.get(name, 0) + value
        per_key = self._per_key
        mine = per_key.get(key)
        if mine is None:
            mine = per_key[key] = {}
            if len(per_key) > MAX_KEYS:
                per_key.popitem(last=False)
        else:
            per_key.move_to_end(key)
        mine[name] = mine.get(name, 0) + value

    def add_user(self, key: Any, name: str, value: float) -> None:
        """An action's count (`ctx.metrics.inc`): past MAX_NAMES distinct names, a new name is
        dropped (counted under DROPPED, warned about once) instead of growing without end."""
        with self._lock:
            if name not in self._totals:
                if self._user_names >= MAX_NAMES:
                    self._add(key, DROPPED, 1)
                    if not self._warned:
                        self._warned = True
                        log.warning(
                            "ctx.metrics.inc(%r): %d counter names already; new names are "
                            "dropped (counted in %s). A name that holds an id or a value grows "
                            "without end: keep names few and put the varying part in memory "
                            "or an output", name, MAX_NAMES, DROPPED,
                        )  # fmt: skip
                    return
                self._user_names += 1
            self._add(key, name, value)

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
        self._registry.add_user(self._key, name, value)

    def _inc_own(self, name: str, value: float = 1) -> None:
        """Ratchet's own counting (the chat actions' `chat.*` counters), past the reserved
        names `inc` refuses; not for actions."""
        self._registry.add(self._key, name, value)
