"""Ratchet agents as PyFlink jobs: the DataStream API and the job `ratchet flink run` submits."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyflink.common import Configuration, Duration, Types, WatermarkStrategy
from pyflink.common.serialization import Encoder
from pyflink.datastream import DataStream, KeyedStream, StreamExecutionEnvironment
from pyflink.datastream.connectors.file_system import (
    BucketAssigner,
    FileSink,
    FileSource,
    OutputFileConfig,
    RollingPolicy,
    StreamFormat,
)

from ratchet._errors import ConfigError
from ratchet.flink._config import FlinkConfig
from ratchet.flink._function import (
    BAD_INPUT_TAG,
    MEMORY_TAG,
    PROGRESS_TAG,
    AgentFunction,
    ParseLines,
)
from ratchet.runtime._flink_files import read_output_dir

log = logging.getLogger("ratchet.flink")

BAD_INPUT_DIR = "_bad-input"  # under the output folder: bad lines kept (--on-bad-input dead-letter)


def environment(
    config: FlinkConfig | None = None, jobmanager: str | None = None
) -> StreamExecutionEnvironment:
    """A StreamExecutionEnvironment configured for ratchet: a local mini-cluster, or the
    cluster whose REST endpoint is `jobmanager` ("host:port")."""
    config = config or FlinkConfig()
    # PyFlink runs a mini-cluster's Python workers inside the client process ("loopback")
    # unless told otherwise; separate worker processes behave like a cluster's, and a worker
    # that dies does not take the client with it.
    os.environ.setdefault("_python_worker_execution_mode", "process")
    conf = Configuration()
    for k, v in config.to_flink().items():
        conf.set_string(k, v)
    if jobmanager:
        host, sep, port = jobmanager.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"--jobmanager {jobmanager!r} must look like host:port")
        conf.set_string("execution.target", "remote")
        conf.set_string("rest.address", host)
        conf.set_string("rest.port", port)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    env.set_parallelism(config.parallelism)
    return env


def apply_agent(
    stream: DataStream,
    agent: Any,
    key_selector: Any = None,
    *,
    config: FlinkConfig | None = None,
    agent_config: dict[str, Any] | None = None,
    uid: str = "ratchet-agent",
    emit_memory: bool = False,
    emit_progress: bool = False,
    _json_pairs: bool = False,
    _emit_admissions: bool = False,
) -> DataStream:
    """Apply a ratchet `Agent` to a DataStream (or KeyedStream); returns the outputs stream.

    `agent`: an Agent instance or a `module:Class` / `file.py:Class` spec (loaded in the Python
    workers). `key_selector`: element -> key (a str); not needed for a KeyedStream. Each
    element is an input value (what `InputEvent.input` holds); it must be codec-admissible.
    The result is a DataStream of JSON lines, one per output, as the embedded engine's JSONL
    sink writes them. With `emit_memory`, `result.get_side_output(MEMORY_TAG)` carries every
    key's final memory at the end of a bounded input; with `emit_progress`,
    `result.get_side_output(PROGRESS_TAG)` one line per finished run.
    """
    config = config or FlinkConfig()
    if isinstance(stream, KeyedStream):
        if key_selector is not None:
            raise ConfigError("the stream is already keyed; pass no key_selector")
        keyed = stream
    else:
        if key_selector is None:
            raise ConfigError("apply_agent() needs a key_selector for an unkeyed DataStream")
        keyed = stream.key_by(key_selector, key_type=Types.STRING())
    fn = AgentFunction(
        agent,
        config.core,
        agent_config,
        _json_pairs,
        emit_memory,
        emit_progress,
        journal=(config.call_journal, config.journal_namespace or "")
        if config.call_journal
        else None,
        emit_admissions=_emit_admissions,
    )
    return keyed.process(fn, output_type=Types.STRING()).uid(uid).name(f"ratchet agent ({uid})")


class AgentsEnvironment:
    """The Flink Agents-style entry point::

    env = AgentsEnvironment(StreamExecutionEnvironment.get_execution_environment())
    out = env.from_datastream(ds, key_selector=lambda r: r["user"]).apply(MyAgent()).to_datastream()
    env.execute()
    """

    def __init__(self, env: StreamExecutionEnvironment, config: FlinkConfig | None = None) -> None:
        self.env = env
        self.config = config or FlinkConfig()

    def from_datastream(self, stream: DataStream, key_selector: Any = None) -> _AgentBuilder:
        return _AgentBuilder(self, stream, key_selector)

    def execute(self, job_name: str = "ratchet") -> Any:
        return self.env.execute(job_name)


@dataclass
class _AgentBuilder:
    owner: AgentsEnvironment
    stream: DataStream
    key_selector: Any
    agent: Any = None

    def apply(self, agent: Any) -> _AgentBuilder:
        self.agent = agent
        return self

    def to_datastream(self) -> DataStream:
        if self.agent is None:
            raise ConfigError("call .apply(agent) before .to_datastream()")
        return apply_agent(self.stream, self.agent, self.key_selector, config=self.owner.config)


def file_sink(directory: str | os.PathLike[str], prefix: str = "part") -> FileSink:
    """Exactly-once JSONL files in `directory`: part files are committed by checkpoints
    (in-progress files are hidden, `.part-*`, and never read as outputs)."""
    return (
        FileSink.for_row_format(str(Path(directory).resolve()), Encoder.simple_string_encoder())
        .with_bucket_assigner(BucketAssigner.base_path_bucket_assigner())
        .with_rolling_policy(RollingPolicy.on_checkpoint_rolling_policy())
        .with_output_file_config(
            OutputFileConfig.builder().with_part_prefix(prefix).with_part_suffix(".jsonl").build()
        )
        .build()
    )


def count_progress(directory: str | os.PathLike[str]) -> int:
    """How many distinct runs a progress folder (`build_job(progress_dir=...)`) says are done,
    counting committed part files only."""
    return len(_progress(directory)[1])


def count_admitted_progress(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """(inputs admitted, of those the runs done) by the job writing a progress folder with
    `progress_admissions=True`, counting committed part files only. A job restored from a
    savepoint also finishes runs the savepoint held; only its own inputs count here."""
    admitted, done = _progress(directory)
    return len(admitted), len(admitted & done)


def _progress(
    directory: str | os.PathLike[str],
) -> tuple[set[tuple[Any, int]], set[tuple[Any, int]]]:
    admitted: set[tuple[Any, int]] = set()
    done: set[tuple[Any, int]] = set()
    for rec in read_output_dir(directory):
        (admitted if rec.get("in") else done).add((rec["key"], rec["seq"]))
    return admitted, done


def build_job(
    env: StreamExecutionEnvironment,
    agent: str | Any,
    input_path: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    key_field: str = "key",
    config: FlinkConfig | None = None,
    follow_ms: int | None = None,
    memory_dir: str | os.PathLike[str] | None = None,
    agent_config: dict[str, Any] | None = None,
    on_bad_input: str = "stop",
    progress_dir: str | os.PathLike[str] | None = None,
    emit_progress: bool = True,
    progress_admissions: bool = False,
) -> None:
    """Source (JSONL file or folder) -> parse -> agent -> exactly-once file sink, with uids.

    With `progress_dir`, one line per finished run goes there through its own exactly-once
    sink (`count_progress` reads it): how `ratchet flink run` knows a job's inputs are done.
    `emit_progress=False` keeps that sink (a savepoint that holds its state can be restored)
    and writes nothing to it; `progress_admissions` adds a line per admitted input
    (`count_admitted_progress`).

    With `on_bad_input="dead-letter"` bad lines go to `output_dir/_bad-input/` (part files
    prefixed `bad-input`); `read_output_dir` does not read that folder as outputs."""
    config = config or FlinkConfig()
    src_path = Path(input_path).resolve()
    if not src_path.exists() and follow_ms is None:
        raise ConfigError(f"--input {src_path} does not exist")
    builder = FileSource.for_record_stream_format(StreamFormat.text_line_format(), str(src_path))
    if follow_ms is not None:
        builder = builder.monitor_continuously(Duration.of_millis(follow_ms))
    ds = env.from_source(builder.build(), WatermarkStrategy.no_watermarks(), "ratchet input")
    ds = ds.uid("ratchet-source")
    pairs = (
        ds.process(
            ParseLines(key_field, on_bad_input, str(src_path)),
            output_type=Types.TUPLE([Types.STRING(), Types.STRING()]),
        )
        .uid("ratchet-parse")
        .name("parse JSONL")
    )
    if on_bad_input == "dead-letter":
        pairs.get_side_output(BAD_INPUT_TAG).sink_to(
            file_sink(Path(output_dir) / BAD_INPUT_DIR, "bad-input")
        ).uid("ratchet-bad-input-sink").name("bad input")
    outputs = apply_agent(
        pairs,
        agent,
        lambda pair: pair[0],
        config=config,
        agent_config=agent_config,
        emit_memory=memory_dir is not None,
        emit_progress=progress_dir is not None and emit_progress,
        _emit_admissions=progress_dir is not None and emit_progress and progress_admissions,
        _json_pairs=True,
    )
    outputs.sink_to(file_sink(output_dir)).uid("ratchet-sink").name("outputs")
    if progress_dir is not None:
        outputs.get_side_output(PROGRESS_TAG).sink_to(file_sink(progress_dir, "progress")).uid(
            "ratchet-progress-sink"
        ).name("progress")
    if memory_dir is not None:
        outputs.get_side_output(MEMORY_TAG).sink_to(file_sink(memory_dir, "memory")).uid(
            "ratchet-memory-sink"
        ).name("memory")
