"""ratchet agents on Apache Flink (PyFlink, process mode): `pip install ratchet[flink]`.

The same `Agent` classes as the embedded engine, the same run machine; state in Flink keyed
state, checkpoints by Flink, outputs through the exactly-once file sink. See docs/flink.md.
"""

from ratchet.flink._config import FlinkConfig
from ratchet.flink._function import (
    END_OF_INPUT,
    MEMORY_TAG,
    PROGRESS_TAG,
    AgentFunction,
    ParseLines,
)
from ratchet.flink._job import (
    AgentsEnvironment,
    apply_agent,
    build_job,
    count_progress,
    environment,
    file_sink,
)
from ratchet.runtime._flink_core import CoreConfig
from ratchet.runtime._flink_files import decode_memory_line, latest_memories, read_output_dir
from ratchet.runtime._journal import decode_memory, encode_memory

__all__ = [
    "END_OF_INPUT",
    "MEMORY_TAG",
    "PROGRESS_TAG",
    "count_progress",
    "AgentFunction",
    "AgentsEnvironment",
    "CoreConfig",
    "FlinkConfig",
    "ParseLines",
    "apply_agent",
    "build_job",
    "decode_memory",
    "decode_memory_line",
    "encode_memory",
    "environment",
    "file_sink",
    "latest_memories",
    "read_output_dir",
]
