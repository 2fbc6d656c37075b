"""Waiting on and killing the `ratchet run` subprocesses of kill tests."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL `proc` and reap it (it must die by the signal, not exit first)."""
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def wait_for(
    cond: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, limit: float = 30
) -> None:
    """Poll `cond` until true; fail with the agent's stderr if it exits first, or kill it and
    fail after `limit` seconds."""
    deadline = time.monotonic() + limit
    while not cond():
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(
                f"agent exited ({proc.returncode}) before {what}: {err.decode()[-2000:]}"
            )
        if time.monotonic() > deadline:
            kill(proc)
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
