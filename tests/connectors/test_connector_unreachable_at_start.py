"""A connector's server that cannot be reached when the job starts (down, restarting, not yet
taking connections) against one that answers no (a role, database or table that does not
exist, a wrong password).

The first is `ServerUnreachableError`: `ratchet run --supervise` restarts its worker within the
restart policy, with a delay that doubles, until the server is back, and the job runs to its
end with every output once. Unsupervised, it is one line and exit 2 that says so. The second
stays a plain `ConfigError`: exit 2, and the supervisor gives up at once, as before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from connector_servers import (
    AGENT,
    RATCHET,
    Nats,
    Postgres,
    free_port,
    nats_binary,
    postgres_or_skip,
)

from ratchet._errors import ConfigError, ServerUnreachableError
from ratchet.connectors import sink_for, source_for
from ratchet.runtime._io import JobIdentity
from ratchet.runtime._supervisor import unreachable_delay
from support.rest import get

N = 30
KEYS = 4
BOUND = 120  # seconds: a supervised run that hangs fails the test instead


@pytest.fixture
def own_postgres() -> Iterator[Postgres]:
    """A server of the test's own, which it may stop and start again (same port, same data)."""
    yield from postgres_or_skip()


@pytest.fixture
def own_nats() -> Iterator[Nats]:
    server = Nats(nats_binary())
    try:
        yield server
    finally:
        server.stop()


def inputs() -> list[dict[str, Any]]:
    return [{"key": f"k{i % KEYS}", "i": i} for i in range(N)]


def write_inputs(path: Path) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in inputs()))
    return str(path)


def assert_each_output_once(outputs: list[dict[str, Any]]) -> None:
    """Every input has exactly one output, and every key's carry the counts 1..m (each input
    applied to its key's memory once)."""
    assert sorted(o["output"]["i"] for o in outputs) == list(range(N))
    per_key = Counter(f"k{o['output']['i'] % KEYS}" for o in outputs)
    for key, m in per_key.items():
        counts = sorted(o["output"]["n"] for o in outputs if o["id"].startswith(f"{key}:"))
        assert counts == list(range(1, m + 1)), (key, counts)


def start_supervised(tmp: Path, *io: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp / "supervisor.log"
    argv = [*RATCHET, "run", AGENT, *io, "--state", str(tmp / "state"), "--supervise",
            "--restart-delay", "0.2", "--restart-attempts", "30"]  # fmt: skip
    with open(log, "wb") as fh:
        # Its own process group: a job that outlives BOUND is killed with its worker.
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=fh, start_new_session=True)
    return proc, log


def wait_for_line(proc: subprocess.Popen[bytes], log: Path, text: str) -> None:
    deadline = time.monotonic() + BOUND / 2
    while text not in log.read_text():
        assert proc.poll() is None, f"the supervisor ended ({proc.returncode}):\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in:\n{log.read_text()}"
        time.sleep(0.05)


def ended(proc: subprocess.Popen[bytes], log: Path) -> tuple[int, str]:
    """The job's exit code and its log, once it ended (killed if it outlives BOUND)."""
    try:
        code = proc.wait(timeout=BOUND)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the supervisor and its worker
            proc.wait()
    return code, log.read_text()


def finish(proc: subprocess.Popen[bytes], log: Path) -> str:
    code, text = ended(proc, log)
    assert code == 0, text
    assert "not restarting" not in text and "Traceback" not in text, text
    return text


def waiting_line(server: str, port: int, n: int, delay: str) -> str:
    return (
        f"worker could not reach {server} at 127.0.0.1:{port} (exit code 2): waiting for it, "
        f"retrying: restart {n}/30 in {delay} s (the delay doubles while it cannot be reached, "
        f"up to 30 s)"
    )


@pytest.mark.parametrize(
    ("side", "workers"),
    [("--output", "1"), ("--input", "1"), ("--output", "2")],
    ids=["sink", "source", "sink-2-workers"],
)
def test_a_supervised_job_waits_for_postgres_down_at_its_start(
    own_postgres: Postgres, tmp_path: Path, side: str, workers: str
) -> None:
    """The database is stopped before the job starts and started a few restarts later: the
    job runs to its end (it gave up at the first worker's exit 2), every output once."""
    pg = own_postgres
    uri = f"{pg.dsn}?table=t&connect_timeout=2"
    if side == "--input":
        pg.execute("CREATE TABLE t (id bigserial PRIMARY KEY, key text, i int)")
        for r in inputs():
            pg.execute("INSERT INTO t (key, i) VALUES (%s, %s)", (r["key"], r["i"]))
        io = ["--input", uri, "--output", str(tmp_path / "out.jsonl")]
    else:
        io = ["--input", write_inputs(tmp_path / "in.jsonl"), "--output", uri]
    pg.down()
    rest = free_port()
    proc, log = start_supervised(tmp_path, *io, "--workers", workers, "--rest-port", str(rest))
    try:
        wait_for_line(proc, log, waiting_line("PostgreSQL", pg.port, 2, "0.4"))
        job = get(rest, "/v1/job")  # what the status says while it waits
        assert job["state"] == "restarting" and job["restarts"] >= 2, job
        assert job["last_exit"].endswith(
            f": exit code 2: cannot reach PostgreSQL at 127.0.0.1:{pg.port}"
        ), job
        pg.up()
    finally:
        text = finish(proc, log)
    assert waiting_line("PostgreSQL", pg.port, 1, "0.2") in text
    assert f"cannot reach PostgreSQL at 127.0.0.1:{pg.port}: connection failed" in text
    assert "with --supervise" not in text  # a supervised worker is not told to be one
    if side == "--input":
        out = (tmp_path / "out.jsonl").read_text().splitlines()
        assert_each_output_once([json.loads(x) for x in out])
    else:
        rows = pg.execute("SELECT record FROM t")
        assert_each_output_once([r[0] for r in rows])


