"""PyFlink 2.3.0 keyed state on a local mini-cluster, checkpoints every 1 s (process mode).

Workload 1 as three chained operators: a map (the event), a KeyedProcessFunction updating a
ValueState (the per-key memory write), a map (the output); workload 4 keeps a counter and a
profile per key in ValueState. Same source, sink and resume as Flink Agents (`_flink.py`).
Workloads 2 and 3 (model calls) are Flink Agents' column: the issue compares PyFlink on the
keyed-state workloads only.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c  # noqa: E402
import _flink as fl  # noqa: E402
from pyflink.common import Types  # noqa: E402
from pyflink.datastream import KeyedProcessFunction, RuntimeContext  # noqa: E402
from pyflink.datastream.state import ValueStateDescriptor  # noqa: E402


class Remember(KeyedProcessFunction):  # type: ignore[misc]
    def open(self, ctx: RuntimeContext) -> None:
        self.v = ctx.get_state(ValueStateDescriptor("v", Types.LONG()))

    def process_element(self, value: dict[str, Any], ctx: Any) -> Any:
        self.v.update(value["mid"])
        yield value


class Keep(KeyedProcessFunction):  # type: ignore[misc]
    def open(self, ctx: RuntimeContext) -> None:
        self.count = ctx.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.profile = ctx.get_state(ValueStateDescriptor("profile", Types.PICKLED_BYTE_ARRAY()))

    def process_element(self, value: dict[str, Any], ctx: Any) -> Any:
        self.count.update((self.count.value() or 0) + 1)
        self.profile.update({"name": f"customer {value['key']}", "tier": value["v"] % 3})
        yield json.dumps({"id": value["id"]})


def main() -> None:
    a = c.peer_args()
    wd: Path = a.workdir
    wd.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n = a.n
    if a.workload == "w1":
        n = n or c.W1_INPUTS
        fl.write_inputs(wd, "part-0.jsonl", c.w1_inputs(n))
        want: int | str = n
    elif a.workload == "w4-seed":
        n = n or c.W4_KEYS
        fl.write_inputs(wd, "part-0.jsonl", c.w4_inputs(n))
        want = n
    elif a.workload == "w4-resume":
        new = c.w4_new_input()
        fl.write_inputs(wd, f"{new['id']}.jsonl", [new])
        want = new["id"]
    else:
        c.emit({"skipped": "PyFlink runs the keyed-state workloads only"})
        return
    env = fl.environment(wd)
    inputs = fl.source(env, wd).map(json.loads).uid("parse")
    if a.workload == "w1":
        out = (
            inputs.map(lambda x: {**x, "mid": x["v"]})
            .uid("one")
            .key_by(lambda x: x["key"], key_type=Types.STRING())
            .process(Remember())
            .uid("two")
            .map(lambda x: json.dumps({"id": x["id"], "v": x["mid"]}), output_type=Types.STRING())
            .uid("three")
        )
    else:
        out = (
            inputs.key_by(lambda x: x["key"], key_type=Types.STRING())
            .process(Keep(), output_type=Types.STRING())
            .uid("keep")
        )
    fl.sink(out, wd)
    job = env.execute_async(f"pyflink-{a.workload}")
    first, done = fl.wait_outputs(wd, want, timeout=600)
    result: dict[str, Any] = {
        "inputs": n,
        "wall_s": (done - t0) if done else None,
        "first_output_s": (first - t0) if first else None,
        "first_to_last_s": (done - first) if done and first else None,
    }
    fl.finish(job, result, a.workload, n, done, wd)


if __name__ == "__main__":
    main()
