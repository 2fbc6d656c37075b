"""A connector's server that goes away after the job started (shut down, killed, restarted),
against one that answers no.

The first is `ServerUnreachableError`, as at start: `ratchet run --supervise` restarts the
worker, waits for the server with a doubling delay, and the job resumes from its last
checkpoint and runs to its end with every output once. Unsupervised it is one line and exit 2
that names --supervise. A server that answers but refuses the connection's settings
(`sslmode=require` of one without SSL) is a plain `ConfigError`: no outage to wait out.

The job is held mid-run by a gate (relay_agent's `until`): one input waits for a file, and
`--max-buffered-inputs 1` keeps the source from reading on meanwhile, so the server goes
away before the source's next read, whatever the machine's speed.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from connector_servers import AGENT, RATCHET, Nats, Postgres, free_port
from test_connector_unreachable_at_start import (
    BOUND,
    KEYS,
    N,
    assert_each_output_once,
    ended,
    finish,
    inputs,
    own_nats,  # noqa: F401 - a fixture
    own_postgres,  # noqa: F401 - a fixture
    start_supervised,
    wait_for_line,
    waiting_line,
)

from ratchet._errors import ConfigError, ServerUnreachableError
from ratchet.connectors import sink_for, source_for
from ratchet.runtime._io import JobIdentity

HELD = KEYS + 1  # the input that waits for the gate: its key's second


def gated_inputs(gate: Path) -> list[dict[str, Any]]:
    return [dict(r, until=str(gate)) if r["i"] == HELD else r for r in inputs()]


def table_of_inputs(pg: Postgres, gate: Path) -> str:
    """A source table holding the inputs, one of them held by `gate`; its --input URI."""
    pg.execute("CREATE TABLE t (id bigserial PRIMARY KEY, key text, i int, until text)")
    for r in gated_inputs(gate):
        pg.execute(
            "INSERT INTO t (key, i, until) VALUES (%s, %s, %s)", (r["key"], r["i"], r.get("until"))
        )
    return f"{pg.dsn}?table=t&connect_timeout=2"


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def held_mid_run(proc: subprocess.Popen[bytes] | None, out: Path, log: Path | None) -> None:
    """Until the job wrote an output (so it read its inputs and runs): it is held at the gate."""
    deadline = time.monotonic() + BOUND / 2
    while not lines(out):
        if proc is not None:
            assert proc.poll() is None, log.read_text() if log else proc.returncode
        assert time.monotonic() < deadline, log.read_text() if log else "no output"
        time.sleep(0.05)


def test_a_supervised_postgres_source_resumes_after_its_server_went_away_mid_run(
    own_postgres: Postgres,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    """Without --follow a read that fails ends the job: the server's absence is one the
    supervisor waits out (it gave up on the job for good: a ConfigError, 'run again'), and
    the job resumes from its checkpoint, every output once."""
    pg = own_postgres
    gate = tmp_path / "gate"
    out = tmp_path / "out.jsonl"
    io = ["--input", table_of_inputs(pg, gate), "--output", str(out)]
    proc, log = start_supervised(tmp_path, *io, "--max-buffered-inputs", "1")
    try:
        held_mid_run(proc, out, log)
        pg.down()
        gate.touch()  # the job runs on, and reads again from a server that is gone
        wait_for_line(proc, log, waiting_line("PostgreSQL", pg.port, 1, "0.2"))
        pg.up()
    finally:
        text = finish(proc, log)
    assert f"lost PostgreSQL at 127.0.0.1:{pg.port} while reading: " in text, text
    assert "run again to resume" not in text, text
    assert_each_output_once(lines(out))
    assert len(lines(out)) == N


def test_unsupervised_a_postgres_source_that_lost_its_server_is_one_line_exit_2(
    own_postgres: Postgres,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    pg = own_postgres
    gate = tmp_path / "gate"
    out = tmp_path / "out.jsonl"
    uri = table_of_inputs(pg, gate)
    argv = [*RATCHET, "run", AGENT, "--input", uri, "--output", str(out),
            "--state", str(tmp_path / "state"), "--max-buffered-inputs", "1"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        held_mid_run(proc, out, None)
        pg.down()
        gate.touch()
        _, err = proc.communicate(timeout=BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.decode()
    assert proc.returncode == 2, stderr
    assert "Traceback" not in stderr, stderr
    (line,) = [x for x in stderr.splitlines() if x.startswith("ratchet: error:")]
    assert line.startswith(f"ratchet: error: --input {uri} (table t): lost PostgreSQL at "), line
    assert "the next start resumes from the last checkpoint" in line, line
    assert line.endswith(
        f"; with --supervise, ratchet waits for PostgreSQL at 127.0.0.1:{pg.port} and retries"
    ), line
    pg.up()  # and the next start resumes: every output once
    again = subprocess.run(argv, capture_output=True, text=True, timeout=BOUND)
    assert again.returncode == 0, again.stderr
    assert_each_output_once(lines(out))


@pytest.mark.slow
def test_a_supervised_nats_job_resumes_after_its_server_went_away_mid_run(
    own_nats: Nats,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    """Source and sink on one server, stopped while the job runs: the client reconnects for
    reconnect_for seconds, then the source ends the job with ServerUnreachableError (it
    reconnected forever: a server that never came back left a job that ran on, reading
    nothing, for good); the supervisor waits for the server, and the job resumes: every
    output once (the redelivered inputs recognised, the outputs republished de-duplicated)."""
    nats = own_nats
    nats.add_stream("IN", ["in.x"])
    nats.add_stream("OUT", ["out.x"])
    gate = tmp_path / "gate"
    nats.publish("in.x", [json.dumps(r).encode() for r in gated_inputs(gate)])
    io = ["--input", f"{nats.url}?stream=IN&subject=in.x&batch=2&ack_wait=2&reconnect_for=1",
          "--output", f"{nats.url}?stream=OUT&subject=out.x"]  # fmt: skip
    proc, log = start_supervised(tmp_path, *io, "--max-buffered-inputs", "1")
    try:
        deadline = time.monotonic() + BOUND / 2
        while nats.count("OUT") == 0:  # it runs, and is held at the gate
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        nats.down()
        gate.touch()
        wait_for_line(proc, log, waiting_line("NATS", nats.port, 1, "0.2"))
        nats.up()
    finally:
        text = finish(proc, log)
    assert f"lost NATS at 127.0.0.1:{nats.port}: not back within 1 s (reconnect_for)" in text
    outputs = [json.loads(data) for data, _ in nats.messages("OUT")]
    assert_each_output_once(outputs)
    assert len(outputs) == N


def test_sslmode_require_of_a_server_without_ssl_is_a_config_error_not_an_outage(
    postgres: Postgres, tmp_path: Path
) -> None:
    """The server answers sslmode=require's first message with no, which libpq's PQping
    reports as no answer at all: the job was restarted until its attempts ran out."""
    job = JobIdentity("job1", tmp_path)
    address = f"127.0.0.1:{postgres.port}"
    for settings, named in (
        ("sslmode=require", "sslmode=require"),
        ("sslmode=verify-full", "sslmode=verify-full"),
        # sslrootcert=system implies verify-full (libpq 16 on); with it, a relaxed ping that
        # kept the key was refused by libpq itself, and the server counted as gone.
        ("sslmode=verify-full&sslrootcert=system", "sslmode=verify-full, sslrootcert=system"),
        ("sslrootcert=system", "sslrootcert=system"),
    ):
        uri = f"{postgres.dsn}?table=ssl_t&{settings}"
        for side in ("--output", "--input"):
            with pytest.raises(ConfigError) as err:
                _open(side, uri, job)
            assert not isinstance(err.value, ServerUnreachableError), err.value
            said = str(err.value)
            assert f"PostgreSQL at {address} answers, but refused the connection with " in said
            assert f"{named}: " in said, said
    # The control: a server that is gone is still unreachable with sslmode=require.
    gone = f"postgresql://app@127.0.0.1:{free_port()}/db?table=t&sslmode=require"
    with pytest.raises(ServerUnreachableError):
        sink_for(gone, append=False).open(job)


def _open(side: str, uri: str, job: JobIdentity) -> None:
    if side == "--output":
        sink_for(uri, append=False).open(job)
    else:
        source_for(uri, key="key", follow=False).open(job, checkpoint_interval=0.2)


def test_a_supervisor_gives_up_at_once_on_sslmode_require_of_a_server_without_ssl(
    postgres: Postgres, tmp_path: Path
) -> None:
    uri = f"{postgres.dsn}?table=ssl_t&sslmode=require"
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in inputs()))
    proc, log = start_supervised(tmp_path, "--input", str(src), "--output", uri)
    code, text = ended(proc, log)
    assert code == 2, text
    assert "answers, but refused the connection with sslmode=require: " in text, text
    assert "worker failed (exit code 2); not restarting" in text, text
    assert "waiting for it" not in text and "with --supervise" not in text, text


def test_a_nats_consumer_deleted_mid_run_is_one_clear_refusal(
    nats_server: Nats, tmp_path: Path
) -> None:
    """A JetStream API error after the start is the server's answer: a ConfigError naming
    the consumer and the error (it was retried every half second, for good)."""
    from test_connector_nats import next_values, source, streams

    s = streams(nats_server)
    nats_server.publish(f"in.{s}", [json.dumps({"key": "a", "i": i}).encode() for i in range(3)])
    src = source(nats_server, s, tmp_path, durable="gone")
    try:
        src.restore({})
        assert [v["i"] for v in next_values(src, 3)] == [0, 1, 2]

        async def delete(js: Any) -> None:
            await js.delete_consumer(f"IN{s}", "gone")

        nats_server.run(delete)
        with pytest.raises(ConfigError) as err:
            _until_it_raises(src)
    finally:
        src.close()
    assert not isinstance(err.value, ServerUnreachableError)
    assert (
        f"JetStream refused reading the state of the durable consumer 'gone' of stream IN{s}: "
        f"consumer not found (error 10014)" in str(err.value)
    ), err.value


def _until_it_raises(src: Any) -> None:
    deadline = time.monotonic() + BOUND / 2
    while src.next_record() is None:
        assert time.monotonic() < deadline, "no error"
        time.sleep(0.05)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "-inf", "soon"])
def test_reconnect_for_is_a_number_of_seconds(value: str) -> None:
    pytest.importorskip("nats")
    with pytest.raises(ConfigError, match="reconnect_for"):
        source_for(f"nats://127.0.0.1:4222?stream=S&subject=s.x&reconnect_for={value}",
                   key="key", follow=False)  # fmt: skip


@pytest.mark.parametrize("given", ["&reconnect_for=inf", ""], ids=["inf", "the-default"])
def test_without_reconnect_for_the_source_waits_as_long_as_it_takes(given: str) -> None:
    """inf, and the default: the source never gives up on a lost server (the client
    reconnects for good), as a followed PostgreSQL source; an unsupervised job that rode out
    any outage before reconnect_for existed still does."""
    pytest.importorskip("nats")
    src = source_for(f"nats://127.0.0.1:4222?stream=S&subject=s.x{given}",
                     key="key", follow=True)  # fmt: skip
    src._outage.since = time.monotonic() - 1e9  # lost a very long time ago
    src._check_outage()  # does not raise
    src._outage.limit = 1.0  # the same outage with reconnect_for=1: the job ends
    with pytest.raises(ServerUnreachableError, match=r"not back within 1 s \(reconnect_for\)"):
        src._check_outage()
