"""The agent the kill tests run in a real `ratchet run` subprocess.

Every execution of an action, and every real call behind a durable call, is appended to a
log outside ratchet's state (one O_APPEND write per line), so the test can tell what ran in
which process.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from ratchet import Agent, Event, InputEvent, OutputEvent, action

_LOG = os.environ.get("RATCHET_TEST_EXEC_LOG")
# Set by a test that kills the job part-way: once the log holds this many lines, every further
# execution blocks (the job stalls with runs in flight), so a fast run cannot end before the
# test's kill lands.
_HOLD_AT = int(os.environ.get("RATCHET_TEST_HOLD_AT") or 0)
# Opened on first use in each process, not at import: a module that holds a file open from its
# import has its workers started as new interpreters rather than forked (docs/operations.md).
_fds: dict[int, int] = {}


def note(*parts: Any) -> None:
    if _LOG:
        pid = os.getpid()
        fd = _fds.get(pid)
        if fd is None:
            fd = _fds[pid] = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, (" ".join(str(p) for p in (pid, *parts)) + "\n").encode())
        if _HOLD_AT:
            with open(_LOG, "rb") as fh:
                if fh.read().count(b"\n") >= _HOLD_AT:
                    time.sleep(3600)  # until the test's SIGKILL


class Counted(Event):
    event_name = "killtest.Counted"
    value: int


class Priced(Event):
    event_name = "killtest.Priced"
    value: int
    price: int


def price(value: int) -> int:
    note("call", *_where())
    time.sleep(0.001)
    return value * 3 + 1


def _where() -> tuple[Any, ...]:
    from ratchet.agents._context import current_context

    ctx = current_context()
    return (ctx.seq, ctx.task_id) if ctx is not None else ("?", "?")


class KillAgent(Agent):
    """Three steps per input: a threaded sync action, an async one with a durable call, an inline one."""

    @action(InputEvent)
    def count(self, event: InputEvent, ctx: Any) -> None:
        note("exec", ctx.seq, ctx.task_id)
        time.sleep(0.001)
        mem = ctx.short_term_memory
        mem.set("count", mem.get("count", 0) + 1)
        mem.set("sum", mem.get("sum", 0) + event.input["value"])
        mem.set("last_blob", bytes([event.input["value"] % 256, 0xFF]))
        ctx.send_event(Counted(value=event.input["value"]))

    @action(Counted)
    async def enrich(self, event: Counted, ctx: Any) -> None:
        note("exec", ctx.seq, ctx.task_id)
        p = await ctx.durable_execute_async(price, event.value)
        await asyncio.sleep(0.002)
        mem = ctx.short_term_memory
        mem.set("prices", mem.get("prices", 0) + p)
        ctx.sensory_memory.set("price", p)
        ctx.send_event(Priced(value=event.value, price=p))

    @action(Priced, inline=True)
    def emit(self, event: Priced, ctx: Any) -> None:
        note("exec", ctx.seq, ctx.task_id)
        assert ctx.sensory_memory.get("price") == event.price
        ctx.send_event(OutputEvent(output={"value": event.value, "price": event.price}))
