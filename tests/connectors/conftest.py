from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from connector_servers import NATS_PACKAGE, PG_PACKAGE, Nats, Postgres, pg_bin


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    bindir = pg_bin()
    if bindir is None:
        pytest.skip(
            f"PostgreSQL server binaries (initdb, postgres) not found; install the Debian "
            f"package {PG_PACKAGE} (`apt-get install {PG_PACKAGE}`)"
        )
    pytest.importorskip(
        "psycopg", reason="psycopg is not installed: pip install 'ratchet[postgres]'"
    )
    server = Postgres(bindir)
    try:
        yield server
    finally:
        server.stop()


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
