"""The check runner's errors; defined with the whole tree in `ratchet._errors`."""

from __future__ import annotations

from ratchet._errors import (
    ConfigError,
    LegacyReceiptError,
    ProjectError,
    ReceiptError,
    ResumeRefusedError,
    StageTimeoutError,
)

__all__ = [
    "EmptyPlanError",
    "LegacyReceiptError",
    "ProjectError",
    "ReceiptError",
    "ResumeRefusedError",
    "StageTimeoutError",
]


class EmptyPlanError(ConfigError):
    """The plan selected no check: an empty run verifies nothing, so it is not a pass."""