@pytest.mark.slow
def test_a_supervised_job_waits_for_nats_down_at_its_start(own_nats: Nats, tmp_path: Path) -> None:
    nats = own_nats
    nats.add_stream("OUT", ["out.done"])
    nats.down()
    io = ["--input", write_inputs(tmp_path / "in.jsonl"),
          "--output", f"{nats.url}?stream=OUT&subject=out.done"]  # fmt: skip
    proc, log = start_supervised(tmp_path, *io)
    try:
        wait_for_line(proc, log, waiting_line("NATS", nats.port, 2, "0.4"))
        nats.up()
    finally:
        finish(proc, log)
    outputs = [json.loads(data) for data, _ in nats.messages("OUT")]
    assert_each_output_once(outputs)


@pytest.mark.parametrize("side", ["--input", "--output"])
@pytest.mark.parametrize("kind", ["postgresql", "nats"])
def test_unsupervised_it_is_one_line_exit_2_that_names_supervise(
    tmp_path: Path, side: str, kind: str
) -> None:
    pytest.importorskip("psycopg" if kind == "postgresql" else "nats")
    port = free_port()  # nothing listens there
    if kind == "postgresql":
        uri = f"postgresql://app:pw@127.0.0.1:{port}/db?table=t"
        server = "PostgreSQL"
    else:
        uri = f"nats://127.0.0.1:{port}?stream=S&subject=s.x"
        server = "NATS"
    io = (
        ["--input", uri, "--output", str(tmp_path / "out.jsonl")]
        if side == "--input"
        else ["--input", write_inputs(tmp_path / "in.jsonl"), "--output", uri]
    )
    proc = subprocess.run(
        [*RATCHET, "run", AGENT, *io, "--state", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=BOUND,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "pw@" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("ratchet: error:")]
    assert line.startswith(f"ratchet: error: {side} ")
    assert f": cannot reach {server} at 127.0.0.1:{port}: " in line
    assert line.endswith(
        f"; with --supervise, ratchet waits for {server} at 127.0.0.1:{port} and retries"
    )


def test_what_a_postgres_server_answers_no_stays_a_config_error(
    postgres: Postgres, tmp_path: Path
) -> None:
    """Told apart by libpq's PQping, not by the words of the message (which the server's
    locale may translate): a server that takes connections refused these."""
    job = JobIdentity("job1", tmp_path)
    base = postgres.dsn.rsplit("/", 1)[0]
    for uri in (
        f"{postgres.dsn.replace('postgres@', 'nosuchrole@')}?table=t",
        f"{base}/nosuchdb?table=t",
    ):
        with pytest.raises(ConfigError) as err:
            sink_for(uri, append=False).open(job)
        assert not isinstance(err.value, ServerUnreachableError), err.value
        assert "cannot connect to PostgreSQL: connection failed:" in str(err.value)
        assert "does not exist" in str(err.value)
        assert "--supervise" not in str(err.value)
    src = source_for(f"{postgres.dsn}?table=nosuchtable", key="key", follow=False)
    with pytest.raises(ConfigError, match="nosuchtable\\) does not exist") as err:
        src.open(job, checkpoint_interval=0.2)
    assert not isinstance(err.value, ServerUnreachableError)


def test_what_cannot_reach_a_postgres_server_is_unreachable(tmp_path: Path) -> None:
    pytest.importorskip("psycopg")
    job = JobIdentity("job1", tmp_path)
    port = free_port()
    for uri, address in (
        (f"postgresql://app@127.0.0.1:{port}/db?table=t", f"127.0.0.1:{port}"),
        ("postgresql://app@no-such-host.invalid:5432/db?table=t", "no-such-host.invalid:5432"),
    ):
        with pytest.raises(ServerUnreachableError) as err:
            sink_for(uri, append=False).open(job)
        assert (err.value.server, err.value.address) == ("PostgreSQL", address)


@pytest.mark.slow
def test_what_a_nats_server_answers_no_stays_a_config_error(tmp_path: Path) -> None:
    server = Nats(nats_binary(), "--user", "u", "--pass", "p", credentials="u:p")
    try:
        server.add_stream("OUT", ["out.done"])
        job = JobIdentity("job1", tmp_path)
        bad = server.url.replace("nats://", "nats://u:wrong@")
        with pytest.raises(ConfigError) as err:
            sink_for(f"{bad}?stream=OUT&subject=out.done", append=False).open(job)
        assert not isinstance(err.value, ServerUnreachableError), err.value
        assert f"NATS at 127.0.0.1:{server.port} refused the connection: " in str(err.value)
        assert "Authorization Violation" in str(err.value)
        good = server.url.replace("nats://", "nats://u:p@")
        sink = sink_for(f"{good}?stream=OUT&subject=out.done", append=False)
        sink.open(job)  # the control: the right password
        sink.close()
        with pytest.raises(ServerUnreachableError):
            sink_for(f"nats://127.0.0.1:{free_port()}?stream=OUT&subject=out.done",
                     append=False).open(job)  # fmt: skip
    finally:
        server.stop()


@pytest.mark.parametrize("case", ["no such role", "no such table"])
def test_a_server_that_answers_no_still_stops_the_supervisor(
    postgres: Postgres, tmp_path: Path, case: str
) -> None:
    if case == "no such role":
        uri = f"{postgres.dsn.replace('postgres@', 'nosuchrole@')}?table=t"
        io = ["--input", write_inputs(tmp_path / "in.jsonl"), "--output", uri]
        said = 'role "nosuchrole" does not exist'
    else:
        io = ["--input", f"{postgres.dsn}?table=nosuchtable",
              "--output", str(tmp_path / "out.jsonl")]  # fmt: skip
        said = "(table nosuchtable) does not exist"
    proc, log = start_supervised(tmp_path, *io)
    code, text = ended(proc, log)
    assert code == 2, text
    assert said in text, text
    assert "worker failed (exit code 2); not restarting" in text, text
    assert "restart 1/" not in text and "waiting for it" not in text, text


def test_a_connection_lost_during_the_checks_at_start_is_unreachable(
    postgres: Postgres, tmp_path: Path
) -> None:
    """The server ends the session while the sink checks its table (a shutdown, a restart):
    the server's going away, not its answer to the checks, so the job waits for it."""
    import threading

    import psycopg

    postgres.execute(
        "CREATE TABLE lost_checks (id text PRIMARY KEY, job text NOT NULL, key text, "
        "seq bigint, task text, record jsonb NOT NULL)"
    )

    def end_the_waiting_session() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ended = postgres.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND query LIKE '%lost_checks%'"
            )
            if ended:
                return
            time.sleep(0.05)

    with psycopg.connect(postgres.dsn) as lock:
        lock.execute("LOCK TABLE lost_checks IN ACCESS EXCLUSIVE MODE")
        ender = threading.Thread(target=end_the_waiting_session)
        ender.start()
        try:
            with pytest.raises(ServerUnreachableError) as err:
                sink_for(f"{postgres.dsn}?table=lost_checks&connect_timeout=20",
                         append=False).open(JobIdentity("job1", tmp_path))  # fmt: skip
        finally:
            ender.join()
    assert (
        f"(table lost_checks): lost the connection to PostgreSQL at 127.0.0.1:{postgres.port} "
        f"while preparing the output table: terminating connection due to administrator "
        f"command" in str(err.value)
    )


