"""Events: pydantic models with a stable type name, so a restored journal finds its class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from ratchet._errors import CodecError, ConfigError, StateError
from ratchet.store import codec

_REGISTRY: dict[str, type[Event]] = {}
# Families of event names whose classes are made on demand (name prefix -> maker); the Apache
# Flink Agents compatibility layer routes its string-typed events this way.
_FAMILIES: dict[str, Callable[[str], type[Event]]] = {}


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
        for prefix, make in _FAMILIES.items():
            if name.startswith(prefix):
                return make(name)
        raise StateError(
            f"the state directory holds an event of type {name!r}, but no Event subclass with "
            f"that event_name is defined; import the module that defines it before restoring"
        ) from None


def register_event_family(prefix: str, make: Callable[[str], type[Event]]) -> None:
    """Let `event_class` find names starting with `prefix` that no class registered yet:
    `make(name)` defines (and so registers) the class. For event types named by strings."""
    if not prefix:
        raise ConfigError("an event family needs a non-empty name prefix")
    _FAMILIES[prefix] = make


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


class DelayedEvent(Event):
    """An event to deliver at `due` (`send_event(..., delay=)`): the run holds it until then.

    Internal: the run machine takes it out of the event flow; no action hears it."""

    event_name: ClassVar[str] = "ratchet.Delayed"
    due: float
    event: tuple[str, dict[str, Any]]


class Emitted:
    """An event as it was emitted, frozen in its wire form; what the engines pass around.

    Events are values: an action that mutates the event it received, or keeps mutating one
    after sending it, must not change what its siblings see, what the journal stores, or what
    a replay sees. So `send_event` freezes the event's wire form (the form journals store)
    and every listener gets its own copy decoded from it (`thaw`), live and in replay alike.
    """

    __slots__ = ("cls", "fields", "_raw", "_spare")

    def __init__(
        self,
        cls: type[Event],
        fields: dict[str, Any],
        raw: bytes | None = None,
        spare: Event | None = None,
    ) -> None:
        self.cls = cls
        self.fields = fields  # private: never handed to user code, never mutated
        self._raw = raw
        # One decoded copy made by the round-trip check, for the first listener; a list so
        # that taking it is one atomic pop under the GIL (sync listeners run on threads).
        self._spare = [spare] if spare is not None else []

    @property
    def raw(self) -> bytes:
        raw = self._raw
        if raw is None:
            raw = self._raw = codec.encode(self.fields)
        return raw

    @property
    def encoded(self) -> bool:
        """Whether its fields were encoded when it was sent (so the codec admitted them)."""
        return self._raw is not None

    def thaw(self) -> Event:
        """A private copy of the event, equal to what was sent."""
        try:
            return self._spare.pop()
        except IndexError:
            pass
        if self._raw is None:
            # Not encoded yet (an input, a journaled event): plain data is copied directly,
            # which gives what decoding its encoding would, without the round trip.
            copied = _plain_copy(self.fields, 0)
            if copied is not _NOT_PLAIN:
                return _validate(self.cls, copied)
        return _validate(self.cls, codec.decode(self.raw))

    def wire(self) -> tuple[str, dict[str, Any]]:
        return self.cls.event_name, self.fields

    def field(self, name: str) -> Any:
        """One field's value as stored (for output records); not to be mutated."""
        return self.fields[name]

    def __repr__(self) -> str:
        return f"Emitted({self.cls.event_name}, {self.fields!r})"


def freeze(event: Event) -> Emitted:
    """Freeze an event being sent; refuse one whose fields would not come back as they are.

    A field typed `Any` holding a pydantic model, say, is stored as a dict: the listener would
    get the model live and a dict after a crash. Refused here, naming the event and the field.
    """
    cls = type(event)
    output = _IS_OUTPUT.get(cls)
    if output is None:
        output = _IS_OUTPUT[cls] = issubclass(cls, OutputEvent)  # slow through the metaclass
    fields = _dump(event)  # new containers: not the sender's
    raw: bytes | None = None
    if not output and _scalars(fields):
        # Exact scalars come back from the stored form as they are, so the round trip
        # through it is skipped (the stored form is made when something needs it); the
        # check below still compares what a listener gets with what was sent.
        copy = _validate(cls, fields)
    else:
        try:
            raw = codec.encode(fields)
        except CodecError:
            codec.check_admissible(fields, f"event {cls.event_name}")  # naming the field
            raise
        if output:
            # Nobody listens to an output: it leaves as its stored fields, live and in replay.
            return Emitted(cls, fields, raw)
        copy = _validate(cls, codec.decode(raw))
    sent_fields, back_fields = event.__dict__, copy.__dict__  # pydantic keeps fields there
    for f in cls.__pydantic_fields__:
        sent, back = sent_fields[f], back_fields[f]
        if type(sent) is type(back) and (sent is back or type(sent) in _EXACT and sent == back):
            continue  # the same value (what `_same` says, without its call)
        if not _same(sent, back):
            name = cls.event_name
            raise CodecError(
                f"event {name}: field {f!r} holds {type(sent).__name__} {sent!r:.80}, which "
                f"comes back as {type(back).__name__} {back!r:.80} after it is stored; a "
                f"listener would see one live and the other after a crash. Declare the "
                f"field with its type (e.g. `{f}: {type(sent).__name__}`) or send plain data"
            )
    return Emitted(cls, fields, raw, copy)


