"""An external journal of durable-call records: the interface, and the in-memory reference.

The Flink engine keeps a durable call's record in keyed state, which is durable only at the
next checkpoint; a journal outside Flink, written through before the result returns to the
action, is what keeps a call that returned from being made again after a restore. Any store
every TaskManager reaches can be one (PostgreSQL in `ratchet.connectors._pg_journal`; Kafka or
Fluss later): it needs only the handful of methods of `CallJournalStore`, and the conformance
tests in tests/store/test_call_journal.py run against every implementation.

A record is named by what it is, within one journal namespace (one job, across its restores):
the Flink key, the run's input number on that key (`seq`), the task id and the call index. The
run's `input` fingerprint is stored beside it, so a record is only used for the same input at
the same number.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ratchet.store._base import CallRecord

TERMINAL = ("ok", "error")


@dataclass(frozen=True, slots=True)
class JournalledCall:
    """One call record as the journal keeps it: whose run it belongs to, and the record."""

    key: str  # the Flink key (ratchet.runtime._flink_core.flink_key)
    input: str  # fingerprint of the run's input event
    record: CallRecord


class CallJournalStore(Protocol):
    """Where durable-call records are written through, outside Flink's checkpoints.

    `put` returns once the records are durable (committed); a record whose stored status is
    terminal (`ok`/`error`) is never overwritten (a terminal result is a fact, whoever wrote
    it), an `intent` is. `complete` marks a key's runs up to `seq` as completed at time `at`
    (seconds since the epoch, the worker's clock); `prune(before)` deletes the records of runs
    marked completed before `before`. The caller decides when that is safe (docs/flink.md).
    """

    def put(self, calls: Sequence[JournalledCall]) -> None: ...
    def get(self, key: str) -> list[JournalledCall]: ...
    def keys(self) -> set[str]: ...
    def complete(self, marks: Sequence[tuple[str, int]], at: float) -> None: ...
    def prune(self, before: float) -> int: ...
    def clear(self) -> None: ...
    def close(self) -> None: ...


@dataclass
class _Row:
    call: JournalledCall
    completed_at: float | None = None


class MemoryCallJournal:
    """The reference `CallJournalStore`, in memory (shared by threads; tests use it)."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, int, str, int], _Row] = {}
        self._lock = threading.Lock()
        self.puts = 0  # how many `put` calls (a test can count round trips)

    def put(self, calls: Sequence[JournalledCall]) -> None:
        with self._lock:
            self.puts += 1
            for c in calls:
                r = c.record
                name = (c.key, r.seq, r.task_id, r.idx)
                old = self._rows.get(name)
                if old is not None and old.call.record.status in TERMINAL:
                    continue
                self._rows[name] = _Row(c, None if old is None else old.completed_at)

    def get(self, key: str) -> list[JournalledCall]:
        with self._lock:
            return [row.call for name, row in sorted(self._rows.items()) if name[0] == key]

    def keys(self) -> set[str]:
        with self._lock:
            return {name[0] for name in self._rows}

    def complete(self, marks: Sequence[tuple[str, int]], at: float) -> None:
        with self._lock:
            for key, seq in marks:
                for name, row in self._rows.items():
                    if name[0] == key and name[1] <= seq and row.completed_at is None:
                        row.completed_at = at

    def prune(self, before: float) -> int:
        with self._lock:
            gone = [
                name
                for name, row in self._rows.items()
                if row.completed_at is not None and row.completed_at < before
            ]
            for name in gone:
                del self._rows[name]
            return len(gone)

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()

    def close(self) -> None:
        pass

    def records(self) -> list[JournalledCall]:
        """Every stored record (for tests)."""
        with self._lock:
            return [row.call for _, row in sorted(self._rows.items())]
