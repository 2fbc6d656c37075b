"""ratchet: durable, event-driven AI agents and incremental, verified check pipelines.

Progress only moves forward: committed work survives `kill -9`, is never done twice, and
every "already done" is re-verified before it is trusted.
"""

from ratchet._clock import Clock
from ratchet._errors import (
    BadInputError,
    ChatError,
    CheckpointError,
    CodecError,
    ConfigError,
    CorruptDataError,
    IncompatibleChangeError,
    InternalError,
    InvalidArgumentError,
    InvalidTypeError,
    LegacyReceiptError,
    MigrationError,
    ModelCallError,
    NonDeterminismError,
    ProjectError,
    PromptArgumentError,
    RatchetError,
    ReceiptError,
    ReplayedCallError,
    ResumeRefusedError,
    SignalTimeout,
    StageTimeoutError,
    StateError,
    StructuredOutputError,
    TokenBudgetExceededError,
    TurnLimitError,
    UnknownTypeError,
)
from ratchet._state_api import State, open_state
from ratchet.agents import (
    Agent,
    ErrorEvent,
    Event,
    InputEvent,
    Job,
    MemoryObject,
    OutputEvent,
    RunnerContext,
    action,
    migration,
    run,
)
from ratchet.agents._exceptions import register_type
from ratchet.agents._ltm import LongTermMemory, LongTermMemoryConfig
from ratchet.agents._resource import Resource
from ratchet.agents._retry import Retry
from ratchet.runtime._engine import EngineConfig, EngineResult
from ratchet.runtime._signals import send_signal

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from ratchet.agents import chat

        return getattr(chat, name)
    raise AttributeError(f"module 'ratchet' has no attribute {name!r}")


__all__ = [
    "Agent",
    "AnthropicChatModel",
    "BadInputError",
    "ChatAgent",
    "ChatError",
    "ChatMessage",
    "ChatModel",
    "ChatModelSetup",
    "ChatRequestEvent",
    "ChatResponseEvent",
    "CheckpointError",
    "Clock",
    "CodecError",
    "ConfigError",
    "CorruptDataError",
    "EngineConfig",
    "EngineResult",
    "ErrorEvent",
    "Event",
    "IncompatibleChangeError",
    "InputEvent",
    "InternalError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "Job",
    "LegacyReceiptError",
    "LongTermMemory",
    "LongTermMemoryConfig",
    "MemoryObject",
    "MessageRole",
    "MigrationError",
    "ModelCallError",
    "NonDeterminismError",
    "OllamaChatModel",
    "OpenAIChatModel",
    "OutputEvent",
    "ProjectError",
    "Prompt",
    "PromptArgumentError",
    "RatchetError",
    "RateLimit",
    "ReActAgent",
    "ReceiptError",
    "ReplayedCallError",
    "Resource",
    "ResourceDescriptor",
    "ResourceType",
    "ResumeRefusedError",
    "Retry",
    "RetryPolicy",
    "RunnerContext",
    "ScriptedChatModel",
    "SignalTimeout",
    "StageTimeoutError",
    "State",
    "StateError",
    "StructuredOutputError",
    "TokenBudget",
    "TokenBudgetExceededError",
    "TokenUsage",
    "Tool",
    "ToolApprovalRequestEvent",
    "ToolCall",
    "ToolContext",
    "ToolRequestEvent",
    "ToolResponseEvent",
    "TurnLimitError",
    "UnknownTypeError",
    "action",
    "chat_model_connection",
    "chat_model_setup",
    "chat_usage",
    "migration",
    "open_state",
    "prompt",
    "register_type",
    "run",
    "send_signal",
    "tool",
]

# The chat layer is imported on first use (`ratchet run` of an agent without models starts
# faster); its public names are the ones in __all__ not defined above.
_LAZY = frozenset(name for name in __all__ if name not in globals())
