"""Incremental, verified check runs with sealed receipts (`ratchet checks`).

`runner.run_checks` runs a plan of stages; `--resume` reuses only checkpoints whose cache
key still matches and whose log evidence re-hashes to what the receipt sealed.
"""

from ratchet.checks._errors import (
    LegacyReceiptError,
    ProjectError,
    ReceiptError,
    ResumeRefusedError,
    StageTimeoutError,
)
from ratchet.checks._plan import load_project, plan_stages

__all__ = [
    "LegacyReceiptError",
    "ProjectError",
    "ReceiptError",
    "ResumeRefusedError",
    "StageTimeoutError",
    "load_project",
    "plan_stages",
]
