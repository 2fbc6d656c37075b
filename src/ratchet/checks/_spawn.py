"""Run `git` for its output, without importing `subprocess`.

Every run lists each repository with `git ls-files`; that is all a no-op run needs of
child processes. `subprocess` imports `selectors`, `select`, `locale` and `fcntl`: ~2-3 ms
of every `ratchet checks` start-up, for what `os.posix_spawnp` and a pipe do here. Stage
commands, which need process groups, timeouts and the rest, still use `subprocess`
(`_execute.py`), imported when the first one starts.

As `subprocess.Popen` does by default, the child gets SIGPIPE and SIGXFSZ at their
default actions (Python ignores them); here its stdin and stderr are /dev/null.
"""

from __future__ import annotations

import os
import signal

__all__ = ["Child", "output_of"]

_DEFAULT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name)
)


class Child:
    """A started command whose stdout is read by `output`; `stop` kills it if it still runs."""

    def __init__(self, argv: list[str]) -> None:
        read_end, write_end = os.pipe()  # both close-on-exec; the child gets a dup as stdout
        try:
            self.pid = os.posix_spawnp(
                argv[0],
                argv,
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, write_end, 1),
                    (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
                ],
                setsigdef=_DEFAULT_SIGNALS,
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self._stdout: int | None = read_end
        self.returncode: int | None = None

    def output(self) -> tuple[int, bytes]:
        """(exit code, everything it wrote to stdout), once it has ended."""
        chunks = []
        fd = self._stdout
        if fd is not None:
            try:
                while chunk := os.read(fd, 1 << 16):
                    chunks.append(chunk)
            finally:
                self._close()
        return self._wait(), b"".join(chunks)

    def stop(self) -> None:
        """Kill it (if it still runs) and reap it."""
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._close()
        self._wait()

    def _close(self) -> None:
        if self._stdout is not None:
            os.close(self._stdout)
            self._stdout = None

    def _wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def output_of(argv: list[str]) -> tuple[int, bytes]:
    """Run `argv` to its end: (exit code, its stdout)."""
    child = Child(argv)
    try:
        return child.output()
    except BaseException:
        child.stop()
        raise
