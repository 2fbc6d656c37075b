"""A Python worker ends when its JVM is SIGKILLed (no cluster needed: a shell renamed `java`
stands in for the TaskManager, with the worker as its child)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from .cluster import descendants, kill_pids, running, wait_for  # noqa: E402

pytestmark = [pytest.mark.flink, pytest.mark.kill]

WORKER = """
import sys, time
from ratchet.flink._watchdog import jvm_ancestor, start_parent_watchdog
assert jvm_ancestor() is not None, "no java ancestor"
print("watching" if start_parent_watchdog(interval=0.2) else "none", flush=True)
time.sleep(600)
"""


def test_a_worker_whose_jvm_is_sigkilled_ends_on_its_own(tmp_path: Path) -> None:
    java = tmp_path / "java"
    shutil.copy("/bin/sh", java)
    ready = tmp_path / "ready"
    # `; true` keeps the shell alive as the worker's parent (no exec of the last command).
    script = f"{sys.executable} -c '{WORKER}' > {ready}; true"
    jvm = subprocess.Popen([str(java), "-c", script], start_new_session=True)
    workers: list[int] = []
    try:
        wait_for("the worker's watchdog", lambda: ready.exists() and ready.read_text(), 60)
        assert ready.read_text().strip() == "watching"
        # The worker (the fake JVM's child) and its watcher process (the worker's child).
        workers = descendants(jvm.pid)
        assert len(workers) == 2, workers
        os.kill(jvm.pid, signal.SIGKILL)
        jvm.wait(timeout=10)
        wait_for(
            "the orphaned worker and its watcher to end",
            lambda: not any(running(p) for p in workers),
            30,
        )
    finally:
        kill_pids([p for p in workers if running(p)] + descendants(jvm.pid))
        if jvm.poll() is None:
            jvm.kill()
        jvm.wait(timeout=10)


def test_no_watchdog_without_a_java_ancestor() -> None:
    from ratchet.flink._watchdog import jvm_ancestor

    assert jvm_ancestor() is None  # pytest runs under no JVM
