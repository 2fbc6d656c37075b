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
from ratchet.checks._seams import Executor, Prober, Seams

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
