"""A sink's server that goes away just before a bounded job's input ends, and comes back.

The job waits for it, as it does mid-run, and ends with every output once and exit 0. It gave
up after five quick tries at the end (about 3 s) with `SinkError`, exit 1: a NATS server
restarting or a database failing over while a batch job wrote its last outputs failed the
job. A real `ratchet run`, unsupervised, with one process and with two workers (whose
coordinator writes the sink and tells each worker that its server is away).

The job is held by a gate on its last input (relay_agent's `until`), so the server goes away
after the other outputs are written and before the last release, whatever the machine's
speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from connector_servers import AGENT, RATCHET, Nats, Postgres
from test_connector_unreachable_at_start import (
    BOUND,
    N,
    assert_each_output_once,
    inputs,
    own_nats,  # noqa: F401 - a fixture
    own_postgres,  # noqa: F401 - a fixture
)

WAITING = "the input is done, but {server} at 127.0.0.1:{port} is away"


def write_gated_inputs(path: Path, gate: Path) -> None:
    rows = [dict(r, until=str(gate)) if r["i"] == N - 1 else r for r in inputs()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def wait_for(proc: subprocess.Popen[bytes], log: Path, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND / 2
    while not done():
        assert proc.poll() is None, f"the job ended ({proc.returncode}):\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} in:\n{log.read_text()}"
        time.sleep(0.05)


def run_held(tmp: Path, output: str, workers: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    gate = tmp / "gate"
    write_gated_inputs(tmp / "in.jsonl", gate)
    log = tmp / "job.log"
    argv = [*RATCHET, "run", AGENT, "--input", str(tmp / "in.jsonl"), "--output", output,
            "--state", str(tmp / "state"), "--workers", workers]  # fmt: skip
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=fh, start_new_session=True)
    return proc, log, gate


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the job and its workers
        proc.wait()


def finish(proc: subprocess.Popen[bytes], log: Path) -> str:
    try:
        code = proc.wait(timeout=BOUND)
    finally:
        kill(proc)
    text = log.read_text()
    assert code == 0, text
    assert "Traceback" not in text and "SinkError" not in text, text
    return text


def waiting_for_nats(nats: Nats, tmp: Path, workers: str) -> tuple[subprocess.Popen[bytes], Path]:
    """A job writing to a stream of `nats`, whose server went away before its last release:
    it waits for the server (it said so), its last input done."""
    nats.add_stream("OUT", ["out.x"])
    proc, log, gate = run_held(tmp, f"{nats.url}?stream=OUT&subject=out.x", workers)
    try:
        wait_for(proc, log, lambda: nats.count("OUT") >= N - 1, f"{N - 1} outputs")
        nats.down()
        # The client saw it go: a release now fails at once (instead of a publish that waits
        # for its acknowledgement).
        wait_for(proc, log, lambda: "disconnected from NATS" in log.read_text(), "disconnect")
        gate.touch()
        waiting = WAITING.format(server="NATS", port=nats.port)
        wait_for(proc, log, lambda: waiting in log.read_text(), repr(waiting))
    except BaseException:
        kill(proc)
        raise
    return proc, log


@pytest.mark.slow  # about 4 s; the SIGTERM test below waits for NATS the same way, in make test
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_nats_sink_away_at_the_end_of_the_input_is_waited_for(
    own_nats: Nats,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    workers: str,
) -> None:
    nats = own_nats
    proc, log = waiting_for_nats(nats, tmp_path, workers)
    try:
        nats.up()
    except BaseException:
        kill(proc)
        raise
    text = finish(proc, log)
    assert "the sink took the outputs it was waiting for" in text, text
    outputs = [json.loads(data) for data, _ in nats.messages("OUT")]
    assert_each_output_once(outputs)
    assert len(outputs) == N


@pytest.mark.parametrize("workers", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_a_postgres_sink_away_at_the_end_of_the_input_is_waited_for(
    own_postgres: Postgres,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    workers: str,
) -> None:
    pg = own_postgres
    uri = f"{pg.dsn}?table=outs&connect_timeout=2"
    proc, log, gate = run_held(tmp_path, uri, workers)

    def written() -> list[Any]:
        import psycopg

        try:
            return [r for (r,) in pg.execute("SELECT record FROM outs")]
        except psycopg.errors.UndefinedTable:  # the job creates it when it opens its sink
            return []

    try:
        wait_for(proc, log, lambda: len(written()) >= N - 1, f"{N - 1} outputs")
        pg.down()
        gate.touch()
        waiting = WAITING.format(server="PostgreSQL", port=pg.port)
        wait_for(proc, log, lambda: waiting in log.read_text(), repr(waiting))
        pg.up()
    except BaseException:
        kill(proc)
        raise
    text = finish(proc, log)
    assert "the sink took the outputs it was waiting for" in text, text
    outputs = written()
    assert_each_output_once(outputs)
    assert len(outputs) == N


def test_a_sigterm_while_it_waits_keeps_the_outputs_for_the_next_run(
    own_nats: Nats,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    """A batch job the operator stops while it waits for the sink's server: it ends at once,
    the last output kept in the state; the next run, with the server back, writes it once."""
    nats = own_nats
    proc, log = waiting_for_nats(nats, tmp_path, "1")
    try:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=BOUND)
    finally:
        kill(proc)
    text = log.read_text()
    assert code == 0, text
    assert "Traceback" not in text and "SinkError" not in text, text
    assert "1 output(s) the sink refused (ServerUnreachableError: " in text, text
    nats.up()
    again = subprocess.run(
        [*RATCHET, "run", AGENT, "--input", str(tmp_path / "in.jsonl"), "--output",
         f"{nats.url}?stream=OUT&subject=out.x", "--state", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=BOUND,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    outputs = [json.loads(data) for data, _ in nats.messages("OUT")]
    assert_each_output_once(outputs)
    assert len(outputs) == N
