"""What a run asks of the outside world, passed in rather than patched.

`Seams` bundles the clock, the random source for run ids, the prober (input and log
hashing), the executor (runs a stage's command), the receipt writer (whole receipts), the
receipt journal's appender (one record per change of state), the scheduler's waiter and the
environment fingerprint. Production uses the defaults; a test passes fakes, e.g.
`Seams(clock=FakeClock(), executor=my_fake, rng=random.Random(1))`.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet.checks._execute import SubprocessExecutor
from ratchet.checks._explain import ManifestSource
from ratchet.checks._receipts import JournalAppender, ReceiptWriter, append_record
from ratchet.checks._signing import SECRET_ENV
from ratchet.checks._threads import StageFuture
from ratchet.checks._threads import wait as _stage_wait
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
    """`concurrent.futures.wait`'s signature: the scheduler's pause between two looks at
    the run. With the default (`ratchet.checks._threads.wait`) the scheduler runs stages
    on its own light pool; with any other waiter, on a `ThreadPoolExecutor`, so the
    futures it is given are `concurrent.futures.Future`s."""

    def __call__(
        self,
        fs: Iterable[StageFuture],
        timeout: float | None = ...,
        return_when: str = ...,
    ) -> tuple[set[StageFuture], set[StageFuture]]: ...


def extra_env_keys() -> list[str]:
    """The names RATCHET_ENV_KEYS adds to the fingerprint (never the signing key's)."""
    names = os.environ.get("RATCHET_ENV_KEYS", "").split(",")
    return [k.strip() for k in names if k.strip() and k.strip() not in SECRET_ENV]


_IMPLEMENTATIONS = {"cpython": "CPython", "pypy": "PyPy"}


def _implementation() -> str:
    """`platform.python_implementation()` without importing `platform` (a few ms at start-up
    of every `ratchet checks`)."""
    name = _IMPLEMENTATIONS.get(sys.implementation.name)
    if name is None:
        import platform

        name = platform.python_implementation()
    return name


def _uname() -> Any:
    """`os.uname()` where there is one: `platform.system()` and `platform.machine()` read the
    same fields."""
    if hasattr(os, "uname"):
        return os.uname()
    import platform

    return platform.uname()


def environment_fingerprint() -> dict[str, str]:
    """What of the machine enters every cache key: the interpreter, platform, chosen env vars."""
    env = {
        "python": sys.version,
        "implementation": _implementation(),
        "executable": sys.executable,
        "machine": _uname().machine,
        "system": _uname().sysname,
    }
    for key in (*ENV_KEYS, *extra_env_keys()):
        if key in os.environ:
            env[f"env:{key}"] = os.environ[key]
    return env


def _atomic_json(path: Path, payload: dict[str, Any]) -> None:
    atomic_json(path, payload)


_FRESH: Any = object()  # the default of a field whose production value is made per instance


class Seams:
    """A run's collaborators; every field has the production default.

    Immutable, like the frozen dataclass it was; a plain class because `dataclasses`
    imports `inspect`, which every `ratchet checks` start-up would pay for."""

    __slots__ = (
        "clock",
        "rng",
        "prober",
        "executor",
        "writer",
        "journal",
        "waiter",
        "environment",
    )
    clock: Clock
    rng: random.Random
    prober: ProberFactory
    executor: Executor
    writer: ReceiptWriter
    # None: no journal; every change of state rewrites the whole receipt through `writer`.
    journal: JournalAppender | None
    waiter: Waiter
    environment: Callable[[], Mapping[str, str] | str]

    def __init__(
        self,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random = _FRESH,
        prober: ProberFactory = Checkpoints,
        executor: Executor = _FRESH,
        writer: ReceiptWriter = _atomic_json,
        journal: JournalAppender | None = append_record,
        waiter: Waiter = _stage_wait,
        environment: Callable[[], Mapping[str, str] | str] = environment_fingerprint,
    ) -> None:
        values = {
            "clock": clock,
            "rng": random.SystemRandom() if rng is _FRESH else rng,
            "prober": prober,
            "executor": SubprocessExecutor() if executor is _FRESH else executor,
            "writer": writer,
            "journal": journal,
            "waiter": waiter,
            "environment": environment,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Seams is immutable: cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Seams is immutable: cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Seams)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"Seams({fields})"
