"""Durable calls made concurrently inside one action (issue 11, item 4): gathered coroutines,
created tasks, task groups, wait_for and threads an action starts interleave differently after
a crash, so a recorded call is matched by its function, arguments and occurrence, not by its
position. The crash here is a SystemExit after every call returned (the job dies before the
task commits); the restart must answer every call from the journal."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

import ratchet
from ratchet import Agent, InputEvent, NonDeterminismError, OutputEvent, action

LOG: list[str] = []
LOCK = threading.Lock()


def note(what: str) -> None:
    with LOCK:
        LOG.append(what)


async def slow_fetch(name: str, delay: float) -> str:
    note(name)
    await asyncio.sleep(delay)
    return f"got {name}"


def sync_fetch(name: str) -> str:
    note(name)
    return f"got {name}"


async def chain(ctx: Any, tag: str, delay: float) -> list[str]:
    """Two sequential calls: the second's position depends on how long the first took."""
    first = await ctx.durable_execute_async(slow_fetch, f"{tag}1", delay)
    second = await ctx.durable_execute_async(slow_fetch, f"{tag}2", 0)
    return [first, second]


async def with_gather(ctx: Any) -> Any:
    return await asyncio.gather(chain(ctx, "a", 0.05), chain(ctx, "b", 0))


async def with_create_task(ctx: Any) -> Any:
    t1 = asyncio.create_task(chain(ctx, "a", 0.05))
    t2 = asyncio.create_task(chain(ctx, "b", 0))
    return [await t2, await t1]


async def with_task_group(ctx: Any) -> Any:
    async with asyncio.TaskGroup() as tg:
        t1 = tg.create_task(chain(ctx, "a", 0.05))
        t2 = tg.create_task(chain(ctx, "b", 0))
    return [t1.result(), t2.result()]


async def with_wait_for(ctx: Any) -> Any:
    return await asyncio.gather(
        asyncio.wait_for(chain(ctx, "a", 0.05), 5), asyncio.wait_for(chain(ctx, "b", 0), 5)
    )


SHAPES: dict[str, Callable[[Any], Coroutine[Any, Any, Any]]] = {
    "gather": with_gather,
    "create_task": with_create_task,
    "TaskGroup": with_task_group,
    "wait_for": with_wait_for,
}


def make_agent(shape: str, crash: bool) -> Agent:
    class Concurrent(Agent):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            result = await SHAPES[shape](ctx)
            if crash:
                raise SystemExit("the process dies after every call returned")
            ctx.send_event(OutputEvent(output=result))

    return Concurrent()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_concurrent_async_calls_replay_whatever_the_interleaving(
    tmp_path: Path, shape: str
) -> None:
    LOG.clear()
    with pytest.raises(ratchet.InternalError, match="SystemExit"):
        ratchet.run(
            make_agent(shape, True), inputs=[{"key": "k"}], output=[].append, state_dir=tmp_path
        )
    assert sorted(LOG) == ["a1", "a2", "b1", "b2"]
    LOG.clear()
    got: list[dict[str, Any]] = []
    res = ratchet.run(
        make_agent(shape, False), inputs=[{"key": "k"}], output=got.append, state_dir=tmp_path
    )
    assert LOG == []  # every call answered from the journal, in a different interleaving
    assert res.metrics["durable_calls.replayed"] == 4
    assert len(got) == 1 and sorted(map(tuple, got[0]["output"])) == [
        ("got a1", "got a2"),
        ("got b1", "got b2"),
    ]


def make_threaded(crash: bool) -> Agent:
    class Threaded(Agent):
        @action(InputEvent)
        def go(self, event: InputEvent, ctx: Any) -> None:
            results: dict[str, Any] = {}

            def worker(tag: str, pause: float) -> None:
                threading.Event().wait(pause)
                results[tag] = [
                    ctx.durable_execute(sync_fetch, f"{tag}1"),
                    ctx.durable_execute(sync_fetch, f"{tag}2"),
                ]

            threads = [
                threading.Thread(target=worker, args=(t, p)) for t, p in (("a", 0.05), ("b", 0))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if crash:
                raise SystemExit("dies")
            ctx.send_event(OutputEvent(output=dict(sorted(results.items()))))

    return Threaded()


def test_calls_from_threads_an_action_starts_replay(tmp_path: Path) -> None:
    LOG.clear()
    with pytest.raises(ratchet.InternalError, match="SystemExit"):
        ratchet.run(
            make_threaded(True), inputs=[{"key": "k"}], output=[].append, state_dir=tmp_path
        )
    assert sorted(LOG) == ["a1", "a2", "b1", "b2"]
    LOG.clear()
    got: list[dict[str, Any]] = []
    ratchet.run(make_threaded(False), inputs=[{"key": "k"}], output=got.append, state_dir=tmp_path)
    assert LOG == []
    assert got[0]["output"] == {"a": ["got a1", "got a2"], "b": ["got b1", "got b2"]}


def test_identical_calls_are_interchangeable_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    class Twice(Agent):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            await asyncio.gather(
                ctx.durable_execute_async(slow_fetch, "same", 0),
                ctx.durable_execute_async(slow_fetch, "same", 0),
            )
            raise SystemExit("dies")

    LOG.clear()
    with pytest.raises(ratchet.InternalError, match="SystemExit"):
        ratchet.run(Twice(), inputs=[{"key": "k"}], output=[].append, state_dir=tmp_path)
    assert LOG == ["same", "same"]

    class Once(Agent):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            await ctx.durable_execute_async(slow_fetch, "same", 0)

    with pytest.raises(
        NonDeterminismError,
        match=r"key 'k' input 0, task r>go: recorded durable call\(s\) #1 .*slow_fetch",
    ):
        ratchet.run(Once(), inputs=[{"key": "k"}], output=[].append, state_dir=tmp_path)
