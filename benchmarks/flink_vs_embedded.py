"""Records/s of a trivial keyed agent: the Flink engine (local mini-cluster) vs the embedded one.

Run with the Flink venv: `.venv-flink/bin/python benchmarks/flink_vs_embedded.py [N]`.
Flink's start-up (8-12 s) is taken out by timing two runs (N/5 and N inputs) and dividing the
extra inputs by the extra time; the embedded engine is timed the same way. Prints the ratio.
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


def inputs(path: Path, n: int, keys: int = 100) -> None:
    path.write_text("".join(json.dumps({"key": f"k{i % keys}", "i": i}) + "\n" for i in range(n)))


def embedded(tmp: Path, n: int) -> float:
    import ratchet

    inputs(tmp / f"e{n}.jsonl", n)
    t = time.perf_counter()
    ratchet.run(
        Counter(),
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
        f"{HERE}:Counter",
        "--input",
        str(tmp / f"f{n}.jsonl"),
        "--output",
        str(tmp / f"f{n}.out"),
        "--checkpoint-interval",
        "1000",
        "--tmp-dir",
        str(tmp / "flink-tmp"),
    ]
    env = {"TMPDIR": str(tmp), "JVM_ARGS": f"-Djava.io.tmpdir={tmp}"}
    import os

    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **env}, timeout=600)
    elapsed = time.perf_counter() - t
    got = sum(
        1
        for f in (tmp / f"f{n}.out").iterdir()
        if not f.name.startswith(".")
        for line in f.read_text().splitlines()
        if line
    )
    assert got == n, f"flink wrote {got} outputs for {n} inputs"
    return elapsed


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    small = n // 5
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-bench-flink-"))
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
