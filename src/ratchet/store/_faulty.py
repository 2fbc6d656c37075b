"""A `CheckpointStore` that fails and stalls on purpose, from a seed, for fault tests.

`FaultyStore` wraps any store (SQLite, memory, a later backend) and injects faults into
chosen calls of chosen methods, by call number and/or by probability:

    store = FaultyStore(SqliteStore.open(...), seed=7)
    store.fail("write_checkpoint", calls=[2, 3])        # the 2nd and 3rd checkpoints fail
    store.fail("put_calls", rate=0.1)                   # one call-record write in ten fails
    store.delay("write_checkpoint", 0.5, rate=0.2)      # a slow disk, on the injected clock

A failure is raised *before* the wrapped store is called, so nothing of that call is
applied (what the protocol promises of a failed write). `fail(..., after=True)` instead
calls the wrapped store and then raises: the write happened but its caller was told it
failed, as when a commit succeeds and the process loses the answer; retries must be
harmless then. `count_failed_checkpoint` is best effort by contract, so an injected
`Exception` there is swallowed: the count is dropped.

Every decision comes from `random.Random` seeded with `(seed, method)` and the same number
of draws per call, so the n-th call of a method gets the same fate for the same seed however
calls of other methods interleave. `injected` lists what was done, as
`(method, call number, fault)`; put `seed` (and `injected`) in assertion messages so a
failure can be replayed.
"""

from __future__ import annotations

import errno
import random
import sqlite3
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import ConfigError
from ratchet.store._base import (
    Adopted,
    AgentVersion,
    CallRecord,
    CheckpointRows,
    CheckpointStore,
    Loaded,
    SignalRow,
)

T = TypeVar("T")

METHODS = (
    "adopt",
    "load",
    "key_row",
    "write_checkpoint",
    "put_calls",
    "forget_outputs",
    "count_failed_checkpoint",
    "record_restore",
    "stats",
    "signals_after",
    "consume_signal",
    "drop_calls",
    "release_signals",
    "release_attempt_signals",
    "redrives",
    "redrive_signals",
)


class Injected(NamedTuple):
    """One fault that was injected: the method, its call number (from 1), and the fault:
    "fail" (raised before the call), "fail_after" (raised after it) or "delay"."""

    method: str
    call: int
    fault: str


@dataclass(frozen=True)
class _Rule:
    kind: str  # "fail" or "delay"
    calls: frozenset[int]
    rate: float
    error: BaseException | Callable[[], BaseException] | None = None
    after: bool = False
    seconds: tuple[float, float] = (0.0, 0.0)


