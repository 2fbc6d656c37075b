"""The exception hierarchy: every error ratchet raises on purpose derives from RatchetError."""

from __future__ import annotations


class RatchetError(Exception):
    """Root of ratchet's errors; catch this to handle anything ratchet raised on purpose."""


class ConfigError(RatchetError):
    """A user-supplied setting, agent or file is wrong; the message names it and the fix."""


class StateError(RatchetError):
    """A state directory cannot be used as it is (wrong schema, corrupt, locked, wrong agent)."""


class NonDeterminismError(RatchetError):
    """Replay found a different call where the journal recorded one; the agent code changed."""


class CheckpointError(RatchetError):
    """Checkpoints failed more times in a row than the job tolerates."""


class BadInputError(RatchetError):
    """An input record cannot be admitted (invalid JSON, missing key field)."""


class InternalError(RatchetError):
    """A broken invariant inside ratchet: a bug, please report it."""
