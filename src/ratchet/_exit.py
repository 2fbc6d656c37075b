"""Leaving the interpreter without its teardown once a command line's work is done.

A CPython process that returns from `main` spends 10-15 ms more tearing down modules and
collecting every object the run made, memory the operating system takes back anyway; for
`ratchet checks`, whose no-op run takes tens of milliseconds, that is a sixth of the
command line's time. Nothing durable depends on the teardown: receipts, journals and
caches are written, fsync'd and closed before a run returns, and stage processes have been
waited for. `exit_process` keeps what an exit must still do — flush stdout and stderr,
run the `atexit` handlers (logging's flush, a coverage tool's save) — and skips the rest.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

__all__ = ["exit_process"]


def _flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            stream.flush()
        except BrokenPipeError:
            # The reader went away (`... --json | head`): what it did not read is lost
            # either way; do not let the interpreter report it again at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError):
            pass  # a closed or broken stream: the normal exit could not flush it either


def exit_process(code: int) -> None:
    """Exit with `code` now: flush the standard streams, run the `atexit` handlers, then
    `os._exit`. With another thread still alive it raises SystemExit instead, so the
    interpreter waits for that thread as a normal exit does."""
    if threading.active_count() > 1:
        sys.exit(code)
    _flush_standard_streams()
    atexit._run_exitfuncs()
    _flush_standard_streams()  # what the handlers printed
    os._exit(code)
