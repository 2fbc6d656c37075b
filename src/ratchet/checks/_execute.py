"""Running a stage's command: its own process group, its log, its timeout.

Each command runs in a new session so that a timeout, or an interrupted run, kills the
whole group: nothing a stage started outlives the stage's resource locks. The runner
reaches this module only through an `Executor` (`_seams`), so tests substitute a fake.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from ratchet.checks._errors import StageTimeoutError

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    import subprocess
    from typing import Any

__all__ = [
    "RunStoppedError",
    "SubprocessExecutor",
    "execute_stage_command",
    "kill_live_processes",
]


class RunStoppedError(RuntimeError):
    """A stage was about to start after the run was interrupted."""


_LIVE: set[subprocess.Popen[bytes]] = set()
_LIVE_GUARD = threading.Lock()
# Set by `SubprocessExecutor.run` for the worker thread: told each command's pid (= its
# process group, since it leads a new session) once it started.
_STARTED = threading.local()
PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[[int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl: Callable[[int, int], int] = libc.prctl
    except (OSError, AttributeError):
        return None
    return prctl


# Loaded (with ctypes) before the first stage command starts, in the parent: a no-op run
# starts none, so it never pays for importing ctypes.
_PRCTL: Callable[[int, int], int] | None = None
_PRCTL_LOADED = False
_PRCTL_GUARD = threading.Lock()


def _prctl() -> Callable[[int, int], int] | None:
    global _PRCTL, _PRCTL_LOADED
    with _PRCTL_GUARD:
        if not _PRCTL_LOADED:
            _PRCTL, _PRCTL_LOADED = _load_prctl(), True
        return _PRCTL


def _child_setup() -> None:
    """In the forked child, before exec: die with SIGKILL when the ratchet thread that
    started it dies, so a killed ratchet does not leave its stage running."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL))


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def execute_stage_command(
    stage: Mapping[str, Any],
    *,
    cwd: Path,
    log_path: Path,
    timeout: float | None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run one stage's argv in its own process group; stdout+stderr go to `log_path` as is.

    Returns the exit code. On timeout the whole process group is killed and
    StageTimeoutError is raised; leftovers of a finished stage are killed too, so nothing
    outlives the stage's resource locks.
    """
    import subprocess  # when the first stage command starts: a no-op run starts none

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(stage["argv"]),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(env) if env is not None else None,
            preexec_fn=_child_setup if _prctl() is not None else None,
        )
        with _LIVE_GUARD:
            _LIVE.add(proc)
        hook = getattr(_STARTED, "hook", None)
        if hook is not None:
            with contextlib.suppress(Exception):
                hook(proc.pid)
        try:
            try:
                # The kernel times the wait: a stage's timeout is real time by nature.
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
                raise StageTimeoutError(
                    f"stage {stage['id']!r} timed out after {timeout:g} s; "
                    "its process group was killed"
                ) from None
        finally:
            _kill_group(proc)
            with _LIVE_GUARD:
                _LIVE.discard(proc)


def kill_live_processes() -> None:
    """Kill the process group of every stage command running in this process."""
    with _LIVE_GUARD:
        procs = list(_LIVE)
    for proc in procs:
        _kill_group(proc)


class SubprocessExecutor:
    """The real executor: `command` (default `execute_stage_command`) runs a stage, and
    `kill_all` ends every live stage process of an interrupted run."""

    __slots__ = ("_command", "_stopped")

    def __init__(self, command: Callable[..., int] | None = None) -> None:
        self._command = command or execute_stage_command
        self._stopped = False

    def run(
        self,
        stage: Mapping[str, Any],
        *,
        cwd: Path,
        log_path: Path,
        timeout: float | None,
        env: Mapping[str, str] | None,
        on_start: Callable[[int], None] | None = None,
    ) -> int:
        """Run the stage; `on_start(pgid)` is called once its process group exists."""
        if self._stopped:
            raise RunStoppedError("the run was interrupted before this stage started")
        _STARTED.hook = on_start
        try:
            return self._command(stage, cwd=cwd, log_path=log_path, timeout=timeout, env=env)
        finally:
            _STARTED.hook = None

    def kill_all(self) -> None:
        self._stopped = True
        kill_live_processes()