class FaultyStore:
    """Wrap `inner`; inject the faults configured with `fail` and `delay`, from `seed`.

    `seed=None` draws one (read it from `.seed`). Delays sleep on `clock` (`sleep_sync`), so
    a `FakeClock(autojump=True)` makes them free. Call from one thread at a time, like any
    store; the bookkeeping is locked anyway.
    """

    def __init__(
        self, inner: CheckpointStore, seed: int | None = None, *, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.inner = inner
        self.seed = seed if seed is not None else random.SystemRandom().randrange(2**32)
        self.clock = clock
        self.injected: list[Injected] = []
        self.calls: dict[str, int] = dict.fromkeys(METHODS, 0)
        self._rules: dict[str, list[_Rule]] = {m: [] for m in METHODS}
        self._rngs = {m: random.Random(f"{self.seed}/{m}") for m in METHODS}
        self._lock = threading.Lock()

    # -- configuring ------------------------------------------------------------------------

    def fail(
        self,
        method: str,
        *,
        calls: Iterable[int] = (),
        rate: float = 0.0,
        error: BaseException | Callable[[], BaseException] | None = None,
        after: bool = False,
    ) -> FaultyStore:
        """Make the given call numbers of `method` (counted from 1), and each other call with
        probability `rate`, raise `error` (an exception, or a function returning one; by
        default an `OSError` "no space left" or a `sqlite3.OperationalError` "disk I/O
        error", picked from the seed). Before the wrapped call, or after it with `after`."""
        self._add(method, _Rule("fail", self._numbers(calls), self._rate(rate), error, after))
        return self

    def delay(
        self,
        method: str,
        seconds: float | tuple[float, float],
        *,
        calls: Iterable[int] = (),
        rate: float = 0.0,
    ) -> FaultyStore:
        """Make the given calls of `method`, and each other with probability `rate`, first
        sleep `seconds` on the clock (or a time drawn from the range `(low, high)`)."""
        low, high = seconds if isinstance(seconds, tuple) else (seconds, seconds)
        if not 0 <= low <= high:
            raise ConfigError(
                f"FaultyStore.delay: seconds must be >= 0 and low <= high, not {seconds!r}"
            )
        self._add(
            method, _Rule("delay", self._numbers(calls), self._rate(rate), seconds=(low, high))
        )
        return self

    def _add(self, method: str, rule: _Rule) -> None:
        if method not in self._rules:
            raise ConfigError(
                f"FaultyStore cannot inject into {method!r}; it wraps {', '.join(METHODS)}"
            )
        with self._lock:
            self._rules[method].append(rule)

    @staticmethod
    def _numbers(calls: Iterable[int]) -> frozenset[int]:
        numbers = frozenset(calls)
        if any(type(n) is not int or n < 1 for n in numbers):
            raise ConfigError(f"FaultyStore: call numbers count from 1, got {sorted(numbers)!r}")
        return numbers

    @staticmethod
    def _rate(rate: float) -> float:
        if not 0.0 <= rate <= 1.0:
            raise ConfigError(f"FaultyStore: rate must be between 0 and 1, not {rate!r}")
        return float(rate)

    # -- injecting --------------------------------------------------------------------------

    def _plan(self, method: str) -> tuple[int, list[tuple[_Rule, float]]]:
        """This call's number and the rules that fire on it, each with a draw for its details."""
        with self._lock:
            self.calls[method] += 1
            n = self.calls[method]
            rng = self._rngs[method]
            firing = []
            for rule in self._rules[method]:
                fire, detail = rng.random(), rng.random()  # always two draws per rule
                if n in rule.calls or fire < rule.rate:
                    firing.append((rule, detail))
            return n, firing

    def _note(self, method: str, n: int, fault: str) -> None:
        with self._lock:
            self.injected.append(Injected(method, n, fault))

    def _error(self, rule: _Rule, detail: float, method: str, n: int) -> BaseException:
        if rule.error is not None:
            return rule.error if isinstance(rule.error, BaseException) else rule.error()
        where = f"injected by FaultyStore(seed={self.seed}) into {method} call {n}"
        if detail < 0.5:
            return OSError(errno.ENOSPC, f"No space left on device ({where})")
        return sqlite3.OperationalError(f"disk I/O error ({where})")

    def _call(self, method: str, fn: Callable[[], T]) -> T:
        n, firing = self._plan(method)
        for rule, detail in firing:
            if rule.kind == "delay":
                low, high = rule.seconds
                self._note(method, n, "delay")
                self.clock.sleep_sync(low + (high - low) * detail)
        fails = [(r, d) for r, d in firing if r.kind == "fail"]
        before = [(r, d) for r, d in fails if not r.after]
        if before:
            self._note(method, n, "fail")
            raise self._error(*before[0], method, n)
        result = fn()
        if fails:
            self._note(method, n, "fail_after")
            raise self._error(*fails[0], method, n)
        return result

    # -- the store protocol -----------------------------------------------------------------

    def adopt(self, agent: AgentVersion, dry_run: bool = False) -> Adopted:
        return self._call("adopt", lambda: self.inner.adopt(agent, dry_run))

    def load(self, lazy_keys: bool = False) -> Loaded:
        return self._call("load", lambda: self.inner.load(lazy_keys))

    def key_row(self, key: bytes) -> tuple[int, bytes, int] | None:
        return self._call("key_row", lambda: self.inner.key_row(key))

    def write_checkpoint(self, rows: CheckpointRows, triggered_at: float) -> dict[str, Any]:
        return self._call(
            "write_checkpoint", lambda: self.inner.write_checkpoint(rows, triggered_at)
        )

    def put_calls(self, records: Iterable[CallRecord]) -> None:
        records = list(records)
        self._call("put_calls", lambda: self.inner.put_calls(records))

    def redrives(self) -> list[tuple[int, bytes, bytes]]:
        return self._call("redrives", self.inner.redrives)

    def redrive_signals(self, dead_ids: list[int]) -> list[SignalRow]:
        return self._call("redrive_signals", lambda: self.inner.redrive_signals(list(dead_ids)))

    def signals_after(self, signal_id: int) -> list[tuple[int, str, str, bytes, float, str | None]]:
        return self._call("signals_after", lambda: self.inner.signals_after(signal_id))

    def consume_signal(self, signal_id: int, record: CallRecord) -> None:
        self._call("consume_signal", lambda: self.inner.consume_signal(signal_id, record))

    def drop_calls(self, seq: int, task_id: str, from_idx: int) -> list[SignalRow]:
        return self._call("drop_calls", lambda: self.inner.drop_calls(seq, task_id, from_idx))

    def release_signals(self, seq: int, task_id: str, idxs: list[int]) -> list[SignalRow]:
        return self._call(
            "release_signals", lambda: self.inner.release_signals(seq, task_id, list(idxs))
        )

    def release_attempt_signals(self, seq: int, task_id: str, key: Any) -> list[SignalRow]:
        return self._call(
            "release_attempt_signals",
            lambda: self.inner.release_attempt_signals(seq, task_id, key),
        )

    def forget_outputs(self, ids: list[str]) -> None:
        self._call("forget_outputs", lambda: self.inner.forget_outputs(ids))

    def count_failed_checkpoint(self) -> None:
        try:
            self._call("count_failed_checkpoint", self.inner.count_failed_checkpoint)
        except Exception:  # noqa: BLE001 - best effort by contract: the count is dropped
            pass

    def record_restore(self) -> dict[str, Any] | None:
        return self._call("record_restore", self.inner.record_restore)

    def stats(self) -> dict[str, Any]:
        return self._call("stats", self.inner.stats)

    def ltm_rows(self, scope: str) -> list[tuple[str, str, bytes, bytes, float]]:
        return self._call("ltm_rows", lambda: self.inner.ltm_rows(scope))

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r}, seed={self.seed}, injected={len(self.injected)})"
