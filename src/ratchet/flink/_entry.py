"""The job script `ratchet flink run --jobmanager` hands to Flink's `flink run -py`.

`flink run` executes it with a context environment bound to the cluster; argv[1] is the
job description as JSON (written by `ratchet.cli._flink`).
"""

from __future__ import annotations

import json
import os
import sys

from pyflink.common import Configuration
from pyflink.datastream import StreamExecutionEnvironment

from ratchet.connectors._pg_journal import DSN_ENV
from ratchet.flink._config import FlinkConfig
from ratchet.flink._job import build_job
from ratchet.runtime._flink_core import CoreConfig


def main(argv: list[str]) -> None:
    spec = json.loads(argv[1])
    cfg = spec["config"]
    cfg["core"] = CoreConfig(**cfg["core"])
    # The journal's URI comes through the environment (it may hold a password), not argv.
    cfg["call_journal"] = os.environ.get(DSN_ENV) or None
    config = FlinkConfig(**cfg)
    conf = Configuration()
    for k, v in config.to_flink().items():
        conf.set_string(k, v)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    env.configure(conf)
    env.set_parallelism(config.parallelism)
    build_job(
        env,
        spec["agent"],
        spec["input"],
        spec["output"],
        key_field=spec["key"],
        config=config,
        follow_ms=spec["follow_ms"],
        memory_dir=spec["memory_dir"],
        on_bad_input=spec.get("on_bad_input", "stop"),
    )
    env.execute(spec["name"])


if __name__ == "__main__":
    main(sys.argv)
