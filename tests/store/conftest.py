"""Fixtures of the store tests; the backends themselves are listed in store_backends.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from store_backends import BACKENDS, FAKE_START, Stores

from ratchet.testing import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(FAKE_START)


@pytest.fixture(params=BACKENDS, ids=[b.name for b in BACKENDS])
def stores(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[Stores]:
    opened = Stores(request.param, tmp_path, clock)
    yield opened
    opened.close_all()


@pytest.fixture
def all_stores(tmp_path: Path, clock: FakeClock) -> Iterator[list[Stores]]:
    opened = [Stores(b, tmp_path, clock) for b in BACKENDS]
    yield opened
    for s in opened:
        s.close_all()
