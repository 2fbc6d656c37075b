"""Opening a PostgreSQL source, sink or call journal is bounded by connect_timeout: a server
that takes the TCP connection and never answers, or a table another session holds locked, is
a one-line error at start (exit 2), and a stop while connecting ends the job at once."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from connector_servers import AGENT, RATCHET, Postgres

from ratchet._errors import ConfigError
from ratchet.connectors import sink_for, source_for
from ratchet.connectors._postgres import PostgresSink, PostgresSource

pytest.importorskip("psycopg", reason="psycopg is not installed: pip install 'ratchet[postgres]'")

# Each start below should fail within its connect_timeout of 2 s, twice over at most (connect,
# then the table's checks); a run that hangs is ended, and failed, by this bound instead.
BOUND = 60


@pytest.fixture
def silent() -> Iterator[socket.socket]:
    """A loopback port that takes TCP connections and never answers: what a SIGSTOPped server,
    or a proxy whose database is gone, looks like to a client."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    try:
        yield srv
    finally:
        srv.close()


def run_cli(tmp_path: Path, *io: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RATCHET, "run", AGENT, *io, "--state", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=BOUND,
    )  # fmt: skip


def io_for(side: str, uri: str, tmp_path: Path) -> list[str]:
    """--input/--output with `uri` on `side`, a JSON Lines file on the other."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"key": "a", "i": 0}) + "\n")
    if side == "--input":
        return ["--input", uri, "--output", str(tmp_path / "out.jsonl")]
    return ["--input", str(inp), "--output", uri]


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    lines = [x for x in stderr.splitlines() if x.startswith("ratchet: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("side", ["--input", "--output"])
def test_a_server_that_never_answers_fails_the_start_naming_it(
    silent: socket.socket, tmp_path: Path, side: str
) -> None:
    port = silent.getsockname()[1]
    uri = f"postgresql://app:pw@127.0.0.1:{port}/db?table=t&connect_timeout=2"
    proc = run_cli(tmp_path, *io_for(side, uri, tmp_path))
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert line == (
        f"ratchet: error: {side} postgresql://app:***@127.0.0.1:{port}/db?table=t&"
        f"connect_timeout=2: PostgreSQL at 127.0.0.1:{port} did not answer within 2 s "
        f"(connect_timeout); check that the server is up and reachable, or give it longer with "
        f"&connect_timeout=SECONDS; with --supervise, ratchet waits for PostgreSQL at "
        f"127.0.0.1:{port} and retries"
    )


@pytest.mark.parametrize("side", ["--input", "--output"])
def test_a_table_locked_by_another_session_fails_the_start_naming_the_lock(
    postgres: Postgres, tmp_path: Path, side: str
) -> None:
    """A migration holding ACCESS EXCLUSIVE on the table: the checks at start wait for it.
    Without a bound the job hung there for as long as the lock was held."""
    import psycopg

    name = f"locked_{side.strip('-')}"
    if side == "--input":
        postgres.execute(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, key text)")
    else:
        postgres.execute(
            f"CREATE TABLE {name} (id text PRIMARY KEY, job text NOT NULL, key text, seq bigint, "
            f"task text, record jsonb NOT NULL)"
        )
    uri = f"{postgres.dsn}?table={name}&connect_timeout=2"
    with psycopg.connect(postgres.dsn) as lock:
        lock.execute(f"LOCK TABLE {name} IN ACCESS EXCLUSIVE MODE")
        proc = run_cli(tmp_path, *io_for(side, uri, tmp_path))
        lock.rollback()
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    doing = "checking the table" if side == "--input" else "preparing the output table"
    assert (
        f"{side} {uri} (table {name}): PostgreSQL at 127.0.0.1:{postgres.port} did not answer "
        f"within 2 s (connect_timeout) while {doing}: another session may hold a lock on the "
        f"table" in line
    )
    assert line.endswith(
        f"give it longer with &connect_timeout=SECONDS; with --supervise, ratchet waits for "
        f"PostgreSQL at 127.0.0.1:{postgres.port} and retries"
    )
    # The lock gone, the same command starts and runs the job.
    again = run_cli(tmp_path, *io_for(side, uri, tmp_path))
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_a_stop_while_connecting_ends_the_job_at_once(
    silent: socket.socket, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    """connect_timeout=60, and the signal once the job is connecting: it ends now, not after
    the timeout (the test's bound is less than it)."""
    port = silent.getsockname()[1]
    uri = f"postgresql://app@127.0.0.1:{port}/db?table=t&connect_timeout=60"
    argv = [*RATCHET, "run", AGENT, *io_for("--output", uri, tmp_path), "--state",
            str(tmp_path / "state")]  # fmt: skip
    # SIGINT as a terminal gives it: a suite started in the background by a shell without job
    # control (`make test &` in a script) passes SIGINT on ignored, and the job then rightly
    # ignores it too. As a context manager: its pipe is closed however the test ends.
    with subprocess.Popen(
        argv,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    ) as proc:
        try:
            silent.settimeout(BOUND)
            conn, _ = silent.accept()  # the job is connecting (no answer: conn stays open)
            with conn:
                proc.send_signal(sig)
                _, err = proc.communicate(timeout=BOUND // 2)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == code, err
    assert "Traceback" not in err


def test_connect_timeout_defaults_to_10_and_the_uri_sets_it() -> None:
    base = "postgresql://app@127.0.0.1:5432/db?table=t"
    for uri, seconds in [(base, 10), (f"{base}&connect_timeout=3", 3)]:
        s = sink_for(uri, append=False)
        src = source_for(uri, key="key", follow=False)
        assert isinstance(s, PostgresSink) and isinstance(src, PostgresSource)
        assert (s.connect_timeout, src.connect_timeout) == (seconds, seconds)


@pytest.mark.parametrize("bad", ["0", "-1", "1", "soon", "2.5"])
def test_a_connect_timeout_that_would_wait_forever_or_is_not_whole_seconds_is_refused(
    bad: str,
) -> None:
    """libpq's connect_timeout=0 means "wait forever": what this bound is there to prevent."""
    from ratchet.connectors._pg_journal import PostgresCallJournal

    uri = f"postgresql://app@127.0.0.1:5432/db?table=t&connect_timeout={bad}"
    message = "connect_timeout is a whole number of seconds, at least 2"
    with pytest.raises(ConfigError, match=f"--output .*: {message}"):
        sink_for(uri, append=False)
    with pytest.raises(ConfigError, match=f"--input .*: {message}"):
        source_for(uri, key="key", follow=False)
    with pytest.raises(ConfigError, match=f"--call-journal .*: {message}"):
        PostgresCallJournal(uri.replace("table=t&", ""), "ns")


def test_the_call_journal_honours_the_uris_connect_timeout(silent: socket.socket) -> None:
    from ratchet.connectors._pg_journal import PostgresCallJournal

    port = silent.getsockname()[1]
    with pytest.raises(ConfigError) as err:
        PostgresCallJournal(f"postgresql://u:pw@127.0.0.1:{port}/db?connect_timeout=2", "ns")
    assert str(err.value) == (
        f"--call-journal postgresql://u:***@127.0.0.1:{port}/db?connect_timeout=2: PostgreSQL "
        f"at 127.0.0.1:{port} did not answer within 2 s (connect_timeout); check that the "
        f"server is up and reachable, or give it longer with connect_timeout=SECONDS in its URI"
    )


def test_asking_a_locked_output_table_for_a_shards_ids_is_bounded_too(
    postgres: Postgres, tmp_path: Path
) -> None:
    """`holds_outputs_where` (what `--workers N` asks before any worker starts) waits for a
    lock on the table no longer than connect_timeout, like the checks at start."""
    import psycopg

    from ratchet._errors import ServerUnreachableError
    from ratchet.runtime._io import JobIdentity

    sink = sink_for(f"{postgres.dsn}?table=locked_ids&connect_timeout=2", append=False)
    job = JobIdentity("job1", tmp_path)
    sink.open(job)
    try:
        sink.write([{"id": "a:1:r>x:0", "key": "a", "seq": 1, "task": "r>x", "output": 1}])
        with psycopg.connect(postgres.dsn) as lock:
            lock.execute("LOCK TABLE locked_ids IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(ServerUnreachableError) as err:
                sink.holds_outputs_where(job, lambda out_id: True)
            lock.rollback()
        assert (
            f"PostgreSQL at 127.0.0.1:{postgres.port} did not answer within 2 s "
            f"(connect_timeout) while reading the ids of the output table" in str(err.value)
        )
    finally:
        sink.close()
