"""ratchet: durable, event-driven AI agents and incremental, verified check pipelines.

Progress only moves forward: committed work survives `kill -9`, is never done twice, and
every "already done" is re-verified before it is trusted.
"""

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
    ServerUnreachableError,
    SignalTimeout,
    SinkError,
    StageTimeoutError,
    StateError,
    StateInUseError,
    StateWriteError,
    StructuredOutputError,
    TokenBudgetExceededError,
    TurnLimitError,
    UnknownTypeError,
)

# `typing` and `importlib` are not imported here: `ratchet checks` starts without them.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ratchet._clock import Clock
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
    from ratchet.agents.chat import (
        AnthropicChatModel,
        ChatAgent,
        ChatMessage,
        ChatModel,
        ChatModelSetup,
        ChatRequestEvent,
        ChatResponseEvent,
        MessageRole,
        OllamaChatModel,
        OpenAIChatModel,
        Prompt,
        RateLimit,
        ReActAgent,
        ResourceDescriptor,
        ResourceType,
        RetryPolicy,
        ScriptedChatModel,
        TokenBudget,
        TokenUsage,
        Tool,
        ToolApprovalRequestEvent,
        ToolCall,
        ToolContext,
        ToolRequestEvent,
        ToolResponseEvent,
        chat_model_connection,
        chat_model_setup,
        chat_usage,
        prompt,
        tool,
    )
    from ratchet.runtime._engine import EngineConfig, EngineResult
    from ratchet.runtime._signals import send_signal

__version__ = "0.1.0"

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
    "ServerUnreachableError",
    "SignalTimeout",
    "SinkError",
    "StageTimeoutError",
    "State",
    "StateError",
    "StateInUseError",
    "StateWriteError",
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

# Everything but the error classes is imported on first use, so `import ratchet` (and with
# it `ratchet checks`, which never touches an agent) does not load the agent side, the
# engine, pydantic or msgpack. `import ratchet; ratchet.Agent` works as an eager import did.
_HOME = {
    "Clock": "ratchet._clock",
    "State": "ratchet._state_api",
    "open_state": "ratchet._state_api",
    "register_type": "ratchet.agents._exceptions",
    "LongTermMemory": "ratchet.agents._ltm",
    "LongTermMemoryConfig": "ratchet.agents._ltm",
    "Resource": "ratchet.agents._resource",
    "Retry": "ratchet.agents._retry",
    "EngineConfig": "ratchet.runtime._engine",
    "EngineResult": "ratchet.runtime._engine",
    "send_signal": "ratchet.runtime._signals",
    **dict.fromkeys(
        (
            "Agent",
            "ErrorEvent",
            "Event",
            "InputEvent",
            "Job",
            "MemoryObject",
            "OutputEvent",
            "RunnerContext",
            "action",
            "migration",
            "run",
        ),
        "ratchet.agents",
    ),
}
# The chat layer's public names: the ones in __all__ that no other module above provides.
_HOME.update(
    (name, "ratchet.agents.chat") for name in __all__ if name not in _HOME and name not in globals()
)


def __getattr__(name: str) -> object:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'ratchet' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
