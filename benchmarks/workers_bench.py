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
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
AGENT = f"{HERE / 'peers' / 'ratchet_agents.py'}:ThreeSteps"


# `ratchet run`, which also reports its own CPU seconds at exit (the workers' are the rest of
# what its process tree used).
RUN = (
    "import atexit, sys, time; from ratchet.cli import main; "
    "atexit.register(lambda: print('CPU', time.process_time(), file=sys.stderr)); "
    "sys.argv = ['ratchet', *sys.argv[1:]]; sys.exit(main())"
)


def once(wd: Path, inputs: Path, workers: int) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of the whole process tree, CPU seconds of the process
    started, i.e. the coordinator with workers > 1)."""
    state, out = wd / f"state-{workers}", wd / f"out-{workers}.jsonl"
    shutil.rmtree(state, ignore_errors=True)
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-c", RUN, "run", AGENT, "--input", str(inputs),
        "--output", str(out), "--state", str(state), "--workers", str(workers),
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    tree = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    top = float(done.stderr.decode().rsplit("CPU ", 1)[1].split()[0])
    with out.open("rb") as fh:
        lines = sum(1 for _ in fh)
    n = sum(1 for _ in inputs.open("rb"))
    assert lines == n, f"--workers {workers}: {lines} outputs for {n} inputs"
    return wall, tree, top


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
        runs: dict[int, list[tuple[float, float, float]]] = {1: [], a.workers: []}
        for _ in range(a.repeat):
            for w in (1, a.workers):
                runs[w].append(once(wd, inputs, w))

    def med(w: int, i: int) -> float:
        return statistics.median(r[i] for r in runs[w])

    one, many = med(1, 0), med(a.workers, 0)
    cpu_one, cpu_tree, cpu_coord = med(1, 1), med(a.workers, 1), med(a.workers, 2)
    per_worker = (cpu_tree - cpu_coord) / a.workers
    print(f"workload 1 through `ratchet run`, {a.inputs} inputs over {a.keys} keys, "
          f"median of {a.repeat}, {os.cpu_count()} CPUs:")  # fmt: skip
    print(f"  --workers 1: {a.inputs / one:9,.0f} inputs/s  ({one:.2f} s)")
    print(f"  --workers {a.workers}: {a.inputs / many:9,.0f} inputs/s  ({many:.2f} s)")
    print(f"  ratio {a.workers} workers / 1 worker (wall): {one / many:.2f}x")
    print(
        f"  CPU: 1 worker {cpu_one:.2f} s; {a.workers} workers {cpu_tree:.2f} s in all, the "
        f"coordinator {cpu_coord:.2f} s, each worker {per_worker:.2f} s on average"
    )
    cores = os.cpu_count() or 1
    print(
        f"  best ratio the CPU allows: {cpu_one / max(cpu_coord, per_worker):.2f}x with a core "
        f"per process; {cpu_one / max(cpu_coord, per_worker, cpu_tree / cores):.2f}x on "
        f"{cores} idle cores (1 worker's CPU over the larger of the busiest process's and the "
        f"tree's CPU per core). On a machine shared with other work the wall ratio also "
        f"reflects how much CPU each run was given"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
