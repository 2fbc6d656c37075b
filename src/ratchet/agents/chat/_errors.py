"""Errors of the chat layer; all derive from `ChatError`, itself a `RatchetError`."""

from __future__ import annotations

from ratchet._errors import ConfigError, RatchetError


class ChatError(RatchetError):
    """Root of the chat layer's errors."""


class PromptArgumentError(ChatError, ConfigError):
    """A prompt was formatted without one of its named arguments."""


class ModelCallError(ChatError):
    """A provider refused or failed a request.

    `transient` says whether a retry may succeed (429, 5xx, timeouts, dropped connections);
    `status` is the HTTP status when there was one; `retry_after` is the server's hint in
    seconds. The message carries the provider's own message.
    """

    def __init__(
        self,
        message: str,
        *,
        provider: str = "",
        status: int | None = None,
        transient: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.provider = provider
        self.status = status
        self.transient = transient
        self.retry_after = retry_after


class TurnLimitError(ChatError):
    """The tool loop called the model `max_turns` times without a final reply."""


class TokenBudgetExceededError(ChatError):
    """A run or a key used up its token budget; no further model call is made."""


class StructuredOutputError(ChatError):
    """The model's reply does not validate against the requested output schema."""
