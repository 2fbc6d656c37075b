"""Python workers end when their TaskManager dies.

A TaskManager starts its Python workers as child processes (a shell script, then PyFlink's
Beam boot process, then the worker). When the TaskManager is killed with SIGKILL nothing tells
them: the worker's gRPC channel to the dead JVM does not fail while the worker waits for work,
so it lived on as an orphan, holding its memory and any calls it was making. The watchdog notes
the worker's nearest `java` ancestor (the TaskManager, or the JVM of a local mini-cluster) and a
small watcher process ends the worker (SIGKILL) once that process is gone.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("ratchet.flink")

_started = False
_lock = threading.Lock()
_watcher: object = None  # the watcher's Popen, kept for the life of the worker


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process, from /proc; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie: dead, not yet reaped
        return None
    return int(fields[1]), fields[19]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def jvm_ancestor(pid: int | None = None) -> tuple[int, str] | None:
    """The nearest ancestor of `pid` (this process) whose command is `java`, with its start
    time (so a reused pid is not mistaken for it); None when there is none (or no /proc)."""
    cur = os.getpid() if pid is None else pid
    for _ in range(16):
        st = _stat(cur)
        if st is None:
            return None
        parent = st[0]
        if parent <= 1:
            return None
        if _comm(parent) == "java":
            pst = _stat(parent)
            return None if pst is None else (parent, pst[1])
        cur = parent
    return None


# The watcher: a separate small process (it must not depend on the worker's interpreter, which
# can hang in its own shutdown once its gRPC channel to the dead JVM closes: joining a thread
# blocked in a user's call, say). It polls both pids; it ends the worker with SIGKILL when the
# JVM is gone, and ends itself when the worker is gone.
_WATCHER = """
import os, signal, sys, time
def alive(pid, start):
    try:
        f = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return f[0] != "Z" and f[19] == start
worker, wstart, jvm, jstart, every = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
while alive(worker, wstart):
    if not alive(jvm, jstart):
        try:
            os.kill(worker, signal.SIGKILL)
        except OSError:
            pass
        break
    time.sleep(every)
"""


def start_parent_watchdog(interval: float = 1.0) -> bool:
    """Start (once per process) the watcher that ends this worker when its JVM is gone.
    Returns whether one runs (False where there is no /proc or no java ancestor, and in
    thread mode, where the worker is the JVM itself)."""
    global _started, _watcher
    with _lock:
        if _started:
            return True
        if _comm(os.getpid()) == "java":
            return False  # thread mode: this interpreter is inside the JVM, and dies with it
        jvm = jvm_ancestor()
        me = _stat(os.getpid())
        if jvm is None or me is None:
            return False
        import subprocess
        import sys

        _watcher = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHER, str(os.getpid()), me[1], str(jvm[0]),
             jvm[1], str(interval)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )  # fmt: skip
        _started = True
    log.info("ending this Python worker when its JVM (pid %d) is gone", jvm[0])
    return True