def test_a_server_that_stays_unreachable_uses_up_the_restarts(tmp_path: Path) -> None:
    pytest.importorskip("psycopg")
    port = free_port()  # nothing listens there, for good
    io = ["--input", write_inputs(tmp_path / "in.jsonl"),
          "--output", f"postgresql://app@127.0.0.1:{port}/db?table=t"]  # fmt: skip
    argv = [*RATCHET, "run", AGENT, *io, "--state", str(tmp_path / "state"), "--supervise",
            "--restart-delay", "0", "--restart-attempts", "2"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=BOUND)
    assert proc.returncode == 1, proc.stderr
    address = f"PostgreSQL at 127.0.0.1:{port}"
    assert (
        f"ratchet: worker could not reach {address} (exit code 2): waiting for it, retrying: "
        f"restart 2/2 in 0 s (the delay doubles while it cannot be reached, up to 30 s)\n"
    ) in proc.stderr
    assert proc.stderr.endswith(
        f"ratchet: worker could not reach {address} (exit code 2) and the 2 restart attempts "
        f"are used up; the state directory keeps the last checkpoint\n"
    ), proc.stderr
    assert "not restarting" not in proc.stderr


def test_the_delay_doubles_up_to_30_s_or_the_restart_delay() -> None:
    assert [unreachable_delay(1.0, n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert [unreachable_delay(0.2, n) for n in (1, 2, 3)] == [0.2, 0.4, 0.8]
    assert unreachable_delay(0.0, 5) == 0.0  # --restart-delay 0: at once, every time
    assert unreachable_delay(45.0, 3) == 45.0  # a longer --restart-delay is its own cap
    assert unreachable_delay(1.0, 10_000) == 30.0  # no overflow after many attempts
