from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from connector_servers import NATS_PACKAGE, Nats, Postgres, postgres_or_skip


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    yield from postgres_or_skip()


@pytest.fixture(scope="session")
def nats_server() -> Iterator[Nats]:
    binary = shutil.which("nats-server")
    if binary is None:
        pytest.skip(
            f"nats-server not found; install the Debian package {NATS_PACKAGE} "
            f"(`apt-get install {NATS_PACKAGE}`)"
        )
    pytest.importorskip("nats", reason="nats-py is not installed: pip install 'ratchet[nats]'")
    server = Nats(binary)
    try:
        yield server
    finally:
        server.stop()
