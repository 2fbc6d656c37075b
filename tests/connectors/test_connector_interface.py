"""The connector interface inside the engine: `acknowledge` comes only after the checkpoint
that holds the acknowledged position completed, and `open` before `restore`."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from relay_agent import Relay

import ratchet
from ratchet.runtime._io import IterableSource, JobIdentity
from ratchet.store import codec
from ratchet.store._sqlite import DB_NAME


class Recording(IterableSource):
    """An iterable source that records, at each acknowledge, what a reader of the state
    database sees as the committed source position at that moment."""

    def __init__(self, items: list[dict[str, Any]], state: Path) -> None:
        super().__init__(items)
        self.state = state
        self.calls: list[str] = []
        self.acks: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def open(self, job: JobIdentity | None, *, checkpoint_interval: float) -> None:
        assert job is not None and job.state_dir == self.state
        self.calls.append(f"open {checkpoint_interval}")

    def restore(self, position: dict[str, Any]) -> None:
        self.calls.append("restore")
        super().restore(position)

    def acknowledge(self, position: dict[str, Any]) -> None:
        with sqlite3.connect(self.state / DB_NAME) as db:
            (blob,) = db.execute("SELECT value FROM meta WHERE name = 'source'").fetchone()
        self.acks.append((position, codec.decode(blob)["position"]))


def test_acknowledge_follows_the_checkpoint_that_holds_the_position(tmp_path: Path) -> None:
    items = [{"key": f"k{i % 3}", "i": i} for i in range(500)]
    state = tmp_path / "state"
    source = Recording(items, state)
    out: list[dict[str, Any]] = []
    cfg = ratchet.EngineConfig(checkpoint_interval=0.001)
    ratchet.run(Relay(), inputs=source, output=out.append, state_dir=state, config=cfg)
    assert source.calls == ["open 0.001", "restore"]
    assert source.acks, "no checkpoint acknowledged anything"
    for acked, committed in source.acks:
        assert acked == committed  # already durable when the source hears of it
    indexes = [a["index"] for a, _ in source.acks]
    assert indexes == sorted(indexes) and indexes[-1] == 500
    assert len(out) == 500


class FailsOnce(IterableSource):
    def __init__(self, items: list[dict[str, Any]]) -> None:
        super().__init__(items)
        self.acked: list[int] = []

    def acknowledge(self, position: dict[str, Any]) -> None:
        self.acked.append(position["index"])
        if len(self.acked) == 1:
            raise ConnectionError("the broker is away")


def test_an_acknowledge_that_raises_is_logged_and_called_again_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    items = [{"key": f"k{i % 3}", "i": i} for i in range(2000)]  # many checkpoints
    source = FailsOnce(items)
    out: list[dict[str, Any]] = []
    cfg = ratchet.EngineConfig(checkpoint_interval=0.001)
    ratchet.run(Relay(), inputs=source, output=out.append, state_dir=tmp_path / "s", config=cfg)
    assert len(out) == 2000
    assert len(source.acked) >= 2 and source.acked[-1] == 2000
    assert "the source failed to acknowledge checkpointed inputs upstream" in caplog.text
    assert "the broker is away" in caplog.text
