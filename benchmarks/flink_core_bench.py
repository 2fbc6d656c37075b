"""The Flink engine's core per input: its fused path beside its generic dispatch (issue 20).

Workload 1 of benchmarks/peers (three inline actions: an input, two events, a memory write
and an output per input; 20,000 inputs over 1,000 keys) through `AgentCore` on in-memory
keyed state, as the PyFlink operator drives it (one `element` callback per input), without
PyFlink or a JVM: what the core itself costs per input in a TaskManager. Both paths run in
this process, alternating, `--repeat` times; the figure is each path's best, and the ratio.

    .venv/bin/python benchmarks/flink_core_bench.py [--inputs 20000] [--keys 1000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from ratchet_agents import ThreeSteps  # noqa: E402

from ratchet.agents._context import AgentBinding  # noqa: E402
from ratchet.runtime._flink_core import AgentCore, MemoryKeyedState  # noqa: E402


def one_run(inputs: int, keys: int, fused: bool) -> float:
    """Seconds for `inputs` element callbacks (start-up and close not counted)."""
    binding = AgentBinding(ThreeSteps())
    if not fused:
        binding.inline_runner = None  # type: ignore[method-assign]  # the generic dispatch
    core = AgentCore(binding)
    core.open()
    state = MemoryKeyedState()
    views = [state.view(f"k{k}") for k in range(keys)]
    rows = [{"key": f"k{i % keys}", "v": i} for i in range(inputs)]
    outputs = 0
    gc.collect()
    try:
        started = time.perf_counter()
        for i, row in enumerate(rows):
            step = core.element(row["key"], row, views[i % keys])
            outputs += len(step.outputs)
        elapsed = time.perf_counter() - started
    finally:
        core.close()
    if outputs != inputs:
        raise SystemExit(
            f"{outputs} outputs for {inputs} inputs ({'fused' if fused else 'generic'})"
        )
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=20_000)
    ap.add_argument("--keys", type=int, default=1_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    best = {"generic": float("inf"), "fused": float("inf")}
    for r in range(a.repeat):
        for name in ("generic", "fused") if r % 2 == 0 else ("fused", "generic"):
            best[name] = min(best[name], one_run(a.inputs, a.keys, name == "fused"))
    for name, secs in best.items():
        print(f"{name:8s} {secs * 1e6 / a.inputs:7.2f} us/input  ({a.inputs / secs:,.0f} inputs/s)")
    print(f"fused / generic throughput: {best['generic'] / best['fused']:.2f}x")


if __name__ == "__main__":
    main()
