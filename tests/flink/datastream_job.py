"""`python datastream_job.py native|compat`: a PyFlink DataStream job through
`ratchet.flink.AgentsEnvironment` or through the compatibility package's
`AgentsExecutionEnvironment.get_execution_environment(env)`; prints each output line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pyflink.common import Types
from pyflink.datastream import StreamExecutionEnvironment

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import datastream_agents as agents  # noqa: E402

ROWS = [{"user": f"u{i % 3}", "i": i} for i in range(9)]


def user_of(row: dict) -> str:
    return str(row["user"])


def main(mode: str) -> None:
    env = StreamExecutionEnvironment.get_execution_environment()
    env.set_parallelism(1)
    env.set_python_executable(sys.executable)  # the workers run this venv's Python
    env.add_python_file(str(HERE / "datastream_agents.py"))
    lines = env.from_collection([json.dumps(r) for r in ROWS], type_info=Types.STRING())
    rows = lines.map(json.loads, output_type=Types.PICKLED_BYTE_ARRAY())
    if mode == "native":
        from ratchet.flink import AgentsEnvironment

        out = AgentsEnvironment(env).from_datastream(rows, user_of).apply(agents.NativeCounter())
    else:
        from ratchet.compat.flink_agents.api.execution_environment import (
            AgentsExecutionEnvironment,
        )

        fa_env = AgentsExecutionEnvironment.get_execution_environment(env)
        out = fa_env.from_datastream(rows, user_of).apply(agents.CompatCounter())
    with out.to_datastream().execute_and_collect() as results:
        for line in results:
            print(json.dumps(json.loads(line)["output"], sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1])
