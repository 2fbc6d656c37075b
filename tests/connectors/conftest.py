from __future__ import annotations

from collections.abc import Iterator

import pytest
from connector_servers import Nats, Postgres, nats_binary, postgres_or_skip


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    yield from postgres_or_skip()


@pytest.fixture(scope="session")
def nats_server() -> Iterator[Nats]:
    server = Nats(nats_binary())
    try:
        yield server
    finally:
        server.stop()
