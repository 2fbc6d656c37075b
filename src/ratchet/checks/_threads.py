"""Worker threads for the scheduler and the start-of-run probe, without `concurrent.futures`.

`concurrent.futures` imports `logging`, and with it `traceback`, `linecache`, `tokenize`,
`textwrap`, `string` and `weakref`: 6-8 ms at every start of `ratchet checks`, a tenth of
a no-op run, for a pool the scheduler only ever gives `jobs` calls at a time. `Workers`
is that pool and `wait` its `concurrent.futures.wait`; both keep the semantics the
scheduler relies on: a worker's exception, even a BaseException, is kept in its task, and
leaving the `with` block finishes every submitted call and joins the threads.

A scheduler whose waiter is not `wait` (a test's, or `runner.wait`, which is
`concurrent.futures.wait`) gets a real `ThreadPoolExecutor` instead (`pool_for`), so a
waiter written for `concurrent.futures` futures keeps working.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any, TypeVar

    T = TypeVar("T")
    R = TypeVar("R")

__all__ = ["FIRST_COMPLETED", "Task", "Workers", "map_threads", "pool_for", "wait"]

# The same strings as concurrent.futures' constants.
FIRST_COMPLETED = "FIRST_COMPLETED"
ALL_COMPLETED = "ALL_COMPLETED"


class Task:
    """The outcome of one call on a `Workers` thread."""

    __slots__ = ("_changed", "_finished", "_exception")

    def __init__(self, changed: threading.Condition) -> None:
        self._changed = changed
        self._finished = False
        self._exception: BaseException | None = None

    def done(self) -> bool:
        return self._finished

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's exception (None if it returned), once it has finished."""
        with self._changed:
            if not self._changed.wait_for(self.done, timeout):
                raise TimeoutError("the call has not finished")
        return self._exception


class Workers:
    """At most `max_workers` threads running submitted calls in submission order.

    Threads start on demand, so a pool that runs one call at a time has one thread.
    Leaving the `with` block runs what is still queued, then joins every thread, as
    `ThreadPoolExecutor.shutdown(wait=True)` does."""

    def __init__(self, max_workers: int, name: str = "ratchet-worker") -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self._max = max_workers
        self._name = name
        self._changed = threading.Condition()
        self._queue: deque[tuple[Callable[[], object], Task]] = deque()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closing = False

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()

    def submit(self, fn: Callable[..., object], *args: Any) -> Task:
        """Queue `fn(*args)`; its outcome is the returned task's."""
        with self._changed:
            if self._closing:
                raise RuntimeError("cannot submit to a pool that is shutting down")
            task = Task(self._changed)
            self._queue.append((lambda: fn(*args), task))
            if self._idle == 0 and len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}_{len(self._threads)}"
                )
                self._threads.append(thread)
                thread.start()
            self._changed.notify_all()
        return task

    def _work(self) -> None:
        changed = self._changed
        while True:
            with changed:
                self._idle += 1
                while not self._queue and not self._closing:
                    changed.wait()
                self._idle -= 1
                if not self._queue:
                    return  # closing, nothing left to run
                call, task = self._queue.popleft()
            error: BaseException | None = None
            try:
                call()
            except BaseException as exc:  # kept for the scheduler, as a Future keeps it
                error = exc
            with changed:
                task._exception = error
                task._finished = True
                changed.notify_all()
            del call, error


def wait(
    fs: Iterable[Any], timeout: float | None = None, return_when: str = ALL_COMPLETED
) -> tuple[set[Any], set[Any]]:
    """`concurrent.futures.wait` for `Task`s of one pool; other futures are handed to
    `concurrent.futures.wait` itself."""
    pending = list(fs)
    if not pending:
        return set(), set()
    if not all(isinstance(f, Task) for f in pending):
        from concurrent.futures import wait as futures_wait

        done, not_done = futures_wait(pending, timeout=timeout, return_when=return_when)
        return set(done), set(not_done)
    changed = pending[0]._changed
    if any(f._changed is not changed for f in pending):
        raise ValueError("wait() takes tasks of one pool")
    want = 1 if return_when == FIRST_COMPLETED else len(pending)

    def enough() -> bool:
        finished: int = sum(1 for f in pending if f._finished)
        return finished >= want

    with changed:
        changed.wait_for(enough, timeout)
        done = {f for f in pending if f._finished}
    return done, {f for f in pending if f not in done}


def pool_for(waiter: object, max_workers: int, name: str) -> Any:
    """The pool a scheduler with `waiter` submits to: `Workers` for `wait`, otherwise a
    `concurrent.futures.ThreadPoolExecutor`, whose futures any other waiter understands."""
    if waiter is wait:
        return Workers(max_workers, name)
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)


def map_threads(fn: Callable[[T], R], items: Sequence[T], max_workers: int) -> list[R]:
    """`[fn(x) for x in items]`, on up to `max_workers` threads at once; raises the
    exception of the first item (in order) whose call raised, after every call ended."""
    results: list[Any] = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)
    ahead = iter(range(len(items)))
    take = threading.Lock()

    def work() -> None:
        while True:
            with take:
                i = next(ahead, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as exc:
                errors[i] = exc

    threads = [threading.Thread(target=work) for _ in range(min(max_workers, len(items)) - 1)]
    for thread in threads:
        thread.start()
    try:
        work()  # the calling thread works too
    finally:
        for thread in threads:
            thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results
