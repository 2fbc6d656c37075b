"""Checkpoint cadence under load: how far apart a busy job's checkpoints are, against the
interval it was given (200 ms by default), and what that costs in throughput.

Workload 1 of benchmarks/peers (an event, a memory write and an output per input; 1,000
keys) through `ratchet run`, inputs as fast as the job takes them. After each run the state's
checkpoint table (the latest 100 per shard) gives when each checkpoint was triggered and how
long its write took: the gaps between consecutive triggers are the cadence, and a kill loses
at most about one gap of work. The ratio printed is the largest gap over the interval given
(1.0 would be every checkpoint on time). `--base-src DIR` runs another ratchet tree (its
`src/`) the same way, alternating with this one, so a change is measured before and after in
one run. The driver only waits on its children (no polling).

    .venv/bin/python benchmarks/cadence_bench.py [--inputs 100000] [--workers 1,2]
        [--repeat 1] [--base-src /tmp/old/src]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
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
INTERVAL = 0.2  # EngineConfig's default checkpoint_interval


def cadence(state: Path) -> tuple[list[float], list[float]]:
    """(gaps between consecutive checkpoint triggers, write durations in s), every shard."""
    gaps: list[float] = []
    durations: list[float] = []
    for db in sorted(state.rglob("ratchet.db")):
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = conn.execute(
                # Re-sharding's seed of a new shard is written at time 0: not the job's.
                "SELECT triggered_at, duration_ms FROM checkpoints WHERE triggered_at > 0 "
                "ORDER BY id"
            ).fetchall()
        finally:
            conn.close()
        at = [float(r[0]) for r in rows]
        gaps += [b - a for a, b in zip(at, at[1:], strict=False)]
        durations += [float(r[1]) / 1000 for r in rows]
    return gaps, durations


def once(wd: Path, inputs: Path, n: int, workers: int, src: str | None) -> dict[str, float]:
    state, out = wd / "state", wd / "out.jsonl"
    shutil.rmtree(state, ignore_errors=True)
    out.unlink(missing_ok=True)
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", AGENT, "--input", str(inputs),
        "--output", str(out), "--state", str(state), "--workers", str(workers),
    ]  # fmt: skip
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - t
    with out.open("rb") as fh:
        lines = sum(1 for _ in fh)
    assert lines == n, f"{lines} outputs for {n} inputs"
    gaps, durations = cadence(state)
    assert gaps, "fewer than two checkpoints: nothing to measure (more --inputs)"
    return {
        "wall": wall,
        "checkpoints": len(durations),
        "median_gap": statistics.median(gaps),
        "max_gap": max(gaps),
        "max_write": max(durations),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--inputs", type=int, default=100_000)
    ap.add_argument("--keys", type=int, default=1_000)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--base-src", default=None, help="another ratchet's src/ to run beside")
    a = ap.parse_args()
    trees: list[tuple[str, str | None]] = [("this tree", None)]
    if a.base_src:
        base = str(Path(a.base_src).resolve())
        c.compile_ratchet(sys.executable, {"PYTHONPATH": base})
        trees.append((f"base {a.base_src}", base))
    c.compile_ratchet(sys.executable)
    counts = [int(w) for w in a.workers.split(",")]
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="ratchet-cadence-") as tmp:
        wd = Path(tmp)
        inputs = wd / "in.jsonl"
        with inputs.open("w") as fh:
            for i in range(a.inputs):
                fh.write(json.dumps({"key": f"k{i % a.keys}", "id": f"i{i}", "v": i}) + "\n")
        for _ in range(a.repeat):
            for workers in counts:
                for name, src in trees:
                    rows.setdefault((name, workers), []).append(
                        once(wd, inputs, a.inputs, workers, src)
                    )
    print(
        f"checkpoint cadence of workload 1 under load, {a.inputs:,} inputs over {a.keys:,} "
        f"keys, checkpoint interval {INTERVAL:.1f} s, median of {a.repeat}, "
        f"{os.cpu_count()} CPUs:"
    )
    print(
        "| tree | workers | inputs/s | checkpoints (last 100 per shard) | median gap s | "
        "largest gap s | largest gap / interval | longest write s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (name, workers), runs in rows.items():

        def med(field: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r[field] for r in runs)

        print(
            f"| {name} | {workers} | {a.inputs / med('wall'):,.0f} | {med('checkpoints'):.0f} | "
            f"{med('median_gap'):.2f} | {med('max_gap'):.2f} | "
            f"{med('max_gap') / INTERVAL:.1f}x | {med('max_write'):.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
