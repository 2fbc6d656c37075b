"""Apache Flink Agents 0.2.0 on a PyFlink 2.2.1 local mini-cluster, checkpoints every 1 s.

The same agents as ratchet's (`_flink_agents_agents.py`): actions on events, per-key
short-term memory, `durable_execute_async` for the model calls (64 async threads, the
concurrency every peer gets). Inputs: JSON lines in files of a folder (continuous FileSource);
outputs: an exactly-once FileSink committed on checkpoint. Resume: see `_flink.py`.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# Before anything of PyFlink is imported: the embedded (Pemja) interpreter that runs the
# actions finds the agent module and the venv's packages through PYTHONPATH.
os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), sysconfig.get_paths()["purelib"]])

import _common as c  # noqa: E402
import _flink as fl  # noqa: E402


def main() -> None:
    a = c.peer_args()
    wd: Path = a.workdir
    wd.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.url:
        os.environ["PEER_MODEL_URL"] = a.url
    import _flink_agents_agents as agents
    from flink_agents.api.core_options import AgentExecutionOptions
    from flink_agents.api.execution_environment import AgentsExecutionEnvironment
    from pyflink.common import Types

    n = a.n
    if a.workload == "w1":
        n = n or c.W1_INPUTS
        fl.write_inputs(wd, "part-0.jsonl", c.w1_inputs(n))
        agent, want = agents.ThreeSteps(), n
    elif a.workload == "w2":
        n = n or c.W2_INPUTS
        fl.write_inputs(wd, "part-0.jsonl", c.w2_inputs(n))
        agent, want = agents.SlowCall(), n
    elif a.workload == "w3":
        if not (wd / "in").exists():
            fl.write_inputs(wd, "part-0.jsonl", c.w3_inputs(n or c.W3_INPUTS))
        agent, want = agents.TwoCalls(), n or c.W3_INPUTS
    elif a.workload == "w4-seed":
        fl.write_inputs(wd, "part-0.jsonl", c.w4_inputs(n or c.W4_KEYS))
        agent, want = agents.Keyed(), n or c.W4_KEYS
    else:  # w4-resume: one new input in a new file
        new = c.w4_new_input()
        fl.write_inputs(wd, f"{new['id']}.jsonl", [new])
        agent, want = agents.Keyed(), new["id"]

    env = fl.environment(wd)
    agents_env = AgentsExecutionEnvironment.get_execution_environment(env=env)
    agents_env.get_config().set(AgentExecutionOptions.NUM_ASYNC_THREADS, c.CONCURRENCY)
    inputs = fl.source(env, wd).map(json.loads).uid("parse")
    outputs = (
        agents_env.from_datastream(input=inputs, key_selector=lambda x: x["key"])
        .apply(agent)
        .to_datastream()
    )
    fl.sink(outputs.map(json.dumps, output_type=Types.STRING()).uid("dump"), wd)
    job = env.execute_async(f"flink-agents-{a.workload}")
    first, done = fl.wait_outputs(wd, want, timeout=600)
    result = {"inputs": n, "wall_s": (done - t0) if done else None,
              "first_output_s": (first - t0) if first else None,
              "first_to_last_s": (done - first) if done and first else None}  # fmt: skip
    fl.finish(job, result, a.workload, n, done, wd)


if __name__ == "__main__":
    main()
