"""The store backends every conformance test runs against: add a new backend to BACKENDS.

A backend is five functions: `open(directory, clock)` makes a fresh, empty store (a durable
one keeps its files under `directory`), `reopen(store, directory, clock)` returns what a
restarted process would see (the old object is finished with), `send(store, directory,
key, name, value)` sends a signal to it as another process would, `redrive(store,
directory, dead_id)` asks for a dead letter to be redriven, as `ratchet redrive --id` would,
and `detail(store, dead_id)` reads a dead letter's encoded detail. The `stores` fixture
(conftest.py) hands a test one backend at a time; `all_stores` hands it every backend.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ratchet._clock import Clock
from ratchet.runtime._deadletters import request_redrive
from ratchet.runtime._signals import send_signal
from ratchet.store import codec
from ratchet.store._base import CheckpointStore
from ratchet.store._memory import MemoryStore
from ratchet.store._sqlite import SqliteStore
from ratchet.testing import FakeClock

FAKE_START = 1_800_000_000.0

_AGENT = ("conformance.Agent", "0123456789abcdef", ["act(ratchet.InputEvent)"])


def _open_sqlite(directory: Path, clock: Clock) -> CheckpointStore:
    return SqliteStore.open(directory, *_AGENT, clock=clock)


def _reopen_sqlite(store: CheckpointStore, directory: Path, clock: Clock) -> CheckpointStore:
    store.close()
    return _open_sqlite(directory, clock)


def _reopen_memory(store: CheckpointStore, directory: Path, clock: Clock) -> CheckpointStore:
    assert isinstance(store, MemoryStore)
    return store.reopen()


def _send_memory(store: CheckpointStore, _directory: Path, key: Any, name: str, value: Any) -> int:
    assert isinstance(store, MemoryStore)
    return store.add_signal(key, name, value)


def _send_sqlite(store: CheckpointStore, directory: Path, key: Any, name: str, value: Any) -> int:
    assert isinstance(store, SqliteStore)
    return int(send_signal(directory, key, name, value, clock=store.clock)["id"])


def _redrive_memory(store: CheckpointStore, _directory: Path, dead_id: int) -> None:
    assert isinstance(store, MemoryStore)
    store.request_redrive(dead_id)


def _redrive_sqlite(store: CheckpointStore, directory: Path, dead_id: int) -> None:
    assert isinstance(store, SqliteStore)
    request_redrive(directory, dead_id=dead_id, clock=store.clock)


def _detail_memory(store: CheckpointStore, dead_id: int) -> bytes | None:
    assert isinstance(store, MemoryStore)
    detail: bytes | None = store.dead[dead_id][7]
    return detail


def _detail_sqlite(store: CheckpointStore, dead_id: int) -> bytes | None:
    assert isinstance(store, SqliteStore)
    (detail,) = store.conn.execute(
        "SELECT detail FROM dead_letters WHERE id = ?", (dead_id,)
    ).fetchone()
    return None if detail is None else bytes(detail)


@dataclass(frozen=True)
class Backend:
    name: str
    open: Callable[[Path, Clock], CheckpointStore]
    reopen: Callable[[CheckpointStore, Path, Clock], CheckpointStore]
    # Send a signal to the store's state (as another process would): its id.
    send: Callable[[CheckpointStore, Path, Any, str, Any], int]
    # Ask for a dead letter (by its id) to be redriven, as another process would.
    redrive: Callable[[CheckpointStore, Path, int], None]
    # A dead letter's detail (by its id), encoded, as the store keeps it.
    detail: Callable[[CheckpointStore, int], bytes | None]


BACKENDS = [
    Backend(
        "memory",
        lambda _directory, clock: MemoryStore(clock),
        _reopen_memory,
        _send_memory,
        _redrive_memory,
        _detail_memory,
    ),
    Backend("sqlite", _open_sqlite, _reopen_sqlite, _send_sqlite, _redrive_sqlite, _detail_sqlite),
]


class Stores:
    """Opens fresh stores of one backend on one fake clock, and closes them all at the end."""

    def __init__(self, backend: Backend, root: Path, clock: FakeClock) -> None:
        self.backend = backend
        self.root = root
        self.clock = clock
        self._dirs: dict[int, Path] = {}
        self._open: list[CheckpointStore] = []
        self._n = itertools.count()

    @property
    def name(self) -> str:
        return self.backend.name

    def open(self) -> CheckpointStore:
        directory = self.root / f"{self.name}-{next(self._n)}"
        directory.mkdir(parents=True)
        store = self.backend.open(directory, self.clock)
        self._dirs[id(store)] = directory
        self._open.append(store)
        return store

    def reopen(self, store: CheckpointStore) -> CheckpointStore:
        """What a restarted process sees; `store` must not be used afterwards."""
        directory = self._dirs.pop(id(store))
        self._open.remove(store)
        again = self.backend.reopen(store, directory, self.clock)
        self._dirs[id(again)] = directory
        self._open.append(again)
        return again

    def send_signal(self, store: CheckpointStore, key: Any, name: str, value: Any) -> int:
        """Send a signal to `store`'s state, as `ratchet signal` would; its id."""
        return self.backend.send(store, self._dirs[id(store)], key, name, value)

    def ask_redrive(self, store: CheckpointStore, dead_id: int) -> None:
        """Ask for dead letter `dead_id` of `store`'s state to be redriven."""
        self.backend.redrive(store, self._dirs[id(store)], dead_id)

    def dead_detail(self, store: CheckpointStore, dead_id: int) -> Any:
        """Dead letter `dead_id`'s detail, decoded (None: it has none)."""
        blob = self.backend.detail(store, dead_id)
        return None if blob is None else codec.decode(blob)

    def close(self, store: CheckpointStore) -> None:
        self._dirs.pop(id(store))
        self._open.remove(store)
        store.close()

    def close_all(self) -> None:
        while self._open:
            self._open.pop().close()
        self._dirs.clear()
