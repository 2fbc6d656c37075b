"""`ratchet run --workers 2` against `--workers 1` on workload 1 of benchmarks/peers (an event,
a per-key memory write and an output per input; 1,000 keys), through the CLI, in one run.

Each repetition runs both, alternating, on the same input file into new state and output; the
figure is inputs per second of the whole command (process start, restore, reading, writing,
the final checkpoint), and the ratio is 2 workers over 1. The driver only waits on the child
(no polling). Usage: python benchmarks/workers_bench.py [--inputs N] [--repeat R] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
AGENT = f"{HERE / 'peers' / 'ratchet_agents.py'}:ThreeSteps"


def once(wd: Path, inputs: Path, workers: int) -> float:
    state, out = wd / f"state-{workers}", wd / f"out-{workers}.jsonl"
    shutil.rmtree(state, ignore_errors=True)
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", AGENT, "--input", str(inputs),
        "--output", str(out), "--state", str(state), "--workers", str(workers),
    ]  # fmt: skip
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    with out.open("rb") as fh:
        lines = sum(1 for _ in fh)
    n = sum(1 for _ in inputs.open("rb"))
    assert lines == n, f"--workers {workers}: {lines} outputs for {n} inputs"
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--inputs", type=int, default=40_000)
    ap.add_argument("--keys", type=int, default=1_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ratchet-workers-") as tmp:
        wd = Path(tmp)
        inputs = wd / "in.jsonl"
        with inputs.open("w") as fh:
            for i in range(a.inputs):
                fh.write(json.dumps({"key": f"k{i % a.keys}", "id": f"i{i}", "v": i}) + "\n")
        walls: dict[int, list[float]] = {1: [], a.workers: []}
        for _ in range(a.repeat):
            for w in (1, a.workers):
                walls[w].append(once(wd, inputs, w))
    one, many = statistics.median(walls[1]), statistics.median(walls[a.workers])
    print(f"workload 1 through `ratchet run`, {a.inputs} inputs over {a.keys} keys, "
          f"median of {a.repeat}, {os.cpu_count()} CPUs:")  # fmt: skip
    print(f"  --workers 1: {a.inputs / one:9,.0f} inputs/s  ({one:.2f} s)")
    print(f"  --workers {a.workers}: {a.inputs / many:9,.0f} inputs/s  ({many:.2f} s)")
    print(f"  ratio {a.workers} workers / 1 worker: {one / many:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
