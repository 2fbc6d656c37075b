"""The parallel scheduler: which stage may start now, on a pool of `jobs` threads.

A stage starts once every `deps` and `after` predecessor has passed (a pass counts only
once its checkpoint is on disk, see `ReceiptBook.persist`) and none of its resources is
held by a running stage; it is skipped once one of them failed, was skipped or went stale.
The loop wakes at least every tick to flush the receipt and show progress; the pause is
an injected `Waiter`, so a test can watch the loop without patching it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from typing import Any, Protocol

from ratchet.checks._receipts import ReceiptBook
from ratchet.checks._seams import Waiter

__all__ = ["SCHEDULER_TICK_SECONDS", "Progress", "blocked_by", "ready", "schedule"]

SCHEDULER_TICK_SECONDS = 0.05
_STOPPED = ("failed", "skipped", "stale")


class Progress(Protocol):
    """What the scheduler reports to after each look at the run (`LiveProgress`)."""

    def update(self, records: Sequence[Mapping[str, Any]]) -> None: ...


def blocked_by(stage: Mapping[str, Any], status: Callable[[str], str]) -> str | None:
    """Why `stage` can never start (a predecessor did not pass), or None."""
    for kind, preds in (("depends on", stage["deps"]), ("comes after", stage["after"])):
        for pred in preds:
            if (st := status(pred)) in _STOPPED:
                return f"{kind} {pred!r}, which is {st}"
    return None


def ready(stage: Mapping[str, Any], status: Callable[[str], str]) -> bool:
    """Whether every predecessor of `stage` has passed."""
    return all(status(p) == "passed" for p in (*stage["deps"], *stage["after"]))


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
    stage failed. If the loop itself is interrupted, `on_interrupt` runs (it kills the stage
    commands) before the exception propagates.
    """
    pending = list(book.order)
    running: dict[Future[None], str] = {}
    busy: set[str] = set()
    status = book.status
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ratchet-stage") as pool:
        try:
            while pending or running:
                for sid in list(pending):
                    reason = blocked_by(stages[sid], status)
                    if reason is not None:
                        pending.remove(sid)
                        book.update(sid, status="skipped", error=f"not started: it {reason}")
                for sid in list(pending):
                    if len(running) >= jobs:
                        break
                    stage = stages[sid]
                    if ready(stage, status) and not busy & set(stage["resources"]):
                        pending.remove(sid)
                        busy |= set(stage["resources"])
                        running[pool.submit(work, sid)] = sid
                book.try_flush()
                progress.update(book.all_records())
                if not running:
                    if pending:  # cannot happen with a valid plan; fail closed anyway
                        for sid in pending:
                            book.update(sid, status="skipped", error="not started: unschedulable")
                        pending.clear()
                    break
                done, _ = waiter(list(running), timeout=tick, return_when=FIRST_COMPLETED)
                for fut in done:
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
        except BaseException:
            on_interrupt()
            raise
