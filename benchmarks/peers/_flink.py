"""What the two Flink peers share: a local mini-cluster with checkpointing on, a continuous
file source (a finished bounded job deletes its retained checkpoints, and Flink Agents 0.2.0
does not support bounded sources), an exactly-once FileSink committed on each checkpoint,
restore from the newest completed checkpoint, and waiting for outputs.

Resuming after a kill, as a Flink user does it: find the newest `chk-N` that has a
`_metadata` file under the checkpoint folder and start the same job with
`execution.state-recovery.path` pointing at it (`newest_checkpoint` below); new inputs go
into new files of the input folder (the source remembers the files it has read).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import _common as c
from pyflink.common import Configuration, Encoder, Types, WatermarkStrategy
from pyflink.datastream import RuntimeExecutionMode, StreamExecutionEnvironment
from pyflink.datastream.connectors.file_system import (
    FileSink,
    FileSource,
    RollingPolicy,
    StreamFormat,
)

CHECKPOINT_MS = 1000


def newest_checkpoint(chk_root: Path) -> Path | None:
    found = [p.parent for p in chk_root.glob("*/chk-*/_metadata")]
    if not found:
        return None
    return max(found, key=lambda p: (p.stat().st_mtime, int(p.name.split("-")[1])))


def environment(wd: Path, extra: dict[str, str] | None = None) -> StreamExecutionEnvironment:
    here = str(Path(__file__).resolve().parent)
    # An inherited PYTHONPATH stays (after this folder): `PYTHONPATH=<worktree>/src` runs the
    # Python workers on that checkout's ratchet rather than the venv's editable install.
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *inherited, sysconfig.get_paths()["purelib"]])
    tmp = wd / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = Configuration()
    settings = {
        "execution.checkpointing.interval": f"{CHECKPOINT_MS}ms",
        "execution.checkpointing.storage": "filesystem",
        "execution.checkpointing.dir": f"file://{wd / 'chk'}",
        "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
        "execution.checkpointing.num-retained": "2",
        "state.backend.type": "hashmap",
        "restart-strategy.type": "disable",
        "python.executable": sys.executable,
        "python.client.executable": sys.executable,
        "io.tmp.dirs": str(tmp),
        "env.java.opts.all": f"-Djava.io.tmpdir={tmp}",
        "python.fn-execution.bundle.time": "10",
        "execution.buffer-timeout.interval": "5ms",
        # Aligned checkpoints stall behind slow records (model calls); unaligned ones do not.
        "execution.checkpointing.unaligned.enabled": "true",
        "parallelism.default": "1",
    }
    restore = newest_checkpoint(wd / "chk")
    if restore is not None:
        settings["execution.state-recovery.path"] = f"file://{restore}"
    settings.update(extra or {})
    for k, v in settings.items():
        cfg.set_string(k, v)
    env = StreamExecutionEnvironment.get_execution_environment(cfg)
    env.set_runtime_mode(RuntimeExecutionMode.STREAMING)
    env.set_parallelism(1)
    return env


def source(env: StreamExecutionEnvironment, wd: Path) -> Any:
    from pyflink.common import Duration

    src = (
        FileSource.for_record_stream_format(StreamFormat.text_line_format(), str(wd / "in"))
        .monitor_continuously(Duration.of_millis(200))
        .build()
    )
    return env.from_source(src, WatermarkStrategy.no_watermarks(), "inputs").uid("inputs")


def sink(stream: Any, wd: Path) -> None:
    out = (
        FileSink.for_row_format(str(wd / "out"), Encoder.simple_string_encoder())
        .with_rolling_policy(RollingPolicy.on_checkpoint_rolling_policy())
        .build()
    )
    stream.map(lambda x: x, output_type=Types.STRING()).sink_to(out).uid("outputs")


def write_inputs(wd: Path, name: str, rows: list[dict[str, Any]]) -> None:
    """Write a new input file atomically (the source must never see half a file)."""
    d = wd / "in"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{name}.tmp"
    c.write_jsonl(tmp, rows)
    tmp.rename(d / name)


def wait_outputs(
    wd: Path, want: int | str, timeout: float, stall: float = 120
) -> tuple[float | None, float | None]:
    """Poll the committed part files: (time of the first output, time `want` was reached)."""
    deadline = time.monotonic() + timeout
    first = None
    last_n, last_change = -1, time.monotonic()
    tail = c.OutputTail(wd / "out")  # reads only new lines: no CPU taken from the job measured
    while time.monotonic() < deadline:
        done = tail.has(want)
        if tail.total and first is None:
            first = time.perf_counter()
        if done:
            return first, time.perf_counter()
        if tail.total != last_n:
            last_n, last_change = tail.total, time.monotonic()
        elif tail.total and time.monotonic() - last_change > stall:
            break
        time.sleep(0.01)
    return first, None


def finish(job: Any, result: dict[str, Any], workload: str, n: int, done: Any, wd: Path) -> None:
    """Report a Flink peer's result (with its retained-checkpoint size for workload 1), cancel
    the job, and leave without waiting for PyFlink's shutdown."""
    if workload == "w1" and done:
        result["steps"] = 3 * n
        time.sleep(CHECKPOINT_MS / 1000 * 1.5)  # the state as of a checkpoint after the end
        result["state_bytes"] = c.dir_bytes(wd / "chk")
    if done is None:
        result["error"] = f"only {len(c.output_ids(wd / 'out'))} outputs"
    c.emit(result)
    try:
        job.cancel()
    except Exception:  # noqa: BLE001 - the driver ends the process group anyway
        pass
    os._exit(0)
