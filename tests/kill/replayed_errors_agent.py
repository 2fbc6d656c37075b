"""The agent of the replayed-exceptions kill test: durable calls that raise, and `except` clauses
that must take the same branch after a SIGKILL as in a crash-free run.

With RATCHET_TEST_HOLD set, every action waits (forever) once its durable call has returned or
raised, so the test can SIGKILL the process while each call's outcome is recorded but no
action has committed. Real calls and holds are appended to RATCHET_TEST_EXEC_LOG.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from ratchet import Agent, InputEvent, OutputEvent, action, register_type

_LOG = os.environ.get("RATCHET_TEST_EXEC_LOG")
_fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if _LOG else None


def note(*parts: Any) -> None:
    if _fd is not None:
        os.write(_fd, (" ".join(str(p) for p in (os.getpid(), *parts)) + "\n").encode())


class RateLimited(RuntimeError):
    """Not registered: comes back as a stand-in that is still a RuntimeError."""


@register_type
class Throttled(RuntimeError):
    """Registered, with a keyword-only constructor: comes back as itself."""

    def __init__(self, *, retry_after: int) -> None:
        super().__init__(f"throttled, retry after {retry_after}s")
        self.retry_after = retry_after


class Unexpected(Exception):
    """Not registered, no built-in base but Exception, keyword-only: nobody catches it."""

    def __init__(self, *, code: int) -> None:
        super().__init__(f"unexpected failure {code}")
        self.code = code


def call(kind: str, n: int) -> int:
    note("call", kind, n)
    if kind == "unregistered":
        raise RateLimited(f"rate limited on {n}")
    if kind == "registered":
        raise Throttled(retry_after=n)
    if kind == "builtin":
        raise KeyError(f"missing {n}")
    if kind == "uncaught":
        raise Unexpected(code=n)
    return n * 2


class ErrorsAgent(Agent):
    @action(InputEvent)
    async def go(self, event: InputEvent, ctx: Any) -> None:
        kind, n = event.input["kind"], event.input["n"]
        failure: Exception | None = None
        try:
            value = await ctx.durable_execute_async(call, kind, n)
            path = "primary"
        except RuntimeError as exc:  # the fallback a crash-free run takes
            value = -1
            path = f"fallback after {type(exc).__name__}: {exc}"
            if isinstance(exc, Throttled):
                path += f" (retry_after={exc.retry_after})"
        except LookupError as exc:
            value = -2
            path = f"lookup fallback after {type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - raised again after the hold
            failure = exc
        if os.environ.get("RATCHET_TEST_HOLD"):
            note("held", ctx.key)
            await asyncio.sleep(3600)
        if failure is not None:
            raise failure
        ctx.short_term_memory.set("path", path)
        ctx.short_term_memory.set("value", value)
        ctx.send_event(OutputEvent(output={"path": path, "value": value}))
