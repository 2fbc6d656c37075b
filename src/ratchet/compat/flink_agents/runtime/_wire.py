"""Flink Agents events on ratchet's engine: one ratchet event class per type string.

ratchet routes events by class, Flink Agents by type string. Each type string gets its own
ratchet `Event` class (made on demand, also when a journal names it), whose single field holds
the event's content: the class it was sent as, its type, id, attributes and extra fields.
The content is stored by ratchet's safe codec with its exact types (registered pydantic
models, enums and UUIDs included); a listener gets the event rebuilt from it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel

from ratchet._errors import CodecError
from ratchet.agents._events import Event as RatchetEvent
from ratchet.agents._events import InputEvent as RatchetInput
from ratchet.agents._events import OutputEvent as RatchetOutput
from ratchet.agents._events import register_event_family
from ratchet.compat.flink_agents.api.events.event import (
    Event,
    InputEvent,
    OutputEvent,
    class_path,
    event_class_for,
)
from ratchet.store import codec

PREFIX = "flink_agents:"


class FlinkWire(RatchetEvent):
    """A Flink Agents event in ratchet's event flow (base of the per-type classes)."""

    event_name: ClassVar[str] = "flink_agents.Event"
    event: Any

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        # The content as it is: the codec stores registered models as themselves, where
        # pydantic's dump would flatten them to dicts.
        return {"event": self.event}


class FlinkOutput(RatchetOutput):
    """A Flink Agents `OutputEvent`: its `output` goes to the outbox as it is."""

    event_name: ClassVar[str] = "flink_agents.OutputEvent"

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        return {"output": self.output}


@dataclass(frozen=True)
class KeyedDict:
    """A dict whose keys the codec does not take as map keys (UUIDs, enums, ...): stored as
    its (key, value) pairs and made a dict again when the event is rebuilt."""

    pairs: list[tuple[Any, Any]]


codec.register(KeyedDict, "flink_agents.KeyedDict")
_MAP_KEYS = (str, int, bytes, tuple)


def _lower(value: Any) -> Any:
    t = type(value)
    if t is dict:
        if all(type(k) in _MAP_KEYS for k in value):
            return {k: _lower(v) for k, v in value.items()}
        return KeyedDict([(k, _lower(v)) for k, v in value.items()])
    if t is list:
        return [_lower(v) for v in value]
    return value


def _raise(value: Any) -> Any:
    t = type(value)
    if t is KeyedDict:
        return {k: _raise(v) for k, v in value.pairs}
    if t is dict:
        return {k: _raise(v) for k, v in value.items()}
    if t is list:
        return [_raise(v) for v in value]
    return value


_CLASSES: dict[str, type[FlinkWire]] = {}
_CLASSES_LOCK = threading.Lock()


def wire_class(event_type: str) -> type[FlinkWire]:
    """The ratchet class of events of type `event_type`."""
    cls = _CLASSES.get(event_type)
    if cls is not None:
        return cls
    with _CLASSES_LOCK:  # one class per type: routing compares classes
        cls = _CLASSES.get(event_type)
        if cls is not None:
            return cls
        cls = type(
            f"FlinkEvent[{event_type}]",
            (FlinkWire,),
            {
                "event_name": PREFIX + event_type,
                "__module__": __name__,
                "__qualname__": f"FlinkEvent[{event_type}]",
            },
        )
        _CLASSES[event_type] = cls
        return cls


register_event_family(PREFIX, lambda name: wire_class(name[len(PREFIX) :]))


def listened_classes(event_type: str) -> tuple[type[RatchetEvent], ...]:
    """The ratchet classes an action on `event_type` hears."""
    if event_type == InputEvent.EVENT_TYPE:
        return (RatchetInput, wire_class(event_type))
    if event_type == OutputEvent.EVENT_TYPE:
        return (FlinkOutput,)
    return (wire_class(event_type),)


def _check(value: Any, where: str) -> None:
    try:
        codec.check_admissible(value, where)
    except CodecError:
        raise
    except TypeError as exc:
        raise CodecError(str(exc)) from exc


def to_ratchet(event: Event) -> RatchetEvent:
    """A Flink Agents event as ratchet sends it; refuses content that would not come back as
    it was, naming the event type and the attribute."""
    if not isinstance(event, Event):
        raise TypeError(
            f"send_event() takes a flink_agents Event, got {type(event).__name__}; wrap the "
            f"value, e.g. OutputEvent(output=...)"
        )
    if event.type == OutputEvent.EVENT_TYPE:
        output = event.attributes.get("output")
        _check(output, f"output of event {event.type!r}")
        return FlinkOutput(output=output)
    extra = dict(event.__pydantic_extra__ or {})
    content = {
        "cls": class_path(type(event)),
        "type": event.type,
        "id": event.id,
        "attributes": _lower(dict(event.attributes)),
        "extra": _lower(extra),
    }
    try:
        raw = codec.encode(content)
    except CodecError:
        for name, value in event.attributes.items():
            _check(value, f"attribute {name!r} of event {event.type!r}")
        for name, value in extra.items():
            _check(value, f"field {name!r} of event {event.type!r}")
        raise
    # A private copy: the sender may keep changing the event it sent.
    return wire_class(event.type)(event=codec.decode(raw))


def to_flink(event: RatchetEvent, input_field: str | None = None) -> Event:
    """The event an action receives, rebuilt as the class it was sent as. An input record's
    `input_field` is the input (the whole record if None)."""
    if isinstance(event, RatchetInput):
        record = event.input
        if input_field is not None and isinstance(record, dict):
            record = record.get(input_field)
        return InputEvent(input=record)
    if isinstance(event, FlinkOutput):
        return OutputEvent(output=event.output)
    if not isinstance(event, FlinkWire):
        raise TypeError(f"not a Flink Agents event: {type(event).__name__}")
    content = event.event
    cls = event_class_for(content.get("cls"), content["type"])
    data = {
        "id": content["id"],
        "type": content["type"],
        "attributes": _raise(content["attributes"]),
        **_raise(content.get("extra", {})),
    }
    # Subclasses take their own constructor arguments; build past them, as pydantic would.
    rebuilt = cls.__new__(cls)
    BaseModel.__init__(rebuilt, **data)
    return rebuilt
