"""The agent front end: Agent, @action, events, RunnerContext, memory, and running them."""

from ratchet._errors import ReplayedCallError
from ratchet.agents._agent import Agent, action, migration
from ratchet.agents._context import RunnerContext
from ratchet.agents._events import ErrorEvent, Event, InputEvent, OutputEvent
from ratchet.agents._memory import MemoryObject
from ratchet.agents._run import Job, load_agent, run

__all__ = [
    "Agent",
    "ErrorEvent",
    "Event",
    "InputEvent",
    "Job",
    "MemoryObject",
    "OutputEvent",
    "ReplayedCallError",
    "RunnerContext",
    "action",
    "load_agent",
    "migration",
    "run",
]
