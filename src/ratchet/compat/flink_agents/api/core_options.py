"""Options of the agent runtime (the ones ratchet's built-in actions read)."""

from __future__ import annotations

from enum import Enum

from ratchet.compat.flink_agents.api.configuration import ConfigOption


class ErrorHandlingStrategy(Enum):
    """What the built-in chat action does when the model call fails."""

    FAIL = "fail"
    RETRY = "retry"
    IGNORE = "ignore"


class AgentExecutionOptions:
    """Option keys and defaults."""

    ERROR_HANDLING_STRATEGY = ConfigOption(
        "error-handling-strategy", ErrorHandlingStrategy, ErrorHandlingStrategy.FAIL
    )
    MAX_RETRIES = ConfigOption("max-retries", int, 3)
    CHAT_ASYNC = ConfigOption("chat.async", bool, True)
    TOOL_CALL_ASYNC = ConfigOption("tool-call.async", bool, True)
    NUM_ASYNC_THREADS = ConfigOption("num-async-threads", int, 4)
