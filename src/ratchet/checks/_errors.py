"""Errors raised by `ratchet.checks`, rooted in ratchet's hierarchy.

Where the contract asks for a ``ValueError`` (a bad project file, an untrusted or legacy
receipt) the classes subclass it too, so callers may catch either.
"""

from __future__ import annotations

from ratchet._errors import ConfigError, RatchetError, StateError


class ProjectError(ConfigError, ValueError):
    """The project file (or a hand-built plan) is invalid; the message names the field."""


class ReceiptError(StateError, ValueError):
    """A receipt cannot be trusted: missing, unreadable, or its seal does not match."""


class LegacyReceiptError(ReceiptError):
    """A receipt written before checkpoints existed: it grants no reuse."""


class ResumeRefusedError(StateError, ValueError):
    """A run cannot be resumed from this receipt as it stands (e.g. it is still `running`)."""


class StageTimeoutError(RatchetError):
    """A stage ran past its `timeout_seconds`; its process group was killed."""
