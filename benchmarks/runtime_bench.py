"""The embedded engine beside its baselines, in one run. Figures (issue 2, section 9):

(a) throughput of trivial 3-action runs at the default checkpoint interval, pinned to one
    core, beside the same actions called in a plain asyncio loop with no durability;
(b) 2,000 inputs over 200 keys whose action awaits a 50 ms simulated call: wall time beside
    the ideal for max_concurrent_runs;
(c) checkpoint duration with 10,000 keys of state (all dirty, and a steady-state one);
(d) restart-to-first-output after a SIGKILL with 10,000 keys of state, beside the bare
    start-up of a Python process that imports ratchet.

    .venv/bin/python benchmarks/runtime_bench.py [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from ratchet import Agent, EngineConfig, Event, InputEvent, OutputEvent, action, run
from ratchet.store._sqlite import SqliteStore


class Mid(Event):
    event_name = "bench.Mid"
    v: int


class Last(Event):
    event_name = "bench.Last"
    v: int


class ThreeSteps(Agent):
    """Trivial steps: an event, a memory write, an output."""

    @action(InputEvent)
    def one(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(Mid(v=event.input["v"]))

    @action(Mid)
    def two(self, event: Mid, ctx: Any) -> None:
        ctx.short_term_memory.set("v", event.v)
        ctx.send_event(Last(v=event.v))

    @action(Last)
    def three(self, event: Last, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output=event.v))


class PlainCtx:
    """What the baseline's actions get: a dict for memory, a list for events. No durability."""

    def __init__(self, memory: dict[str, Any]) -> None:
        self.memory = memory
        self.events: list[Any] = []


def plain_asyncio(inputs: list[dict[str, Any]]) -> float:
    """The same three steps, per key in order, in one asyncio loop; outputs to a list."""

    async def main() -> None:
        memories: dict[str, dict[str, Any]] = {}
        outputs: list[Any] = []

        async def one_run(item: dict[str, Any]) -> None:
            mem = memories.setdefault(item["key"], {})
            queue: list[Any] = [InputEvent(input=item)]
            while queue:
                ev = queue.pop(0)
                ctx = PlainCtx(mem)
                if isinstance(ev, InputEvent):
                    ctx.events.append(Mid(v=ev.input["v"]))
                elif isinstance(ev, Mid):
                    ctx.memory["v"] = ev.v
                    ctx.events.append(Last(v=ev.v))
                elif isinstance(ev, Last):
                    ctx.events.append(OutputEvent(output=ev.v))
                for e in ctx.events:
                    (outputs.append(e) if isinstance(e, OutputEvent) else queue.append(e))

        for item in inputs:
            await one_run(item)

    t = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - t


def fig_a(n: int, keys: int) -> dict[str, float]:
    inputs = [{"key": f"k{i % keys}", "v": i} for i in range(n)]
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        res = run(ThreeSteps(), inputs=inputs, output=Path(d) / "o.jsonl", state_dir=Path(d) / "s")
        ours = time.perf_counter() - t
    assert res.runs_completed == n
    base = plain_asyncio(inputs)
    return {"ratchet_actions_per_s": 3 * n / ours, "plain_actions_per_s": 3 * n / base}


def _timed_three_steps(inputs: list[dict[str, Any]], config: EngineConfig) -> float:
    """Seconds for workload (a) over `inputs` with `config`, in a fresh state directory."""
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        run(
            ThreeSteps(),
            inputs=inputs,
            output=Path(d) / "o.jsonl",
            state_dir=Path(d) / "s",
            config=config,
        )
        return time.perf_counter() - t


def fig_e(n: int, keys: int) -> dict[str, float]:
    """(e) The cost of run traces: workload (a) at the default retention beside traces off."""
    inputs = [{"key": f"k{i % keys}", "v": i} for i in range(n)]
    took: dict[str, float] = {}
    for policy in ("off", "20"):
        took[policy] = _timed_three_steps(inputs, EngineConfig(trace_retention=policy))
    return {
        "traced_actions_per_s": 3 * n / took["20"],
        "untraced_actions_per_s": 3 * n / took["off"],
    }


