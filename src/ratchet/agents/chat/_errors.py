"""The chat layer's errors; defined with the whole tree in `ratchet._errors`."""

from __future__ import annotations

from ratchet._errors import (
    ChatError,
    ModelCallError,
    PromptArgumentError,
    StructuredOutputError,
    TokenBudgetExceededError,
    TurnLimitError,
)

__all__ = [
    "ChatError",
    "ModelCallError",
    "PromptArgumentError",
    "StructuredOutputError",
    "TokenBudgetExceededError",
    "TurnLimitError",
]
