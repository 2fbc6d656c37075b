"""What a run asks of the outside world, passed in rather than patched.

`Seams` bundles the clock, the random source for run ids, the prober (input and log
hashing), the executor (runs a stage's command), the receipt writer (whole receipts), the
receipt journal's appender (one record per change of state), the scheduler's waiter and the
environment fingerprint. Production uses the defaults; a test passes fakes, e.g.
`Seams(clock=FakeClock(), executor=my_fake, rng=random.Random(1))`.
"""

from __future__ import annotations

import os
import platform
import random
import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as _futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet.checks._execute import SubprocessExecutor
from ratchet.checks._explain import ManifestSource
from ratchet.checks._receipts import JournalAppender, ReceiptWriter, append_record
from ratchet.checks._signing import SECRET_ENV
from ratchet.checks.checkpoints import Checkpoints
from ratchet.checks.common import atomic_json

__all__ = [
    "ENV_KEYS",
    "Executor",
    "Prober",
    "ProberFactory",
    "ReceiptWriter",
    "Seams",
    "Waiter",
    "environment_fingerprint",
    "extra_env_keys",
]

# Environment variables that enter every cache key; RATCHET_ENV_KEYS (comma-separated) adds more.
ENV_KEYS = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LANG", "LC_ALL", "TZ")


class Prober(ManifestSource, Protocol):
    """Hashes a stage's declared inputs and a log: the evidence every decision rests on.

    `command_started`/`command_finished` bracket each command, so a prober that memoises
    digests knows when they may have gone stale; `forget` drops every memo.
    """

    def scope(self, stage: Mapping[str, Any]) -> list[str]: ...

    def identity(self, stage: Mapping[str, Any]) -> Any: ...

    def snapshot_identity(self, stage: Mapping[str, Any]) -> Any: ...

    def source_identity(self) -> Any: ...

    def log_digest(self, path: str | os.PathLike[str]) -> str: ...

    def command_started(self) -> None: ...

    def command_finished(self) -> None: ...

    def forget(self) -> None: ...


class ProberFactory(Protocol):
    """Builds a run's prober (`Checkpoints` is one)."""

    def __call__(
        self,
        workspace_root: Path,
        repositories: Mapping[str, Path],
        state_dir: Path,
        *,
        clock: Clock,
    ) -> Prober: ...


class Executor(Protocol):
    """Runs a stage's command with its output in `log_path`; returns the exit code.

    On timeout it raises StageTimeoutError; `kill_all` stops every command it is running
    (the run was interrupted).
    """

    def run(
        self,
        stage: Mapping[str, Any],
        *,
        cwd: Path,
        log_path: Path,
        timeout: float | None,
        env: Mapping[str, str] | None,
    ) -> int: ...

    def kill_all(self) -> None: ...


class Waiter(Protocol):
    """`concurrent.futures.wait`: the scheduler's pause between two looks at the run."""

    def __call__(
        self,
        fs: Iterable[Future[None]],
        timeout: float | None = ...,
        return_when: str = ...,
    ) -> tuple[set[Future[None]], set[Future[None]]]: ...


def extra_env_keys() -> list[str]:
    """The names RATCHET_ENV_KEYS adds to the fingerprint (never the signing key's)."""
    names = os.environ.get("RATCHET_ENV_KEYS", "").split(",")
    return [k.strip() for k in names if k.strip() and k.strip() not in SECRET_ENV]


def environment_fingerprint() -> dict[str, str]:
    """What of the machine enters every cache key: the interpreter, platform, chosen env vars."""
    env = {
        "python": sys.version,
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "machine": platform.machine(),
        "system": platform.system(),
    }
    for key in (*ENV_KEYS, *extra_env_keys()):
        if key in os.environ:
            env[f"env:{key}"] = os.environ[key]
    return env


def _atomic_json(path: Path, payload: dict[str, Any]) -> None:
    atomic_json(path, payload)


@dataclass(frozen=True)
class Seams:
    """A run's collaborators; every field has the production default."""

    clock: Clock = SYSTEM_CLOCK
    rng: random.Random = field(default_factory=random.SystemRandom)
    prober: ProberFactory = Checkpoints
    executor: Executor = field(default_factory=SubprocessExecutor)
    writer: ReceiptWriter = _atomic_json
    # None: no journal; every change of state rewrites the whole receipt through `writer`.
    journal: JournalAppender | None = append_record
    waiter: Waiter = _futures_wait
    environment: Callable[[], Mapping[str, str] | str] = environment_fingerprint
