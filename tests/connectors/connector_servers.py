"""Real PostgreSQL and NATS servers for the connector tests, started from the Debian packages
on free loopback ports in temporary directories and stopped by PID.

PostgreSQL refuses to run as root, so when the tests run as root its data directory belongs
to `nobody` and `initdb`/`postgres` run as that user (subprocess's `user=`).
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

AGENT = f"{Path(__file__).with_name('relay_agent.py')}:Relay"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
PG_PACKAGE = "postgresql"
NATS_PACKAGE = "nats-server"


def nats_binary() -> str:
    """nats-server's path, or the test skips naming the package that has it."""
    import pytest

    binary = shutil.which("nats-server")
    if binary is None:
        pytest.skip(
            f"nats-server not found; install the Debian package {NATS_PACKAGE} "
            f"(`apt-get install {NATS_PACKAGE}`)"
        )
    pytest.importorskip("nats", reason="nats-py is not installed: pip install 'ratchet[nats]'")
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port}: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def pg_bin() -> Path | None:
    """The directory of `initdb` and `postgres`: PATH first, then Debian's versioned place."""
    found = shutil.which("initdb")
    if found and shutil.which("postgres", path=str(Path(found).parent)):
        return Path(found).parent
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(d, "initdb").exists() and Path(d, "postgres").exists():
            return Path(d)
    return None


class Postgres:
    """One PostgreSQL server in a temporary directory; `dsn` names its `postgres` database."""

    def __init__(self, bindir: Path) -> None:
        root_user = os.geteuid() == 0
        # As root, `nobody` must reach the directory: /tmp, whatever TMPDIR says.
        self.root = Path(tempfile.mkdtemp(prefix="ratchet-pg-", dir="/tmp" if root_user else None))
        self.port = free_port()
        user: str | None = None
        if root_user:
            user = "nobody"
            shutil.chown(self.root, user)
        self.user = user
        data = self.root / "data"
        self.log = self.root / "server.log"
        with open(self.log, "wb") as log:
            subprocess.run(
                [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                 "--no-sync", "-E", "UTF8"],
                check=True, stdout=log, stderr=subprocess.STDOUT, user=user, cwd=self.root,
            )  # fmt: skip
        self.bindir = bindir
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.up()

    def up(self) -> None:
        """Start the server (again, after `down`: same port, same data) and wait until it
        takes connections."""
        log_fh = open(self.log, "ab")  # noqa: SIM115 - the server's lifetime
        self.proc = subprocess.Popen(
            [str(self.bindir / "postgres"), "-D", str(self.root / "data"), "-p", str(self.port),
             "-k", str(self.root), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
             "-c", "max_connections=60"],
            stdout=log_fh, stderr=subprocess.STDOUT, user=self.user, cwd=self.root,
        )  # fmt: skip
        log_fh.close()
        _wait_port(self.port, self.proc, "postgres", self.log)
        self._ready()

    def down(self) -> None:
        """Stop the server (fast shutdown), keeping its data, as a database restart does."""
        _stop(self.proc, signal.SIGINT)

    def _ready(self) -> None:
        import psycopg

        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def execute(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

    def stop(self) -> None:
        _stop(self.proc, signal.SIGINT)  # fast shutdown
        shutil.rmtree(self.root, ignore_errors=True)


class Nats:
    """One `nats-server -js` in a temporary directory."""

    def __init__(self, binary: str, *args: str, credentials: str | None = None) -> None:
        """`args`: more of the server's options (`--user U --pass P`); `credentials`
        ("U:P") what the test's own client then connects with."""
        self.binary = binary
        self.args = args
        self.root = Path(tempfile.mkdtemp(prefix="ratchet-nats-"))
        self.port = free_port()
        self.log = self.root / "server.log"
        self.url = f"nats://127.0.0.1:{self.port}"
        self._client_url = (
            self.url if credentials is None else f"nats://{credentials}@127.0.0.1:{self.port}"
        )
        self.up()

    def up(self) -> None:
        """Start the server (again, after `down`: same port, same store)."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd",
                 str(self.root / "store"), *self.args],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        _wait_port(self.port, self.proc, "nats-server", self.log)

    def down(self) -> None:
        """Stop the server, keeping its store, as a restart does."""
        _stop(self.proc, signal.SIGTERM)

    def run(self, fn: Any) -> Any:
        """`await fn(js)` on a fresh connection."""
        import nats

        async def main() -> Any:
            nc = await nats.connect(self._client_url)
            try:
                return await fn(nc.jetstream())
            finally:
                await nc.drain()

        return asyncio.run(main())

    def add_stream(self, name: str, subjects: list[str], duplicate_window: float = 120) -> None:
        from nats.js.api import StreamConfig

        async def add(js: Any) -> None:
            await js.add_stream(
                StreamConfig(name=name, subjects=subjects, duplicate_window=duplicate_window)
            )

        self.run(add)

    def publish(self, subject: str, payloads: list[bytes]) -> None:
        async def pub(js: Any) -> None:
            for p in payloads:
                await js.publish(subject, p)

        self.run(pub)

    def count(self, stream: str) -> int:
        async def info(js: Any) -> int:
            return int((await js.stream_info(stream)).state.messages)

        return int(self.run(info))

    def messages(self, stream: str) -> list[Any]:
        """Every message of `stream`, in order: (data, headers)."""

        async def read(js: Any) -> list[Any]:
            info = await js.stream_info(stream)
            out = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await js.get_msg(stream, seq)
                out.append((msg.data, msg.headers or {}))
            return out

        return list(self.run(read))

    def stop(self) -> None:
        _stop(self.proc, signal.SIGTERM)
        shutil.rmtree(self.root, ignore_errors=True)


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any] | None:
    """(status, JSON answer) of a POST to an ingestion endpoint, or None when the server is not
    there (or died mid-request)."""
    req = urllib.request.Request(url + "/v1/events", data=body, method="POST", headers=headers)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except (OSError, urllib.error.URLError):
        return None


def postgres_or_skip() -> Iterator[Postgres]:
    """A session fixture's body: a real PostgreSQL server on a free port until the session
    ends; the test skips, naming the package, where the server or psycopg is missing."""
    import pytest

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
