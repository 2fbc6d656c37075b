"""The pieces of starting a shard worker by fork: when it is refused, the start method from the
environment, and waiting for a forked child as for a `subprocess.Popen`."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from ratchet import ConfigError
from ratchet.runtime._forking import START_ENV, ForkedWorker, fork_unsafe, start_method

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="fork start is Linux only")


def test_start_method_defaults_to_fork_and_takes_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(START_ENV, raising=False)
    assert start_method() == "fork"
    monkeypatch.setenv(START_ENV, " EXEC ")
    assert start_method() == "exec"
    monkeypatch.setenv(START_ENV, "")
    assert start_method() == "fork"


def test_an_unknown_start_method_names_the_variable_and_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(START_ENV, "forkserver")
    with pytest.raises(ConfigError, match=r"RATCHET_WORKER_START='forkserver' .*'fork'.*'exec'"):
        start_method()


@linux_only
def test_fork_is_refused_while_another_thread_runs() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="held-lock-maybe", daemon=True)
    t.start()
    try:
        why = fork_unsafe()
    finally:
        stop.set()
        t.join()
    assert why is not None and "held-lock-maybe" in why


def _child(then: int | None) -> int:
    """Fork a child that exits with `then`, or waits to be killed (None)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        if then is None:
            time.sleep(60)
        os._exit(then or 0)
    return pid


@linux_only
def test_a_forked_worker_is_waited_for_as_a_popen() -> None:
    done = ForkedWorker(_child(3))
    assert done.wait() == 3 and done.returncode == 3
    assert done.poll() == 3
    done.kill()  # reaped: the pid is not signalled again

    running = ForkedWorker(_child(None))
    assert running.poll() is None
    running.kill()
    assert running.wait() == -signal.SIGKILL
    assert running.poll() == -signal.SIGKILL
