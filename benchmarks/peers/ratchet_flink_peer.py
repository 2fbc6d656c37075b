"""ratchet's Flink engine on a PyFlink 2.3.0 local mini-cluster, checkpoints every 1 s.

The same agents as the ratchet column (`ratchet_agents.py`) through `ratchet.flink.apply_agent`,
on the same mini-cluster settings, source, sink and resume as the Flink Agents and PyFlink
columns (`_flink.py`). Python workers in process mode, as `ratchet flink run` sets them by
default; `--mode thread` runs them in thread mode (`--execution-mode thread`).
`PEER_FLINK_CONF="key=value,..."` adds Flink options (bundle sizes, for instance) for
before/after figures; the table's figures use none.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as c  # noqa: E402
import _flink as fl  # noqa: E402


def main() -> None:
    a = c.peer_args()
    wd: Path = a.workdir
    wd.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.url:
        os.environ["PEER_MODEL_URL"] = a.url
    # Separate Python worker processes, as on a cluster (ratchet.flink.environment does this).
    os.environ.setdefault("_python_worker_execution_mode", "process")
    import ratchet_agents as agents

    from ratchet.flink import CoreConfig, FlinkConfig, apply_agent

    n = a.n
    if a.workload == "w1":
        n = n or c.W1_INPUTS
        fl.write_inputs(wd, "part-0.jsonl", c.w1_inputs(n))
        agent, want = "ThreeSteps", n
    elif a.workload == "w2":
        n = n or c.W2_INPUTS
        fl.write_inputs(wd, "part-0.jsonl", c.w2_inputs(n))
        agent, want = "SlowCall", n
    elif a.workload == "w3":
        if not (wd / "in").exists():
            fl.write_inputs(wd, "part-0.jsonl", c.w3_inputs(n or c.W3_INPUTS))
        agent, want = "TwoCalls", n or c.W3_INPUTS
    elif a.workload == "w4-seed":
        fl.write_inputs(wd, "part-0.jsonl", c.w4_inputs(n or c.W4_KEYS))
        agent, want = "Keyed", n or c.W4_KEYS
    else:  # w4-resume: one new input in a new file
        new = c.w4_new_input()
        fl.write_inputs(wd, f"{new['id']}.jsonl", [new])
        agent, want = "Keyed", new["id"]

    extra = dict(
        kv.split("=", 1) for kv in os.environ.get("PEER_FLINK_CONF", "").split(",") if "=" in kv
    )
    if a.mode == "thread":  # the "ratchet on Flink thread" column: Python inside the JVM
        extra.setdefault("python.execution-mode", "thread")
    env = fl.environment(wd, extra)
    inputs = fl.source(env, wd).map(json.loads).uid("parse")
    config = FlinkConfig(core=CoreConfig(max_concurrent_tasks=c.CONCURRENCY))
    outputs = apply_agent(
        inputs,
        f"{agents.__file__}:{agent}",
        lambda x: x["key"],
        config=config,
    )
    # apply_agent's outputs are JSON lines already (Types.STRING()): no `json.dumps` map, as
    # the Flink Agents column needs for its Python objects.
    fl.sink(outputs, wd)
    job = env.execute_async(f"ratchet-flink-{a.workload}")
    first, done = fl.wait_outputs(wd, want, timeout=600)
    result = {"inputs": n, "wall_s": (done - t0) if done else None,
              "first_output_s": (first - t0) if first else None,
              "first_to_last_s": (done - first) if done and first else None}  # fmt: skip
    fl.finish(job, result, a.workload, n, done, wd)


if __name__ == "__main__":
    main()
