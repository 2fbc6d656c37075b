"""Records/s of a keyed agent: the Flink engine (local mini-cluster) vs the embedded one.

Run with the Flink venv: `.venv-flink/bin/python benchmarks/flink_vs_embedded.py [N] [options]`.
Flink's start-up (8-12 s) is taken out by timing two runs (N/5 and N inputs) and dividing the
extra inputs by the extra time; the embedded engine is timed the same way. Prints the ratio.

`--agent counter` (default): one inline action, one memory write. `--agent realistic`: issue
20's agent, a counter with a `bytes` value and one 10 ms `durable_execute_async` call per input
(`--keys 50`). `--once`: one run of N inputs per engine, wall time including start-up (what a
user waits). `--src DIR`: the Flink job imports ratchet from DIR (say, `git archive` of an
older commit's `src/`), for a before/after figure. Extra arguments after `--` go to
`ratchet flink run` (say `-- --bundle-size 1000`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, action

HERE = Path(__file__).resolve()


class Counter(Agent):
    """One inline action per input: read and write one memory value, emit one output."""

    @action(InputEvent, inline=True)
    def count(self, event: InputEvent, ctx: Any) -> None:
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(OutputEvent(output=n))


def blob_call(i: int) -> int:
    time.sleep(0.01)  # a 10 ms tool call, run on a worker thread by durable_execute_async
    return i % 251


class Realistic(Agent):
    """Issue 20's agent: a counter, a growing `bytes` value, one 10 ms durable call per input."""

    @action(InputEvent)
    async def handle(self, event: InputEvent, ctx: Any) -> None:
        b = await ctx.durable_execute_async(blob_call, event.input["i"])
        mem = ctx.short_term_memory
        n = mem.get("n", 0) + 1
        mem.set("n", n)
        mem.set("blob", (mem.get("blob", b"") + bytes([b]))[-64:])
        ctx.send_event(OutputEvent(output=n))


AGENTS = {"counter": Counter, "realistic": Realistic}
OPTS: dict[str, Any] = {"agent": "counter", "keys": 100, "src": None, "extra": []}


def inputs(path: Path, n: int, keys: int | None = None) -> None:
    keys = keys or OPTS["keys"]
    path.write_text("".join(json.dumps({"key": f"k{i % keys}", "i": i}) + "\n" for i in range(n)))


def embedded(tmp: Path, n: int) -> float:
    import ratchet

    inputs(tmp / f"e{n}.jsonl", n)
    t = time.perf_counter()
    ratchet.run(
        AGENTS[OPTS["agent"]](),
        inputs=str(tmp / f"e{n}.jsonl"),
        output=str(tmp / f"e{n}.out"),
        state_dir=tmp / f"e{n}.state",
    )
    return time.perf_counter() - t


def flink(tmp: Path, n: int) -> float:
    inputs(tmp / f"f{n}.jsonl", n)
    cmd = [
        sys.executable,
        "-c",
        "import argparse,sys; from ratchet.cli import _flink; p=argparse.ArgumentParser(); "
        "_flink.register(p.add_subparsers(dest='c')); a=p.parse_args(); sys.exit(a.func(a))",
        "flink",
        "run",
        f"{HERE}:{AGENTS[OPTS['agent']].__name__}",
        "--input",
        str(tmp / f"f{n}.jsonl"),
        "--output",
        str(tmp / f"f{n}.out"),
        "--checkpoint-interval",
        "1000",
        "--tmp-dir",
        str(tmp / "flink-tmp"),
        *OPTS["extra"],
    ]
    env = {"TMPDIR": str(tmp), "JVM_ARGS": f"-Djava.io.tmpdir={tmp}"}
    import os

    if OPTS["src"]:
        env["PYTHONPATH"] = os.pathsep.join([OPTS["src"], str(HERE.parent)])

    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **env}, timeout=600)
    elapsed = time.perf_counter() - t
    got = sum(
        1
        for f in (tmp / f"f{n}.out").iterdir()
        if f.is_file() and not f.name.startswith((".", "_"))  # not _progress/, _bad-input/
        for line in f.read_text().splitlines()
        if line
    )
    assert got == n, f"flink wrote {got} outputs for {n} inputs"
    return elapsed


def main() -> None:
    import argparse

    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser()
    ap.add_argument("n", nargs="?", type=int, default=20000)
    ap.add_argument("--agent", choices=sorted(AGENTS), default="counter")
    ap.add_argument("--keys", type=int, default=None)
    ap.add_argument("--src", default=None)
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--flink-only", action="store_true")
    a = ap.parse_args(argv)
    OPTS.update(
        agent=a.agent,
        keys=a.keys or (50 if a.agent == "realistic" else 100),
        src=a.src and str(Path(a.src).resolve()),
        extra=extra,
    )
    n = a.n
    small = n // 5
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-bench-flink-"))
    if a.once:
        try:
            e = None if a.flink_only else embedded(tmp, n)
            f = flink(tmp, n)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        what = f"{a.agent} agent, {n} inputs over {OPTS['keys']} keys"
        if e is not None:
            print(f"embedded: {what}: {e:.2f}s ({n / e:,.0f} inputs/s)")
        print(f"flink:    {what}: {f:.2f}s wall, start-up included ({n / f:,.0f} inputs/s)")
        if e is not None:
            print(f"ratio flink/embedded (wall): {e / f:.2f}")
        return
    try:
        e1, e2 = embedded(tmp, small), embedded(tmp, n)
        f1, f2 = flink(tmp, small), flink(tmp, n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    e_rate = (n - small) / max(e2 - e1, 1e-9)
    f_rate = (n - small) / max(f2 - f1, 1e-9)
    print(f"embedded: {small} inputs {e1:.2f}s, {n} inputs {e2:.2f}s -> {e_rate:,.0f} records/s")
    print(
        f"flink:    {small} inputs {f1:.2f}s, {n} inputs {f2:.2f}s -> {f_rate:,.0f} records/s "
        f"(wall time includes {f1 - small / f_rate:.1f}s start-up)"
    )
    print(f"ratio flink/embedded: {f_rate / e_rate:.2f}")


if __name__ == "__main__":
    main()
