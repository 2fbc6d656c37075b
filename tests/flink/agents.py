"""Agents the Flink tests run, in both engines. Every execution of an action and every real call
behind a durable call is appended to a log outside ratchet's state (one O_APPEND write per
line, with the process id), so a test can tell what ran, in which process, how often."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from ratchet import Agent, Event, InputEvent, OutputEvent, action


def note(*parts: Any) -> None:
    log = os.environ.get("RATCHET_TEST_EXEC_LOG")
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (" ".join(str(p) for p in (os.getpid(), *parts)) + "\n").encode())
        finally:
            os.close(fd)


class Split(Event):
    event_name = "flinktest.Split"
    value: int


class Joined(Event):
    event_name = "flinktest.Joined"
    value: int
    by: str


def price(value: int) -> int:
    note("call price", value)
    return value * 3 + 1


class ScenarioAgent(Agent):
    """The machine scenarios: a root action, two children on one event (the first slower, so
    the second finishes first and waits for FIFO commit), a thread action with a durable call,
    an inline action that reads the run's sensory memory, bytes in memory."""

    @action(InputEvent)
    def root(self, event: InputEvent, ctx: Any) -> None:
        note("exec", ctx.key, ctx.seq, ctx.task_id)
        mem = ctx.short_term_memory
        v = event.input["v"]
        mem.set("count", mem.get("count", 0) + 1)
        mem.set("order", [*mem.get("order", []), v])
        mem.set("blob", bytes([v % 256, 0, 0xFF]))
        ctx.send_event(Split(value=v))

    @action(Split)
    async def slow(self, event: Split, ctx: Any) -> None:
        note("exec", ctx.key, ctx.seq, ctx.task_id)
        await asyncio.sleep(0.03)
        await crash_once(ctx, event.value)
        ctx.short_term_memory.set("last", "slow")  # dispatched first: lands first
        ctx.sensory_memory.set("slow", event.value)
        ctx.send_event(Joined(value=event.value, by="slow"))

    @action(Split)
    def fast(self, event: Split, ctx: Any) -> None:
        note("exec", ctx.key, ctx.seq, ctx.task_id)
        p = ctx.durable_execute(price, event.value)
        ctx.short_term_memory.set("last", "fast")  # finishes first, commits second
        ctx.short_term_memory.set("prices", ctx.short_term_memory.get("prices", 0) + p)
        ctx.send_event(Joined(value=p, by="fast"))

    @action(Joined, inline=True)
    def emit(self, event: Joined, ctx: Any) -> None:
        note("exec", ctx.key, ctx.seq, ctx.task_id)
        ctx.send_event(
            OutputEvent(
                output={
                    "by": event.by,
                    "value": event.value,
                    "sensory": ctx.sensory_memory.get("slow"),
                }
            )
        )


async def crash_once(ctx: Any, value: int) -> None:
    """With RATCHET_TEST_CRASH=<dir>, kill the Python worker once, in `slow` of the input whose
    v is 7, after its sibling `fast` finished (not committed: FIFO) and checkpoints completed."""
    crash_dir = os.environ.get("RATCHET_TEST_CRASH")
    if not crash_dir or value != 7:
        return
    marker = Path(crash_dir) / "crashed"
    if marker.exists():
        return
    await asyncio.sleep(1.5)  # checkpoints (every 100 ms) complete meanwhile
    marker.write_text(str(os.getpid()))
    note("crash", ctx.key, ctx.seq, ctx.task_id)
    os._exit(17)


class Counter(Agent):
    """The trivial keyed agent of the benchmark: one inline action, one memory write."""

    @action(InputEvent, inline=True)
    def count(self, event: InputEvent, ctx: Any) -> None:
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(OutputEvent(output=n))


def doubled(value: int) -> int:
    return 2 * value


class MeteredCounter(Agent):
    """`Counter` with an action's own `ctx.metrics` counter and one durable call per input:
    what the Flink metrics of `ctx.metrics` show."""

    @action(InputEvent, inline=True)
    def count(self, event: InputEvent, ctx: Any) -> None:
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.metrics.inc("counted")
        ctx.durable_execute(doubled, n)
        ctx.send_event(OutputEvent(output=n))


def gate_open(gate: str) -> bool:
    return Path(gate).exists()


def quote(value: int) -> dict[str, Any]:
    note("call quote", value)
    return {"value": value, "quote": value * 10}


def blocked_tool(value: int, gate: str) -> int:
    """A tool call that blocks until the test creates the gate file."""
    note("call blocked_tool start", value)
    while not Path(gate).exists():
        time.sleep(0.05)
    note("call blocked_tool done", value)
    return value + 1000


class BlobAgent(Agent):
    """The kill test's agent: a bytes blob in memory, a durable call that completes, then (for
    inputs with "block") a tool call that blocks until the gate file exists."""

    @action(InputEvent)
    async def handle(self, event: InputEvent, ctx: Any) -> None:
        note("exec", ctx.key, ctx.seq, ctx.task_id)
        v = event.input["v"]
        mem = ctx.short_term_memory
        q = await ctx.durable_execute_async(quote, v)
        blob = mem.get("blob", b"")
        assert isinstance(blob, bytes), f"blob came back as {type(blob).__name__}"
        mem.set("blob", blob + bytes([v % 256, 0xFF]))
        mem.set("count", mem.get("count", 0) + 1)
        extra = None
        if event.input.get("block"):
            extra = await ctx.durable_execute_async(blocked_tool, v, event.input["gate"])
        ctx.send_event(
            OutputEvent(
                output={
                    "v": v,
                    "quote": q["quote"],
                    "tool": extra,
                    "count": mem.get("count"),
                    "blob_type": type(mem.get("blob")).__name__,
                    "blob": mem.get("blob").hex(),
                }
            )
        )


async def slow_echo(v: int) -> int:
    note("call slow_echo", v)
    await asyncio.sleep(0.15)
    return v


class Slow(Agent):
    """Each run takes 150 ms (an async sleep in a durable call) and counts its key's inputs:
    several keys keep runs in flight, each polled by its own processing-time timers."""

    @action(InputEvent)
    async def handle(self, event: InputEvent, ctx: Any) -> None:
        note("exec", ctx.key, ctx.seq, ctx.task_id)
        v = event.input["v"]
        got = await ctx.durable_execute_async(slow_echo, v)
        mem = ctx.short_term_memory
        mem.set("seen", [*mem.get("seen", []), got])
        ctx.send_event(OutputEvent(output={"v": got, "n": len(mem.get("seen"))}))


async def journaled_call(key: str, v: int) -> int:
    note("call journaled", key, v)
    await asyncio.sleep(0.04)
    return v * 7


class Journaled(Agent):
    """The call journal's kill test: two durable calls per input, each noted when it is really
    made and when its result is back in the action ("returned"), so a test can count the calls
    that had returned before a kill and how often each was made."""

    @action(InputEvent)
    async def handle(self, event: InputEvent, ctx: Any) -> None:
        v = event.input["v"]
        a = await ctx.durable_execute_async(journaled_call, ctx.key, v)
        note("returned", ctx.key, v)
        b = await ctx.durable_execute_async(journaled_call, ctx.key, -v - 1)
        note("returned", ctx.key, -v - 1)
        mem = ctx.short_term_memory
        mem.set("sum", mem.get("sum", 0) + a + b)
        mem.set("n", mem.get("n", 0) + 1)
        ctx.send_event(OutputEvent(output={"v": v, "n": mem.get("n"), "sum": mem.get("sum")}))
