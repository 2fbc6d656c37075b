"""What a run asks of the outside world, passed in rather than patched.

`Seams` bundles the clock, the random source for run ids, the prober (input and log
hashing), the executor (runs a stage's command), the receipt writer (whole receipts), the
receipt journal's appender (one record per change of state), the scheduler's waiter and the
environment fingerprint. Production uses the defaults; a test passes fakes, e.g.
`Seams(clock=FakeClock(), executor=my_fake, rng=random.Random(1))`.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from ratchet._clock import SYSTEM_CLOCK
from ratchet.checks._execute import SubprocessExecutor
from ratchet.checks._receipts import JournalAppender, ReceiptWriter, append_record
from ratchet.checks._signing import SECRET_ENV
from ratchet.checks._threads import wait as _stage_wait
from ratchet.checks.checkpoints import Checkpoints
from ratchet.checks.common import atomic_json

__all__ = [
    "ENV_KEYS",
    "Executor",
    "Prober",
    "ProberFactory",
    "ReceiptWriter",
    "Seams",
    "Waiter",
    "environment_fingerprint",
    "extra_env_keys",
]

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

    from ratchet._clock import Clock
    from ratchet.checks._protocols import Executor as Executor
    from ratchet.checks._protocols import Prober as Prober
    from ratchet.checks._protocols import ProberFactory as ProberFactory
    from ratchet.checks._protocols import Waiter as Waiter

_PROTOCOLS = ("Executor", "Prober", "ProberFactory", "Waiter")


def __getattr__(name: str) -> object:
    # The Protocol classes live in `_protocols` (defining one imports `typing`): made on
    # first use, not at every start-up of `ratchet checks`.
    if name in _PROTOCOLS:
        from ratchet.checks import _protocols

        return getattr(_protocols, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Environment variables that enter every cache key; RATCHET_ENV_KEYS (comma-separated) adds more.
ENV_KEYS = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LANG", "LC_ALL", "TZ")


def extra_env_keys() -> list[str]:
    """The names RATCHET_ENV_KEYS adds to the fingerprint (never the signing key's)."""
    names = os.environ.get("RATCHET_ENV_KEYS", "").split(",")
    return [k.strip() for k in names if k.strip() and k.strip() not in SECRET_ENV]


_IMPLEMENTATIONS = {"cpython": "CPython", "pypy": "PyPy"}


def _implementation() -> str:
    """`platform.python_implementation()` without importing `platform` (a few ms at start-up
    of every `ratchet checks`)."""
    name = _IMPLEMENTATIONS.get(sys.implementation.name)
    if name is None:
        import platform

        name = platform.python_implementation()
    return name


def _uname() -> Any:
    """`os.uname()` where there is one: `platform.system()` and `platform.machine()` read the
    same fields."""
    if hasattr(os, "uname"):
        return os.uname()
    import platform

    return platform.uname()


def environment_fingerprint() -> dict[str, str]:
    """What of the machine enters every cache key: the interpreter, platform, chosen env vars."""
    env = {
        "python": sys.version,
        "implementation": _implementation(),
        "executable": sys.executable,
        "machine": _uname().machine,
        "system": _uname().sysname,
    }
    for key in (*ENV_KEYS, *extra_env_keys()):
        if key in os.environ:
            env[f"env:{key}"] = os.environ[key]
    return env


def _atomic_json(path: Path, payload: dict[str, Any]) -> None:
    atomic_json(path, payload)


_FRESH: Any = object()  # the default of a field whose production value is made per instance


class Seams:
    """A run's collaborators; every field has the production default.

    Immutable, like the frozen dataclass it was; a plain class because `dataclasses`
    imports `inspect`, which every `ratchet checks` start-up would pay for."""

    __slots__ = (
        "clock",
        "rng",
        "prober",
        "executor",
        "writer",
        "journal",
        "waiter",
        "environment",
    )
    clock: Clock
    rng: random.Random
    prober: ProberFactory
    executor: Executor
    writer: ReceiptWriter
    # None: no journal; every change of state rewrites the whole receipt through `writer`.
    journal: JournalAppender | None
    waiter: Waiter
    environment: Callable[[], Mapping[str, str] | str]

    def __init__(
        self,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random = _FRESH,
        prober: ProberFactory = Checkpoints,
        executor: Executor = _FRESH,
        writer: ReceiptWriter = _atomic_json,
        journal: JournalAppender | None = append_record,
        waiter: Waiter = _stage_wait,
        environment: Callable[[], Mapping[str, str] | str] = environment_fingerprint,
    ) -> None:
        values = {
            "clock": clock,
            "rng": random.SystemRandom() if rng is _FRESH else rng,
            "prober": prober,
            "executor": SubprocessExecutor() if executor is _FRESH else executor,
            "writer": writer,
            "journal": journal,
            "waiter": waiter,
            "environment": environment,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Seams is immutable: cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Seams is immutable: cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Seams)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"Seams({fields})"
