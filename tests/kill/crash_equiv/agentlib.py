"""What every generated agent imports: the execution log, the durable functions, stored types.

The execution log (`$CRASH_EQUIV_LOG`) is kept outside ratchet's state. Each line is one
O_APPEND write: `<pid> exec <seq> <task>` when an action starts, `<pid> call <seq> <task>
<site>` when the function behind a durable call really runs. The harness compares it with
what a killed process had committed.

A durable function's result (and a failure's message) names its call site, so the harness
can tell which recorded call a record is without depending on how ratchet numbers calls.
The registered types are here, not in the generated module, so the harness process can
decode the memory the agents wrote.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
import random
import time
from typing import Any

from pydantic import BaseModel

from ratchet.store import codec

LOG_ENV = "CRASH_EQUIV_LOG"

_LOG = os.environ.get(LOG_ENV)
_fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if _LOG else None


def note(*parts: Any) -> None:
    """One line of the execution log, written with one O_APPEND write (atomic for a line)."""
    if _fd is not None:
        os.write(_fd, (" ".join(str(p) for p in (os.getpid(), *parts)) + "\n").encode())


# --- types stored in memory and sent in events -------------------------------------------------


class Color(enum.Enum):
    RED = 1
    BLUE = "b"


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: Any = None


class Tag(BaseModel):
    n: int
    label: str = ""
    blob: bytes = b""


codec.register(Color, "crash_equiv.Color")
codec.register(Point, "crash_equiv.Point")
codec.register(Tag, "crash_equiv.Tag")


class RateLimited(RuntimeError):
    """A user exception class (not a builtin) that a durable call raises."""


# --- durable functions ------------------------------------------------------------------------


def _value(site: str, x: int) -> int:
    return (x * 7 + len(site) * 13) % 1009


def _jitter() -> float:
    return random.random() * 0.003  # timing only; never part of a result


def call(site: str, seq: int, task: str, x: int) -> list[Any]:
    note("call", seq, task, site)
    time.sleep(_jitter())
    return [site, _value(site, x)]


async def acall(site: str, seq: int, task: str, x: int) -> list[Any]:
    note("call", seq, task, site)
    await asyncio.sleep(_jitter())
    return [site, _value(site, x)]


def fail(site: str, seq: int, task: str, x: int) -> list[Any]:
    """Raises ValueError for even x, answers otherwise."""
    note("call", seq, task, site)
    time.sleep(_jitter())
    if x % 2 == 0:
        raise ValueError(f"{site} refused {x}")
    return [site, _value(site, x)]


def fail_custom(site: str, seq: int, task: str, x: int) -> list[Any]:
    """Raises RateLimited (a RuntimeError subclass defined here) for even x."""
    note("call", seq, task, site)
    time.sleep(_jitter())
    if x % 2 == 0:
        raise RateLimited(f"{site} refused {x}")
    return [site, _value(site, x)]


# --- helpers the generated actions use --------------------------------------------------------


def fingerprint(value: Any) -> str:
    """A JSON-safe, process-independent summary of any stored value (for outputs)."""
    if value is None:
        return "-"
    return f"{type(value).__name__}:{codec.digest(value)[:10]}"


def weigh(value: Any) -> int:
    """A small int read from memory into an action's running value."""
    return value % 97 if type(value) is int else 0


def extra_n(event: Any) -> int:
    """Reads the model an event's `extra` field holds (attribute access, as user code would)."""
    return 0 if event.extra is None else int(event.extra.n)
