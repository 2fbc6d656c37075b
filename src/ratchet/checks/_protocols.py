"""The interfaces a run's collaborators implement, as `typing.Protocol` classes.

Kept apart from the modules that use them because defining a Protocol imports `typing`,
which a `ratchet checks` start-up otherwise never needs (2-3 ms of every command line):
those modules import these names only for the type checker, and `ratchet.checks` (and
`ratchet.checks._seams`) build them on first use.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ratchet._clock import Clock

__all__ = [
    "Executor",
    "ManifestSource",
    "Progress",
    "Prober",
    "ProberFactory",
    "StageFuture",
    "Waiter",
]


class ManifestSource(Protocol):
    """Where the manifests recorded by digest are found (`Checkpoints` is one)."""

    def stored_manifest(self, digest: str) -> dict[str, str] | None: ...


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


class StageFuture(Protocol):
    """What the scheduler asks of a submitted call: a `Task` or a `concurrent.futures.Future`."""

    def done(self) -> bool: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...


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


class Progress(Protocol):
    """What the scheduler reports to after each look at the run (`LiveProgress`)."""

    @property
    def active(self) -> bool:
        """False when nothing is shown: the scheduler then never gathers the records."""
        ...

    def update(self, records: Sequence[Mapping[str, Any]]) -> None: ...
