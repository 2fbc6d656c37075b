"""The scheduler's own worker threads (`ratchet.checks._threads`): what they keep of
`concurrent.futures`' semantics, which the scheduler and the start-of-run probe rely on."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ratchet.checks import Seams
from ratchet.checks._threads import (
    FIRST_COMPLETED,
    Task,
    Workers,
    map_threads,
    pool_for,
    wait,
)


def test_a_task_keeps_its_exception_even_a_base_exception() -> None:
    with Workers(2) as pool:
        ok = pool.submit(lambda: None)
        bad = pool.submit(_raise, ValueError("boom"))
        interrupted = pool.submit(_raise, KeyboardInterrupt())
    assert ok.done() and ok.exception() is None
    error = bad.exception()
    assert isinstance(error, ValueError) and str(error) == "boom"
    assert isinstance(interrupted.exception(), KeyboardInterrupt)


def test_leaving_the_pool_runs_what_is_queued_and_joins_its_threads() -> None:
    gate = threading.Event()
    ran: list[int] = []
    with Workers(1) as pool:
        first = pool.submit(gate.wait, 30)
        rest = [pool.submit(ran.append, i) for i in range(3)]
        assert not first.done()
        gate.set()
    assert ran == [0, 1, 2]  # one thread: submission order
    assert all(t.done() for t in [first, *rest])
    assert [t for t in threading.enumerate() if t.name.startswith("ratchet-worker")] == []
    with pytest.raises(RuntimeError, match="shutting down"):
        pool.submit(ran.append, 4)


def test_a_pool_starts_no_more_threads_than_it_may() -> None:
    gate = threading.Event()
    with Workers(2, name="capped") as pool:
        tasks = [pool.submit(gate.wait, 30) for _ in range(5)]
        assert len([t for t in threading.enumerate() if t.name.startswith("capped")]) <= 2
        gate.set()
    assert all(t.done() for t in tasks)


def test_wait_returns_at_the_first_completion_or_at_the_timeout() -> None:
    gate = threading.Event()
    with Workers(2) as pool:
        slow = pool.submit(gate.wait, 30)
        done, not_done = wait([slow], timeout=0.01, return_when=FIRST_COMPLETED)
        assert done == set() and not_done == {slow}
        fast = pool.submit(lambda: None)
        done, not_done = wait([slow, fast], timeout=30, return_when=FIRST_COMPLETED)
        assert done == {fast} and not_done == {slow}
        gate.set()
        done, not_done = wait([slow, fast], timeout=30)
        assert done == {slow, fast} and not_done == set()
    assert wait([]) == (set(), set())


def test_wait_hands_concurrent_futures_to_concurrent_futures() -> None:
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(lambda: 7)
        done, not_done = wait([fut], timeout=30)
    assert done == {fut} and not_done == set()


def test_wait_refuses_tasks_of_two_pools() -> None:
    one, two = Task(threading.Condition()), Task(threading.Condition())
    with pytest.raises(ValueError, match="one pool"):
        wait([one, two], timeout=0)


def test_the_default_waiter_gets_the_light_pool_and_any_other_a_thread_pool_executor() -> None:
    light = pool_for(Seams().waiter, 1, "x")
    assert isinstance(light, Workers)
    with light:
        pass
    with pool_for(lambda *a, **k: (set(), set()), 1, "x") as other:
        assert isinstance(other, ThreadPoolExecutor)


def test_map_threads_keeps_the_order_and_raises_the_first_failure_after_all_ended() -> None:
    assert map_threads(lambda x: x * 2, [3, 1, 2], max_workers=4) == [6, 2, 4]
    assert map_threads(lambda x: x, [], max_workers=4) == []
    ended: list[int] = []

    def work(x: int) -> int:
        ended.append(x)
        if x in (2, 3):
            raise OSError(f"item {x}")
        return x

    with pytest.raises(OSError, match="item 2"):
        map_threads(work, [1, 2, 3, 4], max_workers=2)
    assert sorted(ended) == [1, 2, 3, 4]


def _raise(exc: BaseException) -> None:
    raise exc
