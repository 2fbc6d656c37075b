"""Incremental, verified check runs with sealed receipts (`ratchet checks`).

`runner.run_checks` runs a plan of stages; `--resume` reuses only checkpoints whose cache
key still matches and whose log evidence re-hashes to what the receipt sealed. `Seams`
passes in the clock, random source, prober, executor and receipt writer a run uses.
"""

from ratchet.checks._errors import (
    LegacyReceiptError,
    ProjectError,
    ReceiptError,
    ResumeRefusedError,
    StageTimeoutError,
)
from ratchet.checks._plan import load_project, plan_stages
from ratchet.checks._seams import Seams

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ratchet.checks._protocols import Executor, Prober


def __getattr__(name: str) -> object:
    # `Executor` and `Prober` are `typing.Protocol`s: made on first use, so that a
    # `ratchet checks` start-up does not import `typing` (see `_protocols`).
    if name in ("Executor", "Prober"):
        from ratchet.checks import _protocols

        return getattr(_protocols, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "Executor",
    "LegacyReceiptError",
    "Prober",
    "ProjectError",
    "ReceiptError",
    "ResumeRefusedError",
    "Seams",
    "StageTimeoutError",
    "load_project",
    "plan_stages",
]
