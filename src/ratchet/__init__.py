"""ratchet: durable, event-driven AI agents and incremental, verified check pipelines.

Progress only moves forward: committed work survives `kill -9`, is never done twice, and
every "already done" is re-verified before it is trusted.
"""

from ratchet._errors import (
    BadInputError,
    CheckpointError,
    ConfigError,
    InternalError,
    NonDeterminismError,
    RatchetError,
    StateError,
)
from ratchet.agents import (
    Agent,
    ErrorEvent,
    Event,
    InputEvent,
    Job,
    MemoryObject,
    OutputEvent,
    ReplayedCallError,
    RunnerContext,
    action,
    run,
)
from ratchet.runtime._engine import EngineConfig, EngineResult
from ratchet.store.codec import register as register_type

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "BadInputError",
    "CheckpointError",
    "ConfigError",
    "EngineConfig",
    "EngineResult",
    "ErrorEvent",
    "Event",
    "InputEvent",
    "InternalError",
    "Job",
    "MemoryObject",
    "NonDeterminismError",
    "OutputEvent",
    "RatchetError",
    "ReplayedCallError",
    "RunnerContext",
    "StateError",
    "action",
    "register_type",
    "run",
]