_IS_OUTPUT: dict[type, bool] = {}
# Types whose equal values are the same value (`_same` says so without looking further).
_EXACT = frozenset((str, int, bool, bytes))

# Per event class: whether it keeps pydantic's own model_dump / model_validate, which freeze
# and thaw then call the serializer and validator of directly (what those methods do, without
# their argument handling, which cost as much as the work on a small event).
_PLAIN_DUMP: dict[type, bool] = {}
_PLAIN_VALIDATE: dict[type, bool] = {}


def _dump(event: Event) -> dict[str, Any]:
    cls = type(event)
    plain = _PLAIN_DUMP.get(cls)
    if plain is None:
        plain = _PLAIN_DUMP[cls] = cls.model_dump is BaseModel.model_dump
    if plain:
        fields: dict[str, Any] = cls.__pydantic_serializer__.to_python(event, mode="python")
        return fields
    return event.model_dump(mode="python")


def _validate(cls: type[Event], data: Any) -> Event:
    plain = _PLAIN_VALIDATE.get(cls)
    if plain is None:
        plain = _PLAIN_VALIDATE[cls] = getattr(cls.model_validate, "__func__", None) is getattr(
            BaseModel.model_validate, "__func__", BaseModel
        )
    if plain:
        event: Event = cls.__pydantic_validator__.validate_python(data)
        return event
    return cls.model_validate(data)


# The exact types a value of plain data may have at its leaves (subclasses are not plain).
_SCALAR_TYPES = frozenset((str, int, float, bool, bytes, type(None)))


def _scalars(fields: dict[str, Any]) -> bool:
    """Whether every value is exactly a None, bool, int, float, str or bytes."""
    for v in fields.values():
        if type(v) not in _SCALAR_TYPES:
            return False
    return True


_NOT_PLAIN: Any = object()
# Containers this deep go through the codec, which refuses what it cannot encode.
_PLAIN_DEPTH = codec.MAX_DEPTH - 1


def _plain_copy(v: Any, depth: int) -> Any:
    """`codec.decode(codec.encode(v))` for a tree of dicts with str keys, lists, and None,
    bool, int, float, str and bytes leaves; `_NOT_PLAIN` for anything else (and for trees
    nested deeply enough to come near the codec's limit), which the caller sends through the
    codec instead."""
    t = type(v)
    if t in _SCALAR_TYPES:
        return v
    if t is not dict and t is not list:
        return _NOT_PLAIN
    if depth >= _PLAIN_DEPTH:
        return _NOT_PLAIN
    if t is dict:
        out = {}
        for k, x in v.items():
            if type(k) is not str:
                return _NOT_PLAIN
            c = x if type(x) in _SCALAR_TYPES else _plain_copy(x, depth + 1)
            if c is _NOT_PLAIN:
                return _NOT_PLAIN
            out[k] = c
        return out
    items = []
    for x in v:
        c = x if type(x) in _SCALAR_TYPES else _plain_copy(x, depth + 1)
        if c is _NOT_PLAIN:
            return _NOT_PLAIN
        items.append(c)
    return items


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types all the way down (NaN equals NaN: it round-trips)."""
    t = type(a)
    if t is not type(b):
        return False
    if t is int or t is str or t is bool:
        return bool(a == b)
    if a is b:
        return True
    if t is float:
        return bool(a == b or (a != a and b != b))
    if t is list or t is tuple:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if t is dict:
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    return bool(a == b)


def emitted_from_wire(name: str, fields: dict[str, Any]) -> Emitted:
    """A journaled event: its class found by name, its fields as stored."""
    return Emitted(event_class(name), fields)
