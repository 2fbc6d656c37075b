"""Throughput of each connector beside the JSON Lines pair, as ratios (issue 16).

Workload: one action per input that writes per-key memory and emits one output (7 keys).
Every pair runs as a real `ratchet run` subprocess at the default checkpoint interval
(200 ms); a pair's time is from the start of the process until its sink holds all N outputs
(for HTTP, the events are POSTed in batches of 200 from this process meanwhile, so the
figure includes admission into the inbox). PostgreSQL and nats-server are started here, as
the tests start them (Debian packages `postgresql`, `nats-server`); a pair whose server is
missing is skipped.

    .venv/bin/python benchmarks/connectors_bench.py [--n 20000] [--repeat 1]
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "connectors"))
from connector_servers import Nats, Postgres, free_port, pg_bin  # noqa: E402

KEYS = 7
AGENT_SRC = textwrap.dedent(
    """
    from ratchet import Agent, InputEvent, OutputEvent, action

    class OneStep(Agent):
        @action(InputEvent, inline=True)
        def one(self, event, ctx):
            n = ctx.short_term_memory.get("n", 0) + 1
            ctx.short_term_memory.set("n", n)
            ctx.send_event(OutputEvent(output={"i": event.input["i"], "n": n}))
    """
)


def items(n: int) -> list[dict[str, Any]]:
    return [{"key": f"k{i % KEYS}", "i": i} for i in range(n)]


class Pair:
    """One --input/--output pair: how its inputs go in, how its sink is counted."""

    def __init__(self, name: str, src: str, out: str, count: Callable[[], int]) -> None:
        self.name, self.src, self.out, self.count = name, src, out, count
        self.feed: Callable[[], None] | None = None
        self.follow = False


def post_all(url: str, n: int) -> None:
    host, port = url.removeprefix("http://").split(":")
    rows = items(n)
    conn: http.client.HTTPConnection | None = None
    for b in range(0, n, 200):
        body = json.dumps(rows[b : b + 200]).encode()
        while True:
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(host, int(port), timeout=30)
                conn.request("POST", "/v1/events", body, {"Content-Type": "application/json",
                                                           "Idempotency-Key": f"b{b}"})  # fmt: skip
                resp = conn.getresponse()
                resp.read()
                if resp.status == 202:
                    break
                time.sleep(float(resp.getheader("Retry-After") or 0.05))
            except OSError:
                conn = None
                time.sleep(0.02)  # the job is still starting


def jsonl_count(path: Path) -> Callable[[], int]:
    def count() -> int:
        if not path.exists():
            return 0
        with open(path, "rb") as fh:
            return sum(1 for _ in fh)

    return count


def pairs(tmp: Path, n: int, pg: Postgres | None, nats: Nats | None, run: int) -> list[Pair]:
    src = tmp / f"in{run}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in items(n)))
    out = lambda name: tmp / f"{name}{run}.jsonl"  # noqa: E731
    made = [Pair("jsonl -> jsonl", str(src), str(out("j")), jsonl_count(out("j")))]
    url = f"http://127.0.0.1:{free_port()}"
    http_pair = Pair("http -> jsonl", url + "?max_pending=1000000", str(out("h")),
                     jsonl_count(out("h")))  # fmt: skip
    http_pair.feed = lambda: post_all(url, n)
    http_pair.follow = True
    made.append(http_pair)
    if pg is not None:
        t = f"bench{run}"
        pg.execute(f"CREATE TABLE in_{t} (id bigserial PRIMARY KEY, key text, i int)")
        pg.execute(
            f"INSERT INTO in_{t} (key, i) SELECT 'k' || (g % {KEYS}), g "
            f"FROM generate_series(0, {n - 1}) AS g"
        )

        import psycopg

        conn = psycopg.connect(pg.dsn, autocommit=True)  # one connection for all the counting

        def pg_count(table: str) -> Callable[[], int]:
            def count() -> int:
                try:
                    row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()  # noqa: S608
                except psycopg.errors.UndefinedTable:
                    return 0  # not created yet
                return int(row[0]) if row else 0

            return count

        made.append(Pair("postgres -> jsonl", f"{pg.dsn}?table=in_{t}", str(out("p")),
                         jsonl_count(out("p"))))  # fmt: skip
        made.append(Pair("jsonl -> postgres", str(src), f"{pg.dsn}?table=out_{t}",
                         pg_count(f"out_{t}")))  # fmt: skip
        url2 = f"http://127.0.0.1:{free_port()}"
        hp = Pair("http -> postgres", url2 + "?max_pending=1000000", f"{pg.dsn}?table=hout_{t}",
                  pg_count(f"hout_{t}"))  # fmt: skip
        hp.feed = lambda: post_all(url2, n)
        hp.follow = True
        made.append(hp)
    if nats is not None:
        s = f"B{run}"
        nats.add_stream(f"IN{s}", [f"in.{s}"])
        nats.add_stream(f"OUT{s}", [f"out.{s}"])
        nats.publish(f"in.{s}", [json.dumps(r).encode() for r in items(n)])
        made.append(Pair("nats -> jsonl", f"{nats.url}?stream=IN{s}&subject=in.{s}",
                         str(out("n")), jsonl_count(out("n"))))  # fmt: skip
        made.append(Pair("jsonl -> nats", str(src), f"{nats.url}?stream=OUT{s}&subject=out.{s}",
                         lambda: nats.count(f"OUT{s}")))  # fmt: skip
    return made


def measure(pair: Pair, agent: str, state: Path, n: int) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ratchet.cli", "run", agent, "--input", pair.src, "--output",
         pair.out, "--state", str(state)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        if pair.feed is not None:
            pair.feed()
        while pair.count() < n:
            if proc.poll() is not None and pair.count() < n:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"{pair.name}: exited {proc.returncode}: {err[-2000:]}")
            time.sleep(0.02)
        elapsed = time.perf_counter() - start
    finally:
        if pair.follow:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-conn-bench-"))
    (tmp / "agent.py").write_text(AGENT_SRC)
    agent = f"{tmp / 'agent.py'}:OneStep"
    bindir = pg_bin()
    pg = Postgres(bindir) if bindir is not None else None
    binary = shutil.which("nats-server")
    nats = Nats(binary) if binary is not None else None
    times: dict[str, list[float]] = {}
    try:
        for run in range(args.repeat):
            for i, pair in enumerate(pairs(tmp, args.n, pg, nats, run)):
                t = measure(pair, agent, tmp / f"state-{run}-{i}", args.n)
                times.setdefault(pair.name, []).append(t)
    finally:
        if pg is not None:
            pg.stop()
        if nats is not None:
            nats.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(times["jsonl -> jsonl"])
    print(f"{args.n} inputs, {KEYS} keys, one action with a memory write and an output, "
          f"median of {args.repeat}")  # fmt: skip
    print(f"{'pair':20} {'seconds':>8} {'inputs/s':>9} {'vs jsonl':>9}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:20} {t:8.2f} {args.n / t:9.0f} {base / t:8.2f}x")
    if pg is None:
        print("(postgres pairs skipped: install the Debian package postgresql)")
    if nats is None:
        print("(nats pairs skipped: install the Debian package nats-server)")


if __name__ == "__main__":
    main()
