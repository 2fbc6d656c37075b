"""The check runner's errors; defined with the whole tree in `ratchet._errors`."""

from __future__ import annotations

from ratchet._errors import (
    LegacyReceiptError,
    ProjectError,
    ReceiptError,
    ResumeRefusedError,
    StageTimeoutError,
)

__all__ = [
    "LegacyReceiptError",
    "ProjectError",
    "ReceiptError",
    "ResumeRefusedError",
    "StageTimeoutError",
]
