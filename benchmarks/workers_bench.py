"""`ratchet run --workers 2` against `--workers 1` on workload 1 of benchmarks/peers (an event,
a per-key memory write and an output per input; 1,000 keys), through the CLI, in one run.

Each repetition runs both, alternating, on the same input file into new state and output; the
figure is inputs per second of the whole command (process start, restore, reading, writing,
the final checkpoint), and the ratio is 2 workers over 1. The driver only waits on the child
(no polling). `--start exec` starts the workers as new interpreters (RATCHET_WORKER_START=exec,
the start-up before forking them); `--start both` runs each repetition with both, alternating.
Usage: python benchmarks/workers_bench.py [--inputs N] [--repeat R] [--workers 2]
[--start fork|exec|both]
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
sys.path.insert(0, str(HERE / "peers"))

import _common as c  # noqa: E402

AGENT = f"{HERE / 'peers' / 'ratchet_agents.py'}:ThreeSteps"


# `ratchet run`, which also reports its own CPU seconds at exit (the workers' are the rest of
# what its process tree used): at the interpreter's exit, or at `os._exit` (which `ratchet run`
# takes when a thread is still alive at its end), in this process only (not a forked worker).
RUN = (
    "import atexit, os, sys, time; from ratchet.cli import main; me = os.getpid(); "
    "cpu = lambda: os.getpid() == me and print('CPU', time.process_time(), file=sys.stderr, "
    "flush=True); atexit.register(cpu); _exit = os._exit; "
    "os._exit = lambda code: (cpu(), _exit(code)); "
    "sys.argv = ['ratchet', *sys.argv[1:]]; sys.exit(main())"
)


def once(wd: Path, inputs: Path, workers: int, start: str = "fork") -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of the whole process tree, CPU seconds of the process
    started, i.e. the coordinator with workers > 1); `start`: how workers start."""
    state, out = wd / f"state-{workers}", wd / f"out-{workers}.jsonl"
    shutil.rmtree(state, ignore_errors=True)
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-c", RUN, "run", AGENT, "--input", str(inputs),
        "--output", str(out), "--state", str(state), "--workers", str(workers),
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    env = dict(os.environ, RATCHET_WORKER_START=start)
    done = subprocess.run(
        cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
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
    ap.add_argument(
        "--start", choices=("fork", "exec", "both"), default="fork",
        help="how the workers start (RATCHET_WORKER_START); both: each, alternating",
    )  # fmt: skip
    a = ap.parse_args()
    c.compile_ratchet(sys.executable)  # children start as from a user's install
    starts = ("exec", "fork") if a.start == "both" else (a.start,)
    with tempfile.TemporaryDirectory(prefix="ratchet-workers-") as tmp:
        wd = Path(tmp)
        inputs = wd / "in.jsonl"
        with inputs.open("w") as fh:
            for i in range(a.inputs):
                fh.write(json.dumps({"key": f"k{i % a.keys}", "id": f"i{i}", "v": i}) + "\n")
        one_runs: list[tuple[float, float, float]] = []
        runs: dict[str, list[tuple[float, float, float]]] = {s: [] for s in starts}
        for _ in range(a.repeat):
            one_runs.append(once(wd, inputs, 1))
            for start in starts:
                runs[start].append(once(wd, inputs, a.workers, start))

    def med(rows: list[tuple[float, float, float]], i: int) -> float:
        return statistics.median(r[i] for r in rows)

    one, cpu_one = med(one_runs, 0), med(one_runs, 1)
    print(f"workload 1 through `ratchet run`, {a.inputs} inputs over {a.keys} keys, "
          f"median of {a.repeat}, {os.cpu_count()} CPUs:")  # fmt: skip
    print(f"  --workers 1: {a.inputs / one:9,.0f} inputs/s  ({one:.2f} s); CPU {cpu_one:.2f} s")
    cores = os.cpu_count() or 1
    for start in starts:
        rows = runs[start]
        many = med(rows, 0)
        cpu_tree, cpu_coord = med(rows, 1), med(rows, 2)
        per_worker = (cpu_tree - cpu_coord) / a.workers
        print(
            f"  --workers {a.workers} (workers started by {start}): {a.inputs / many:9,.0f} "
            f"inputs/s  ({many:.2f} s); ratio {a.workers} workers / 1 worker (wall): "
            f"{one / many:.2f}x"
        )
        print(
            f"    CPU: {cpu_tree:.2f} s in all, the coordinator {cpu_coord:.2f} s, each worker "
            f"{per_worker:.2f} s on average; best ratio the CPU allows: "
            f"{cpu_one / max(cpu_coord, per_worker):.2f}x with a core per process, "
            f"{cpu_one / max(cpu_coord, per_worker, cpu_tree / cores):.2f}x on {cores} idle "
            f"cores"
        )
    print(
        "  (best ratio: 1 worker's CPU over the larger of the busiest process's and the tree's "
        "CPU per core. On a machine shared with other work the wall ratio also reflects how "
        "much CPU each run was given)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
