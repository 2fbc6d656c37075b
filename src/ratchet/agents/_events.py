"""Events: pydantic models with a stable type name, so a restored journal finds its class."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from ratchet._errors import ConfigError, StateError

_REGISTRY: dict[str, type[Event]] = {}


class Event(BaseModel):
    """Base of every event. Subclass it with typed fields.

    The type is stored in journals by `event_name` (default: the class's qualified name);
    set `event_name` explicitly when two modules define classes with one qualified name, or
    before renaming a class whose events may sit in a state directory.
    """

    model_config = ConfigDict(arbitrary_types_allowed=False, extra="forbid")

    event_name: ClassVar[str] = "Event"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "event_name" not in cls.__dict__:
            cls.event_name = cls.__qualname__
        _register(cls)


def _register(cls: type[Event]) -> None:
    name = cls.event_name
    existing = _REGISTRY.get(name)
    if (
        existing is not None
        and existing is not cls
        and (existing.__module__ != cls.__module__ or existing.__qualname__ != cls.__qualname__)
    ):
        raise ConfigError(
            f"event name {name!r} is used by {existing.__module__}.{existing.__qualname__} and "
            f"{cls.__module__}.{cls.__qualname__}; give one of them its own "
            f"`event_name: ClassVar[str] = '...'`"
        )
    _REGISTRY[name] = cls


_register(Event)


def event_class(name: str) -> type[Event]:
    """The class registered under `name`; a journal naming an unknown class is refused."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise StateError(
            f"the state directory holds an event of type {name!r}, but no Event subclass with "
            f"that event_name is defined; import the module that defines it before restoring"
        ) from None


class InputEvent(Event):
    """The root event of every run: one input record."""

    event_name: ClassVar[str] = "ratchet.InputEvent"
    input: Any


class OutputEvent(Event):
    """An event that leaves the agent: it goes to the outbox and, after a checkpoint, the sink."""

    event_name: ClassVar[str] = "ratchet.OutputEvent"
    output: Any


class ErrorEvent(Event):
    """An action raised: its failure, as data. Actions may listen for it; otherwise it is output."""

    event_name: ClassVar[str] = "ratchet.ErrorEvent"
    action: str
    error_type: str
    message: str
    event_type: str


def event_to_wire(event: Event) -> tuple[str, dict[str, Any]]:
    """(type name, field values) with nested models as dicts: what the journal stores."""
    return type(event).event_name, event.model_dump(mode="python")


def event_from_wire(name: str, fields: dict[str, Any]) -> Event:
    return event_class(name).model_validate(fields)
