"""The parallel scheduler: which stage may start now, on a pool of `jobs` threads.

A stage starts once every `deps` and `after` predecessor has passed (a pass counts only
once its checkpoint is on disk, see `ReceiptBook.persist`; a reused one counts at once, and
reaches disk before any stage command starts, see `ReceiptBook.keep`) and none of its
resources is held by a running stage; it is skipped once one of them failed, was skipped
or went stale. The loop wakes at least every tick to flush the receipt and show progress;
the pause is an injected `Waiter`, so a test can watch the loop without patching it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

from ratchet.checks._receipts import ReceiptBook
from ratchet.checks._threads import FIRST_COMPLETED, pool_for

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

    from ratchet.checks._protocols import Progress, StageFuture, Waiter

__all__ = ["SCHEDULER_TICK_SECONDS", "schedule"]

SCHEDULER_TICK_SECONDS = 0.05
_STOPPED = ("failed", "skipped", "stale")


class _Graph:
    """Which pending stages may start, kept up to date as stages finish: each finished
    stage touches only its own consumers, so a plan of N stages costs O(N + edges), not a
    scan of every pending stage after every finish (O(N^2))."""

    def __init__(self, order: Sequence[str], stages: Mapping[str, Mapping[str, Any]]) -> None:
        self.index = {sid: i for i, sid in enumerate(order)}
        self.stages = stages
        self.waiting = {sid: {*stages[sid]["deps"], *stages[sid]["after"]} for sid in order}
        self.consumers: dict[str, list[str]] = {sid: [] for sid in order}
        for sid in order:
            for pred in self.waiting[sid]:
                self.consumers[pred].append(sid)
        self.pending = set(order)
        self.ready = [self.index[sid] for sid in order if not self.waiting[sid]]
        heapq.heapify(self.ready)
        self.order = list(order)

    def finished(self, sid: str, book: ReceiptBook) -> None:
        """`sid` ended: release its consumers when it passed; otherwise skip them, and
        theirs, transitively."""
        todo = [sid]
        while todo:
            done = todo.pop()
            st = book.status(done)
            for consumer in self.consumers[done]:
                if consumer not in self.pending:
                    continue
                if st == "passed":
                    self.waiting[consumer].discard(done)
                    if not self.waiting[consumer]:
                        heapq.heappush(self.ready, self.index[consumer])
                elif st in _STOPPED:
                    kind = "depends on" if done in self.stages[consumer]["deps"] else "comes after"
                    self.pending.discard(consumer)
                    book.update(
                        consumer,
                        status="skipped",
                        error=f"not started: it {kind} {done!r}, which is {st}",
                    )
                    todo.append(consumer)

    def take(self, busy: set[str], limit: int) -> list[str]:
        """Up to `limit` ready stages whose resources are free, in plan order."""
        taken: list[str] = []
        held: list[int] = []
        while self.ready and len(taken) < limit:
            i = heapq.heappop(self.ready)
            sid = self.order[i]
            if sid not in self.pending:
                continue
            wanted = set(self.stages[sid]["resources"])
            if busy & wanted:
                held.append(i)
                continue
            self.pending.discard(sid)
            busy |= wanted
            taken.append(sid)
        for i in held:
            heapq.heappush(self.ready, i)
        return taken


def schedule(
    book: ReceiptBook,
    stages: Mapping[str, Mapping[str, Any]],
    work: Callable[[str], None],
    *,
    jobs: int,
    waiter: Waiter,
    progress: Progress,
    on_interrupt: Callable[[], None],
    tick: float = SCHEDULER_TICK_SECONDS,
) -> None:
    """Run `work(stage_id)` for every stage of `book`, in order, at most `jobs` at a time.

    `work` records its stage's outcome in `book`; a worker that ends without one marks its
    stage failed. A stage starts once every `deps` and `after` predecessor has passed and
    none of its resources is busy; once one of them ends otherwise, it is skipped. If the
    loop itself is interrupted, `on_interrupt` runs (it kills the stage commands) before the
    exception propagates.
    """
    graph = _Graph(book.order, stages)
    running: dict[StageFuture, str] = {}
    busy: set[str] = set()
    status = book.status
    with pool_for(waiter, jobs, "ratchet-stage") as pool:
        try:
            while graph.pending or running:
                for sid in graph.take(busy, jobs - len(running)):
                    running[pool.submit(work, sid)] = sid
                book.try_flush()
                if progress.active:
                    progress.update(book.all_records())
                if not running:
                    if graph.pending:  # cannot happen with a valid plan; fail closed anyway
                        for sid in sorted(graph.pending, key=graph.index.__getitem__):
                            book.update(sid, status="skipped", error="not started: unschedulable")
                        graph.pending.clear()
                    break
                done, _ = waiter(list(running), timeout=tick, return_when=FIRST_COMPLETED)
                for fut in sorted(done, key=lambda f: graph.index[running[f]]):
                    sid = running.pop(fut)
                    busy -= set(stages[sid]["resources"])
                    exc = fut.exception()
                    if exc is not None or status(sid) in ("pending", "running"):
                        book.update(
                            sid,
                            status="failed",
                            checkpoint_verified=False,
                            error=f"internal error in the stage worker: {exc!r}",
                        )
                    graph.finished(sid, book)
        except BaseException:
            on_interrupt()
            raise
