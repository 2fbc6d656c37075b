"""Drive the embedded engine on a fake clock: time moves to the next deadline only when no task
is running, so timers, backoffs and timeouts are checked at exact virtual times."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from ratchet import Agent
from ratchet.agents._context import AgentBinding, install_task_factory
from ratchet.runtime._engine import Engine, EngineConfig, EngineResult
from ratchet.runtime._io import CallbackSink, IterableSource
from ratchet.store._memory import MemoryStore
from ratchet.testing import FakeClock

START = 1_800_000_000.0


class Drive:
    """Run an engine on a fake clock, moving time to the next deadline whenever the loop has
    nothing else to do; `on_idle(engine)` may act (send a signal) before time moves."""

    def __init__(self, agent: Agent, rows: list[dict[str, Any]], store: MemoryStore) -> None:
        self.agent = agent
        self.rows = rows
        self.store = store
        self.clock: FakeClock = store.clock  # type: ignore[assignment]
        self.got: list[dict[str, Any]] = []
        self.engine: Engine | None = None

    def run(
        self, *, stop_at: float | None = None, follow: bool = False, **config: Any
    ) -> EngineResult:
        source = IterableSource(list(self.rows))
        source.follow = follow
        engine = self.engine = Engine(
            AgentBinding(self.agent),
            self.store,
            source,
            CallbackSink(self.got.append),
            EngineConfig(checkpoint_interval=0.5, **config),
            clock=self.clock,
        )

        async def main() -> EngineResult:
            nonlocal stop_at
            loop = asyncio.get_running_loop()
            install_task_factory(loop)
            writing = _count_writer_work(engine, loop)
            job = asyncio.ensure_future(engine.run())
            while not job.done():
                for _ in range(20):  # let everything runnable run before time moves
                    await asyncio.sleep(0)
                if job.done():
                    break
                if stop_at is not None and self.clock.now() >= stop_at:
                    engine.request_stop("test stop")
                    stop_at = None
                waits = engine._waits
                busy = (
                    any(r.pending > r.waiting for r in engine.machine.in_flight())
                    or any(w.closing for ws in waits.waiters.values() for w in ws)
                    or writing[0] > 0
                )
                deadline = self.clock.next_deadline()
                if deadline is not None and not busy:
                    self.clock.jump_to(deadline)
                else:  # a task is running (or writing its record): time stands still
                    await asyncio.sleep(0.001)
            return job.result()

        return asyncio.run(main())

    def outputs(self) -> list[Any]:
        return [g["output"] for g in self.got]


def _count_writer_work(engine: Engine, loop: asyncio.AbstractEventLoop) -> list[int]:
    """How many writer jobs and call records are in flight, counted from the moment they are
    handed to the writer thread until their result is back on the loop. An empty queue is not
    enough: the writer may be in the middle of a job (taking a signal, say) while the queue is
    empty, and moving time then would resume the waiting task at a later virtual time."""
    writer = engine._writer
    count = [0]
    on_loop = threading.get_ident()  # called from main(), on the loop's thread

    def done(_: Any) -> None:
        loop.call_soon_threadsafe(lambda: count.__setitem__(0, count[0] - 1))

    def wrap(put: Any) -> Any:
        def counted(arg: Any) -> Any:
            if threading.get_ident() == on_loop:
                count[0] += 1
            else:  # a sync action's thread: counted on the loop, before the decrement
                loop.call_soon_threadsafe(lambda: count.__setitem__(0, count[0] + 1))
            fut = put(arg)
            fut.add_done_callback(done)
            return fut

        return counted

    writer.submit = wrap(writer.submit)  # type: ignore[method-assign]
    writer.put_call = wrap(writer.put_call)  # type: ignore[method-assign]
    return count
