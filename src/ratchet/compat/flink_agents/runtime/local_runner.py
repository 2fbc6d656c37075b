"""`LocalRunnerContext`: the runner context of the local environment.

Inside a job it is ratchet's (memory, events and durable calls recorded and replayed). One
made outside any job (`LocalRunnerContext.__new__(LocalRunnerContext)`, as tests of single
calls do) runs durable calls straight through: nothing is recorded and no reconciler is asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ratchet.compat.flink_agents.runtime._adapter import FlinkContext


class LocalRunnerContext(FlinkContext):
    """Flink Agents' local runner context, on ratchet."""

    def _in_job(self) -> bool:
        return "_ctx" in self.__dict__

    def durable_execute(
        self,
        func: Callable[..., Any],
        *args: Any,
        reconciler: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        if self._in_job():
            return super().durable_execute(func, *args, reconciler=reconciler, **kwargs)
        return func(*args, **kwargs)

    def durable_execute_async(
        self,
        func: Callable[..., Any],
        *args: Any,
        reconciler: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        if self._in_job():
            return super().durable_execute_async(func, *args, reconciler=reconciler, **kwargs)
        return asyncio.to_thread(func, *args, **kwargs)
