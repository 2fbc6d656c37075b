"""CPU seconds of `ratchet run` on perstep_bench.py's one-action job, for two source trees
side by side (issue 19's CLI target: >= 15k inputs/s on one worker).

Each tree (a `src` folder put first on PYTHONPATH) runs the same command, the trees
alternating, `--repeat` times: 20,000 JSONL inputs over 7 keys, one inline action with one
memory write and one output per input, JSONL out, the default checkpoint interval, pinned to
one core. The figure is the process's CPU time (user + system, every thread) from
`getrusage(RUSAGE_CHILDREN)`, which the machine's load moves far less than wall-clock time;
the same command on a one-line input gives the start-up to take off. Children are waited on,
never polled.

    .venv/bin/python benchmarks/cli_cpu_bench.py BASE/src src [--repeat 5] [--n 20000]
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

from perstep_bench import AGENT_SRC, KEYS


def run_once(tree: str, agent: str, inputs: Path, wd: Path, cpu: int | None) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one `ratchet run` with `tree` first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=tree)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # start-up as users have it: compiled modules
    cmd = [sys.executable, "-m", "ratchet.cli", "run", agent, "--input", str(inputs),
           "--output", str(wd / "out.jsonl"), "--state", str(wd / "state")]  # fmt: skip
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return used, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", help="src folders to compare (first on PYTHONPATH)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--cpu", type=int, default=0, help="the core to pin children to (-1: none)")
    a = ap.parse_args()
    cpu = None if a.cpu < 0 else a.cpu
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-clicpu-"))
    try:
        (tmp / "agent.py").write_text(AGENT_SRC)
        agent = f"{tmp / 'agent.py'}:OneStep"
        with open(tmp / "in.jsonl", "w") as fh:
            for i in range(a.n):
                fh.write(json.dumps({"key": f"k{i % KEYS}", "i": i}) + "\n")
        (tmp / "one.jsonl").write_text(json.dumps({"key": "k0", "i": 0}) + "\n")
        full: dict[str, list[float]] = {t: [] for t in a.trees}
        one: dict[str, list[float]] = {t: [] for t in a.trees}
        wall: dict[str, list[float]] = {t: [] for t in a.trees}
        for i, tree in enumerate(a.trees):  # compiles each tree's modules once, untimed
            run_once(tree, agent, tmp / "one.jsonl", tmp / f"warm{i}", cpu)
        for r in range(a.repeat):
            for i, tree in enumerate(a.trees):
                used, took = run_once(tree, agent, tmp / "in.jsonl", tmp / f"f{i}-{r}", cpu)
                full[tree].append(used)
                wall[tree].append(took)
                one[tree].append(
                    run_once(tree, agent, tmp / "one.jsonl", tmp / f"o{i}-{r}", cpu)[0]
                )
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"load average at the end: {load}; median of {a.repeat}, trees alternated")
        for tree in a.trees:
            f, o, w = (statistics.median(v[tree]) for v in (full, one, wall))
            print(f"{tree}: {f:.3f} CPU s for {a.n} inputs ({a.n / f:,.0f} inputs per CPU-second); "
                  f"one input {o:.3f} s, without it {a.n / max(f - o, 1e-9):,.0f}/CPU-s; "
                  f"wall {w:.2f} s; each run {[round(x, 3) for x in full[tree]]}")  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
