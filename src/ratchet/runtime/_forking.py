"""Start a shard worker by forking the coordinator, after its imports, instead of fork+exec.

A new interpreter spends most of a short job's worker CPU importing ratchet, pydantic and the
agent module again (about 0.4 s); a fork costs a few milliseconds. The child must then be
what a freshly executed worker is: its own session, default signal handlers, no running event
loop, a fresh interpreter's logging, and no hold on any of the coordinator's files or sockets
(a held socket end would keep a peer from seeing EOF when a process dies; a held lock file
would keep a lock). It ends with `os._exit`, so none of the coordinator's atexit handlers or
finalizers run in it.

Fork is only safe while the coordinator has no other thread (a thread holding a lock at the
fork leaves it held forever in the child), and only on Linux (where the parent-death signal
exists); `fork_unsafe` says why not, and the coordinator then executes a new interpreter as
before. `RATCHET_WORKER_START=exec` always does. The caller decides the rest (the agent's
module is shared, so `ratchet.agents._sharded` forks only an agent it loaded itself, whose
loading left no descriptor open). docs/operations.md, "How workers start", has the whole.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable

from ratchet._errors import ConfigError

START_ENV = "RATCHET_WORKER_START"
START_METHODS = ("fork", "exec")


def start_method() -> str:
    """How shard workers start: `fork` (the default: forked from the coordinator where that is
    safe, else `exec`) or `exec` (always a new interpreter), from $RATCHET_WORKER_START."""
    value = os.environ.get(START_ENV, "").strip().lower() or "fork"
    if value not in START_METHODS:
        raise ConfigError(
            f"{START_ENV}={os.environ[START_ENV]!r} is not a worker start method; use 'fork' "
            f"(the default: fork the coordinator where safe) or 'exec' (a new interpreter)"
        )
    return value


def open_fds() -> dict[int, str]:
    """This process's open descriptors and what they name (Linux; elsewhere empty)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return found


def _os_threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def fork_unsafe() -> str | None:
    """Why this process must not fork a worker now, or None when it may."""
    if sys.platform != "linux" or not hasattr(os, "fork"):
        return f"fork start is used on Linux only (this is {sys.platform})"
    if threading.active_count() > 1:
        names = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
        return f"the coordinator runs other threads ({', '.join(names)})"
    native = _os_threads()
    if native is None:
        return "cannot count this process's threads (/proc/self/task)"
    if native > 1:  # threads started by an extension module, invisible to `threading`
        return f"the coordinator runs {native - 1} other native thread(s)"
    return None


class ForkedWorker:
    """A forked worker, waited on as a `subprocess.Popen` is (`returncode` is -N for a death
    by signal N); `poll`, `wait` and `kill` are safe from several threads, and a pid is never
    signalled once it has been reaped (it may belong to another process by then)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _reaped(self, status: int) -> int:
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:  # a thread blocked in wait() holds the lock: then it is not known yet
                if self.returncode is None:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                    if pid == self.pid:
                        self._reaped(status)
            except ChildProcessError:
                self.returncode = 255  # reaped elsewhere: its status is lost
            finally:
                self._lock.release()
        return self.returncode

    def wait(self) -> int:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            try:
                _pid, status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                self.returncode = 255
                return self.returncode
            return self._reaped(status)

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def fork_worker(main: Callable[[list[str]], int], argv: list[str], keep_fd: int) -> ForkedWorker:
    """Fork a child that runs `main(argv)` as a new worker process would, keeping only
    `keep_fd` (its end of the socket to the coordinator) and stdin, stdout and stderr.

    Call only when `fork_unsafe()` is None, from the thread that lives as long as the job (the
    worker's parent-death signal fires when the thread that forked it ends)."""
    for stream in (sys.stdout, sys.stderr):  # or the child writes the parent's buffer again
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    gc_was_on = gc.isenabled()
    gc.disable()  # no collection between the fork and the child's freeze
    try:
        pid = os.fork()
    except BaseException:
        if gc_was_on:
            gc.enable()
        raise
    if pid:
        if gc_was_on:
            gc.enable()
        return ForkedWorker(pid)
    code = 1
    try:
        # The coordinator's objects are never collected here: a finalizer of one of them
        # (a socket, a file) would otherwise act on what the child does not own.
        gc.freeze()
        if gc_was_on:
            gc.enable()
        _become_worker(keep_fd)
        code = main(argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        # As a new interpreter ends on an uncaught KeyboardInterrupt: by SIGINT.
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then exit code 1
        traceback.print_exc()
        code = 1
    finally:
        _flush()
        os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def _become_worker(keep_fd: int) -> None:
    """In the child: undo what the coordinator's process state would change for a worker."""
    os.setsid()  # its own session, as `start_new_session=True` gave it
    # Signals as a new interpreter has them (exec resets caught signals to their default).
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _drop_inherited_fds(keep_fd)
    # No event loop: the worker's `asyncio.run` makes its own.
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop_policy(None)
    # Logging as in a new interpreter: the command line's handler and level belong to the
    # coordinator; a worker's warnings go to stderr through logging's last-resort handler.
    root = logging.getLogger()
    root.handlers[:] = []
    root.setLevel(logging.WARNING)


def _drop_inherited_fds(keep_fd: int) -> None:
    """Point every inherited descriptor but 0, 1, 2 and `keep_fd` at /dev/null.

    Not closed: Python objects inherited from the coordinator still name those numbers, and a
    number closed here would be reused by the worker's own files (its SQLite database), which
    such an object could then write to or close. /dev/null holds nothing: no socket end, no
    lock, no file the coordinator writes."""
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd <= 2 or fd in (keep_fd, null):
                continue
            try:
                os.fstat(fd)  # the listing's own descriptor is closed by now
            except OSError:
                continue
            os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)
