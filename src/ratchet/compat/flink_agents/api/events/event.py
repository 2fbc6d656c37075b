"""Flink Agents' events: one untyped `Event(type, attributes)`, routed by its type string.

Subclasses fix `EVENT_TYPE` and keep their data in `attributes`. An event's `id` is a hash of
its content (so the same event sent again has the same id, live and in a replay). On ratchet,
every event an action sends is stored in the run's journal by ratchet's safe codec and each
listener gets a copy rebuilt from it, as the class that was sent.
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Event subclasses by "module:QualName" (to rebuild a journaled event as its class without
# importing anything the journal names) and by their EVENT_TYPE.
_BY_PATH: dict[str, type[Event]] = {}
_BY_TYPE: dict[str, type[Event]] = {}


def _not_json(value: Any) -> Any:
    raise TypeError(
        f"an event attribute holds a {type(value).__module__}.{type(value).__qualname__}, "
        f"which has no JSON form to hash the event's id from; send plain data, a pydantic "
        f"model, a UUID or an enum"
    )


class Event(BaseModel):
    """An event: a routing `type` string and `attributes`; `id` is derived from the content."""

    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)

    id: UUID | None = Field(default=None)
    type: str
    attributes: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _BY_PATH[f"{cls.__module__}:{cls.__qualname__}"] = cls
        event_type = cls.__dict__.get("EVENT_TYPE")
        if isinstance(event_type, str):
            _BY_TYPE[event_type] = cls

    def _content_id(self) -> UUID:
        text = BaseModel.model_dump_json(self, exclude={"id"}, fallback=_not_json)
        return UUID(bytes=hashlib.md5(text.encode()).digest(), version=3)

    @model_validator(mode="after")
    def _set_id(self) -> Event:
        if not self.type:
            raise ValueError("an event needs a non-empty type string")
        if self.id is None:
            object.__setattr__(self, "id", self._content_id())
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name != "id":
            object.__setattr__(self, "id", self._content_id())

    def get_type(self) -> str:
        """The type string actions are routed by."""
        return self.type

    def get_attr(self, name: str) -> Any:
        """The attribute `name`, or None."""
        return self.attributes.get(name)

    def set_attr(self, name: str, value: Any) -> None:
        """Set the attribute `name` (the id is not recomputed, as in Flink Agents)."""
        self.attributes[name] = value

    @classmethod
    def from_event(cls, event: Event) -> Event:
        """The typed event for `event`; subclasses check their attributes and rebuild."""
        return event


def event_class_for(path: str | None, event_type: str) -> type[Event]:
    """The class to rebuild a stored event as: the class it was sent as, if this process
    defines it; else the class registered for its type; else the plain `Event`."""
    if path is not None and path in _BY_PATH:
        return _BY_PATH[path]
    return _BY_TYPE.get(event_type, Event)


def class_path(cls: type[Event]) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _typed(cls: type[Event], event: Event, required: tuple[str, ...]) -> dict[str, Any]:
    missing = [name for name in required if name not in event.attributes]
    if missing:
        raise ValueError(
            f"{cls.__name__}.from_event: event of type {event.type!r} has no attribute(s) "
            f"{', '.join(map(repr, missing))}"
        )
    return event.attributes


def _with_id(result: Event, source: Event) -> Event:
    object.__setattr__(result, "id", source.id)
    return result


class InputEvent(Event):
    """What each input becomes: its `input` value, heard by actions on `EventType.InputEvent`."""

    EVENT_TYPE: ClassVar[str] = "_input_event"

    def __init__(self, input: Any) -> None:  # noqa: A002 - their parameter name
        super().__init__(type=InputEvent.EVENT_TYPE, attributes={"input": input})

    @classmethod
    def from_event(cls, event: Event) -> InputEvent:
        attrs = _typed(cls, event, ("input",))
        result = _with_id(InputEvent(input=attrs["input"]), event)
        assert isinstance(result, InputEvent)
        return result

    @property
    def input(self) -> Any:
        return self.get_attr("input")


class OutputEvent(Event):
    """What an agent emits: its `output` goes to the job's outputs."""

    EVENT_TYPE: ClassVar[str] = "_output_event"

    def __init__(self, output: Any) -> None:
        super().__init__(type=OutputEvent.EVENT_TYPE, attributes={"output": output})

    @classmethod
    def from_event(cls, event: Event) -> OutputEvent:
        attrs = _typed(cls, event, ("output",))
        result = _with_id(OutputEvent(output=attrs["output"]), event)
        assert isinstance(result, OutputEvent)
        return result

    @property
    def output(self) -> Any:
        return self.get_attr("output")