def fig_f(n: int, keys: int) -> dict[str, float]:
    """(f) The cost of OpenTelemetry export: workload (a) exporting every run's spans over
    OTLP/HTTP to a local receiver that accepts and drops them, beside no export."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    inputs = [{"key": f"k{i % keys}", "v": i} for i in range(n)]
    took: dict[str, float] = {}
    try:
        for endpoint in (None, url):
            config = EngineConfig(otel_endpoint=endpoint)
            took[str(endpoint is not None)] = _timed_three_steps(inputs, config)
    finally:
        server.shutdown()
        server.server_close()
    return {
        "otel_actions_per_s": 3 * n / took["True"],
        "plain_actions_per_s": 3 * n / took["False"],
    }


class SlowCall(Agent):
    @action(InputEvent)
    async def call(self, event: InputEvent, ctx: Any) -> None:
        await asyncio.sleep(0.05)
        ctx.short_term_memory.set("n", ctx.short_term_memory.get("n", 0) + 1)
        ctx.send_event(OutputEvent(output=event.input["i"]))


def fig_b(n: int, keys: int, concurrency: int) -> dict[str, float]:
    inputs = [{"key": f"k{i % keys}", "i": i} for i in range(n)]
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        run(
            SlowCall(),
            inputs=inputs,
            output=Path(d) / "o.jsonl",
            state_dir=Path(d) / "s",
            config=EngineConfig(max_concurrent_runs=concurrency),
        )
        wall = time.perf_counter() - t
    # Ideal: every slot busy all the time, and no key's inputs overlapping.
    per_key = n / keys
    ideal = max(-(-n // concurrency), per_key) * 0.05
    return {"wall_s": wall, "ideal_s": ideal}


class Keyed(Agent):
    @action(InputEvent, inline=True)
    def keep(self, event: InputEvent, ctx: Any) -> None:
        m = ctx.short_term_memory
        m.set("count", m.get("count", 0) + 1)
        m.set("profile", {"name": f"customer {event.input['key']}", "tier": event.input["i"] % 3})
        ctx.send_event(OutputEvent(output=event.input["i"]))


def fig_c(keys: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        # One checkpoint at the end holds all 10,000 dirty keys.
        inputs = [{"key": f"k{i}", "i": i} for i in range(keys)]
        res = run(
            Keyed(),
            inputs=inputs,
            output=Path(d) / "o.jsonl",
            state_dir=Path(d) / "s",
            config=EngineConfig(checkpoint_interval=3600),
        )
        full = res.checkpoints["latest"]["completed"]
        # Steady state: 10,000 keys stored, 100 of them changed since the last checkpoint.
        res2 = run(
            Keyed(),
            inputs=inputs + [{"key": f"k{i}", "i": i} for i in range(100)],
            output=Path(d) / "o.jsonl",
            state_dir=Path(d) / "s",
            config=EngineConfig(checkpoint_interval=3600),
        )
        small = res2.checkpoints["latest"]["completed"]
        size = (Path(d) / "s" / "ratchet.db").stat().st_size
    return {
        "full_ms": full["duration_ms"],
        "full_bytes": full["size_bytes"],
        "incremental_ms": small["duration_ms"],
        "db_bytes": size,
    }


AGENT_FILE = textwrap.dedent(
    """
    from ratchet import Agent, InputEvent, OutputEvent, action

    class Keyed(Agent):
        @action(InputEvent, inline=True)
        def keep(self, event, ctx):
            m = ctx.short_term_memory
            m.set("count", m.get("count", 0) + 1)
            m.set("profile", {"name": "customer " + str(event.input["key"]), "tier": event.input["i"] % 3})
            ctx.send_event(OutputEvent(output=event.input["i"]))
    """
)


def _wait_lines(path: Path, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            with path.open("rb") as fh:
                if sum(1 for _ in fh) >= n:
                    return
        time.sleep(0.002)
    raise TimeoutError(f"{path} did not reach {n} lines")


def fig_d(keys: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "agent.py").write_text(AGENT_FILE)
        src = root / "in.jsonl"
        src.write_text("".join(json.dumps({"key": f"k{i}", "i": i}) + "\n" for i in range(keys)))
        out = root / "out.jsonl"
        cmd = [
            sys.executable, "-m", "ratchet.cli", "run", f"{root / 'agent.py'}:Keyed",
            "--input", str(src), "--output", str(out), "--state", str(root / "s"), "--follow",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_lines(out, keys)
        time.sleep(0.3)  # let a checkpoint pass with everything in it
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with src.open("a") as fh:
            fh.write(json.dumps({"key": "k1", "i": keys}) + "\n")
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_lines(out, keys + 1)
        recovery = time.perf_counter() - t
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        store = SqliteStore.open_readonly(root / "s")
        restored = store.stats()["counts"]["restored"]
        store.close()
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", "import ratchet.cli._agents, ratchet.agents"], check=True
        )
        bare = time.perf_counter() - t
    return {"restart_to_output_s": recovery, "python_import_s": bare, "restored": restored}


def median_of(fn: Any, repeat: int, *args: Any) -> dict[str, float]:
    runs = [fn(*args) for _ in range(repeat)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smaller inputs, one repetition")
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat
    scale = 10 if args.quick else 1
    try:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        pinned = "pinned to one core"
    except (AttributeError, OSError):
        pinned = "not pinned"
    print(
        f"ratchet embedded engine benchmark: {os.cpu_count()} cores on the machine, {pinned}, median of {repeat}"
    )
    a = median_of(fig_a, repeat, 20000 // scale, 1000 // scale)
    b = median_of(fig_b, repeat, 2000 // scale, 200 // scale, 64)
    c = median_of(fig_c, repeat, 10000 // scale)
    # (d) runs its engine in a subprocess, which inherits the one-core pinning.
    dd = median_of(fig_d, repeat, 10000 // scale)
    e = median_of(fig_e, repeat, 20000 // scale, 1000 // scale)
    f = median_of(fig_f, repeat, 20000 // scale, 1000 // scale)
    rows = [
        ("(a) 3-action runs, actions/s", f"{a['ratchet_actions_per_s']:,.0f}",
         f"plain asyncio {a['plain_actions_per_s']:,.0f}",
         f"{a['ratchet_actions_per_s'] / a['plain_actions_per_s']:.2f}x", "target >= 20,000/s"),
        ("(b) 2,000 x 50 ms calls, wall s", f"{b['wall_s']:.2f}", f"ideal {b['ideal_s']:.2f}",
         f"{b['wall_s'] / b['ideal_s']:.2f}x", "target <= 1.20x"),
        ("(c) checkpoint, 10k dirty keys, ms", f"{c['full_ms']:.1f}",
         f"{c['full_bytes'] / 1e6:.2f} MB written", "", ""),
        ("(c) checkpoint, 100 of 10k keys, ms", f"{c['incremental_ms']:.1f}",
         f"db {c['db_bytes'] / 1e6:.2f} MB", "", ""),
        ("(d) SIGKILL restart to first output, s", f"{dd['restart_to_output_s']:.2f}",
         f"python+import {dd['python_import_s']:.2f}",
         f"{dd['restart_to_output_s'] / dd['python_import_s']:.2f}x", f"restores {dd['restored']:.0f}"),
        ("(e) (a) with run traces (last 20/key), actions/s", f"{e['traced_actions_per_s']:,.0f}",
         f"traces off {e['untraced_actions_per_s']:,.0f}",
         f"{e['traced_actions_per_s'] / e['untraced_actions_per_s']:.2f}x", ""),
        ("(f) (a) exporting OpenTelemetry spans, actions/s", f"{f['otel_actions_per_s']:,.0f}",
         f"no export {f['plain_actions_per_s']:,.0f}",
         f"{f['otel_actions_per_s'] / f['plain_actions_per_s']:.2f}x", ""),
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)))


if __name__ == "__main__":
    main()
