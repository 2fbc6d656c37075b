"""The conformance suite every connector runs, against real servers and a real `ratchet run`.

Each case pairs a source with a sink (the JSON Lines pair is the reference): N inputs go in
upstream, the job runs as a subprocess, and the outputs are read back from the real sink.
The SIGKILL test kills the job k times at seeded points (after a seeded number of outputs
reached the sink, plus a seeded delay) and restarts it; at the end every input has exactly
one output in the sink, and every key's outputs carry the counts 1..m (state exactly once).
Set RATCHET_KILL_SEED to replay a failing seed (it is printed).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from connector_servers import AGENT, RATCHET, Nats, Postgres, free_port, post

KEYS = 7
SLEEP = 0.01  # seconds per input: slow enough for a kill to land mid-stream


def inputs(n: int) -> list[dict[str, Any]]:
    return [{"key": f"k{i % KEYS}", "i": i, "sleep": SLEEP} for i in range(n)]


class Case:
    """One connector pair: where inputs go in, what --input/--output are, what the sink holds."""

    name = ""
    follow = False  # the job runs with --follow (and is stopped with SIGTERM at the end)

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def setup(self, n: int) -> None:
        """Put the N inputs upstream (a case that feeds while the job runs does it in feed)."""

    def feed(self, n: int) -> Feeder | None:
        return None

    def input_arg(self) -> str:
        raise NotImplementedError

    def output_arg(self) -> str:
        raise NotImplementedError

    def outputs(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def count(self) -> int:
        return len(self.outputs())

    def extra(self) -> list[str]:
        return ["--follow"] if self.follow else []


class JsonlCase(Case):
    name = "jsonl"

    def setup(self, n: int) -> None:
        path = self.tmp / "in.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in inputs(n)))

    def input_arg(self) -> str:
        return str(self.tmp / "in.jsonl")

    def output_arg(self) -> str:
        return str(self.tmp / "out.jsonl")

    def outputs(self) -> list[dict[str, Any]]:
        out = self.tmp / "out.jsonl"
        if not out.exists():
            return []
        return [json.loads(x) for x in out.read_text().splitlines() if x.endswith("}")]


class Feeder(threading.Thread):
    """POSTs the inputs in batches, each with its own Idempotency-Key, retrying every batch
    until it is answered 202 (the job may be dead, starting or killed mid-request)."""

    def __init__(self, url: str, items: list[dict[str, Any]], batch: int = 10) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.items = items
        self.batch = batch
        self.admitted = 0
        self.repeats = 0
        self.stop = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for b in range(0, len(self.items), self.batch):
                body = json.dumps(self.items[b : b + self.batch]).encode()
                while not self.stop:
                    answer = post(self.url, body, {"Idempotency-Key": f"batch-{b}"})
                    if answer is not None and answer[0] == 202:
                        self.admitted += answer[1]["accepted"]
                        self.repeats += bool(answer[1]["duplicate"])
                        break
                    time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


class HttpCase(JsonlCase):
    name = "http"
    follow = True

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.url = f"http://127.0.0.1:{free_port()}"

    def setup(self, n: int) -> None:
        pass

    def feed(self, n: int) -> Feeder | None:
        feeder = Feeder(self.url, inputs(n))
        feeder.start()
        return feeder

    def input_arg(self) -> str:
        return self.url

    def extra(self) -> list[str]:
        return []  # an ingestion endpoint always follows


class PostgresCase(Case):
    name = "postgres"
    follow = True
    counter = 0

    def __init__(self, tmp: Path, server: Postgres) -> None:
        super().__init__(tmp)
        self.server = server
        PostgresCase.counter += 1
        self.table = f"t{os.getpid()}_{PostgresCase.counter}"

    def setup(self, n: int) -> None:
        self.server.execute(
            f"CREATE TABLE in_{self.table} (id bigserial PRIMARY KEY, key text, i int, sleep float)"
        )
        self.server.execute(
            f"INSERT INTO in_{self.table} (key, i, sleep) SELECT 'k' || (g % {KEYS}), g, {SLEEP} "
            f"FROM generate_series(0, {n - 1}) AS g"
        )

    def input_arg(self) -> str:
        return f"{self.server.dsn}?table=in_{self.table}&poll=0.05"

    def output_arg(self) -> str:
        return f"{self.server.dsn}?table=out_{self.table}"

    def outputs(self) -> list[dict[str, Any]]:
        try:
            rows = self.server.execute(f"SELECT record FROM out_{self.table}")
        except Exception:  # noqa: BLE001 - not created yet
            return []
        return [r[0] for r in rows]

    def count(self) -> int:
        try:
            return int(self.server.execute(f"SELECT count(*) FROM out_{self.table}")[0][0])
        except Exception:  # noqa: BLE001 - not created yet
            return 0


class NatsCase(Case):
    name = "nats"
    follow = True
    counter = 0

    def __init__(self, tmp: Path, server: Nats) -> None:
        super().__init__(tmp)
        self.server = server
        NatsCase.counter += 1
        self.s = f"S{os.getpid()}x{NatsCase.counter}"

    def setup(self, n: int) -> None:
        self.server.add_stream(f"IN{self.s}", [f"in.{self.s}"])
        self.server.add_stream(f"OUT{self.s}", [f"out.{self.s}"])
        self.server.publish(f"in.{self.s}", [json.dumps(r).encode() for r in inputs(n)])

    def input_arg(self) -> str:
        return f"{self.server.url}?stream=IN{self.s}&subject=in.{self.s}&ack_wait=2"

    def output_arg(self) -> str:
        return f"{self.server.url}?stream=OUT{self.s}&subject=out.{self.s}"

    def outputs(self) -> list[dict[str, Any]]:
        return [json.loads(data) for data, _h in self.server.messages(f"OUT{self.s}")]

    def count(self) -> int:
        return self.server.count(f"OUT{self.s}")


CASES = ["jsonl", "http", "postgres", "nats"]


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Case]:
    name = request.param
    if name == "jsonl":
        yield JsonlCase(tmp_path)
    elif name == "http":
        yield HttpCase(tmp_path)
    elif name == "postgres":
        yield PostgresCase(tmp_path, request.getfixturevalue("postgres"))
    else:
        yield NatsCase(tmp_path, request.getfixturevalue("nats_server"))


def start(case: Case, follow: bool | None = None) -> subprocess.Popen[bytes]:
    extra = case.extra() if follow is None or follow else []
    with open(case.tmp / "stderr.log", "ab") as err:
        return subprocess.Popen(
            [*RATCHET, "run", AGENT, "--input", case.input_arg(), "--output", case.output_arg(),
             "--state", str(case.tmp / "state"), "--checkpoint-interval", "20", *extra],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip


def wait_for(case: Case, proc: subprocess.Popen[bytes], n: int, what: str) -> None:
    """Until the sink holds `n` outputs (the process must stay alive meanwhile)."""
    deadline = time.monotonic() + 120
    while case.count() < n:
        assert proc.poll() is None, f"{what}: the job exited {proc.returncode}: {log(case)}"
        assert time.monotonic() < deadline, f"{what}: {case.count()} of {n} outputs: {log(case)}"
        time.sleep(0.01)


def log(case: Case) -> str:
    path = case.tmp / "stderr.log"
    return path.read_text()[-3000:] if path.exists() else ""


def stop(case: Case, proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


def check_exactly_once(case: Case, n: int, where: str) -> None:
    outs = case.outputs()
    ids = [o["id"] for o in outs]
    assert len(ids) == len(set(ids)), f"{where}: an output id is in the sink twice"
    seen = sorted(o["output"]["i"] for o in outs)
    assert seen == list(range(n)), f"{where}: inputs without or with several outputs"
    per_key: dict[str, list[int]] = {}
    for o in outs:
        per_key.setdefault(o["key"], []).append(o["output"]["n"])
    for key, counts in per_key.items():
        assert sorted(counts) == list(range(1, len(counts) + 1)), f"{where}: key {key} {counts}"


def test_every_input_once_and_a_second_run_adds_nothing(case: Case) -> None:
    n = 120
    case.setup(n)
    feeder = case.feed(n)
    proc = start(case, follow=False)
    if isinstance(case, HttpCase):
        wait_health(case, proc)
        wait_for(case, proc, n, case.name)
        assert stop(case, proc) == 0, log(case)
    else:  # the job ends by itself at the end of its input
        assert proc.wait(timeout=120) == 0, log(case)
    if feeder is not None:
        feeder.join()
        assert feeder.error is None and feeder.admitted == n
    check_exactly_once(case, n, case.name)
    again = start(case, follow=False)
    if isinstance(case, HttpCase):
        wait_health(case, again)
        assert stop(case, again) == 0, log(case)
    else:
        assert again.wait(timeout=120) == 0, log(case)
    assert case.count() == n
    check_exactly_once(case, n, case.name)


def wait_health(case: Case, proc: subprocess.Popen[bytes]) -> None:
    assert isinstance(case, HttpCase)
    while True:
        assert proc.poll() is None, log(case)
        try:
            with urllib.request.urlopen(case.url + "/v1/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.02)


@pytest.mark.kill
def test_sigkill_at_seeded_points_every_output_exactly_once(case: Case) -> None:
    seed = int(os.environ.get("RATCHET_KILL_SEED") or random.randrange(2**32))
    print(f"{case.name}: kill seed {seed} (replay with RATCHET_KILL_SEED={seed})")
    rng = random.Random(seed)
    n, kills = 300, 5
    where = f"{case.name} with kill seed {seed}"
    case.setup(n)
    feeder = case.feed(n)
    at_kill = []
    try:
        for _ in range(kills):
            proc = start(case)
            target = min(n - 1, case.count() + rng.randint(5, 60))
            wait_for(case, proc, target, where)
            time.sleep(rng.uniform(0, 0.03))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            at_kill.append(case.count())
        # The last run goes to the end of the input by itself (an ingestion endpoint has no
        # end: it is stopped once ready and every output is there).
        proc = start(case, follow=False)
        if isinstance(case, HttpCase):
            wait_health(case, proc)
            wait_for(case, proc, n, where)
            assert stop(case, proc) == 0, f"{where}: {log(case)}"
        else:
            assert proc.wait(timeout=120) == 0, f"{where}: {log(case)}"
    finally:
        if feeder is not None:
            feeder.stop = True
            feeder.join(timeout=30)
    if feeder is not None:
        assert feeder.error is None, where
        assert feeder.admitted == n, f"{where}: {feeder.admitted} of {n} inputs admitted"
    check_exactly_once(case, n, where)
    print(f"{where}: outputs in the sink at each kill: {at_kill}")
    assert at_kill[0] < n, f"{where}: the job was done before the first kill"
