"""Configuration of ratchet jobs on Flink, as Flink configuration keys (no PyFlink import)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ratchet._errors import ConfigError
from ratchet.runtime._flink_core import CoreConfig
from ratchet.runtime._flink_savepoint import MODE_ENV, MODES

_BACKENDS = ("rocksdb", "hashmap")
_RESTARTS = ("fixed-delay", "exponential-delay", "none")


def _default_mode() -> str:
    # The environment variable lets a whole test suite or benchmark run in one mode.
    return os.environ.get(MODE_ENV, "process")


@dataclass
class FlinkConfig:
    """What `ratchet.flink` sets on the Flink environment. Times are in milliseconds.

    `extra` is passed through verbatim (any Flink key) and wins over everything else.
    """

    checkpoint_interval_ms: int = 1000
    state_backend: str = "rocksdb"
    checkpoint_dir: str | None = None
    parallelism: int = 1
    restart_strategy: str = "fixed-delay"
    restart_attempts: int = 10
    restart_delay_ms: int = 1000
    unaligned_checkpoints: bool = True
    tolerable_checkpoint_failures: int = 3
    bundle_size: int = 100
    bundle_time_ms: int = 10
    buffer_timeout_ms: int = 5
    # Where the Python functions run: "process" (separate Python workers, Beam's gRPC between
    # them and the JVM) or "thread" (Pemja, embedded in the TaskManager's JVM; docs/flink.md).
    # A job's keyed state is laid out for its mode: restore it in the same mode.
    execution_mode: str = field(default_factory=_default_mode)
    python_executable: str = field(default_factory=lambda: sys.executable)
    tmp_dir: str | None = None
    core: CoreConfig = field(default_factory=CoreConfig)
    extra: dict[str, str] = field(default_factory=dict)
    # The external durable-call journal (docs/flink.md): a PostgreSQL URI, and the namespace of
    # this job's records (stable across its restores). The URI may hold a password: it is kept
    # out of repr, and `ratchet flink run --jobmanager` hands it to the job script through the
    # environment, not its command line.
    call_journal: str | None = field(default=None, repr=False)
    journal_namespace: str | None = None

    def validate(self) -> None:
        if self.state_backend not in _BACKENDS:
            raise ConfigError(
                f"state backend {self.state_backend!r} is not one of {', '.join(_BACKENDS)}"
            )
        if self.restart_strategy not in _RESTARTS:
            raise ConfigError(
                f"restart strategy {self.restart_strategy!r} is not one of {', '.join(_RESTARTS)}"
            )
        if self.execution_mode not in MODES:
            raise ConfigError(
                f"execution mode {self.execution_mode!r} is not one of {', '.join(MODES)}"
            )
        if self.checkpoint_interval_ms < 10:
            raise ConfigError("checkpoint interval must be at least 10 ms (Flink's minimum)")
        if self.parallelism < 1:
            raise ConfigError("parallelism must be at least 1")
        if self.bundle_size < 1 or self.bundle_time_ms < 1:
            raise ConfigError("bundle size and bundle time must be at least 1")
        if self.call_journal and not self.journal_namespace:
            raise ConfigError("a call journal needs a namespace (journal_namespace)")

    def to_flink(self) -> dict[str, str]:
        """The Flink configuration keys (Flink 2.x names) this config stands for."""
        self.validate()
        conf = {
            "execution.checkpointing.interval": f"{self.checkpoint_interval_ms} ms",
            "execution.checkpointing.mode": "EXACTLY_ONCE",
            "execution.checkpointing.unaligned.enabled": str(self.unaligned_checkpoints).lower(),
            "execution.checkpointing.tolerable-failed-checkpoints": str(
                self.tolerable_checkpoint_failures
            ),
            "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
            "state.backend.type": self.state_backend,
            "parallelism.default": str(self.parallelism),
            "python.execution-mode": self.execution_mode,
            "python.executable": self.python_executable,
            "python.client.executable": self.python_executable,
            "python.fn-execution.bundle.size": str(self.bundle_size),
            "python.fn-execution.bundle.time": str(self.bundle_time_ms),
            "execution.buffer-timeout.interval": f"{self.buffer_timeout_ms} ms",
            "restart-strategy.type": self.restart_strategy,
        }
        if self.state_backend == "rocksdb":
            conf["state.backend.incremental"] = "true"
        if self.restart_strategy == "fixed-delay":
            conf["restart-strategy.fixed-delay.attempts"] = str(self.restart_attempts)
            conf["restart-strategy.fixed-delay.delay"] = f"{self.restart_delay_ms} ms"
        elif self.restart_strategy == "exponential-delay":
            conf["restart-strategy.exponential-delay.initial-backoff"] = (
                f"{self.restart_delay_ms} ms"
            )
            conf["restart-strategy.exponential-delay.attempts-before-reset-backoff"] = str(
                self.restart_attempts
            )
        if self.execution_mode == "thread":
            # The embedded interpreter starts from the base Python's paths, not the venv's:
            # without its site-packages it does not even find pemja.
            paths = _site_packages(self.python_executable)
            if paths:
                conf["python.pythonpath"] = paths
        if self.checkpoint_dir:
            conf["execution.checkpointing.storage"] = "filesystem"
            conf["execution.checkpointing.dir"] = _uri(self.checkpoint_dir)
        if self.tmp_dir:
            Path(self.tmp_dir).mkdir(parents=True, exist_ok=True)
            conf["io.tmp.dirs"] = self.tmp_dir
        conf.update(self.extra)
        return conf


def _uri(path: str) -> str:
    if "://" in path:
        return path
    return Path(path).resolve().as_uri()


def _site_packages(python: str) -> str | None:
    """The import path of the Python at `python` as its `site` makes it: its site-packages
    folders and what their `.pth` files add (an editable install of ratchet is such a line,
    which the embedded interpreter would not read: "No module named 'ratchet'"). PYTHONPATH
    is left out (the embedded interpreter reads it from the environment itself). None if the
    interpreter cannot be asked (a cluster's interpreter path need not exist on the client)."""
    import subprocess

    code = "import os, sys; print(os.pathsep.join(p for p in sys.path[1:] if p))"
    try:
        out = subprocess.run(
            [python, "-E", "-c", code], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
