"""The safe typed codec: msgpack plus extension types and an explicit class registry.

Why it exists: durable state, journals and call digests must give back every value with its
exact type (a tuple stays a tuple, True stays a bool, bytes stay bytes, a registered model
comes back as that model), and reading a state directory must never run code it names. So
there is no pickle and decoding never imports anything: a class is found only in the registry
that the program itself filled with `register()`.

How: `encode` first *lowers* a value, walking it once in Python to check admissibility and to
replace everything msgpack cannot express exactly (tuples, sets, big ints, datetimes, ...) by
`ExtType` records; containers are copied only when something inside them changed, so a dict of
plain ints and strs goes straight to msgpack's C packer unchanged. `decode` is a single
`msgpack.unpackb` whose `ext_hook` rebuilds the extension types.

Nesting: encode refuses values nested more than MAX_DEPTH containers deep, so what it writes
has at most MAX_DECODE_DEPTH (= MAX_DEPTH + 1) extension records nested in each other; decode
refuses deeper nesting. Whatever bytes it is given, decode raises only CorruptDataError or
UnknownTypeError, and never crashes the process (the stored bytes may come from an untrusted
or damaged disk).

Wire format (frozen: stored state and digests depend on it; add new codes, never reuse one):

    native msgpack   None, bool, int in [-2**63, 2**64), float (binary64), str (UTF-8, lone
                     surrogates kept via surrogatepass), bytes (bin), list (array),
                     dict (map, keys str/int/bytes/tuple, insertion order)
    ext 1  int       outside the native range: big-endian two's complement bytes
    ext 2  tuple     payload: array of items
    ext 3  set       payload: array of members
    ext 4  frozenset payload: array of members
    ext 5  bytearray payload: the raw bytes
    ext 6  datetime  payload: [year, month, day, hour, minute, second, microsecond, fold, tz]
    ext 7  date      payload: proleptic Gregorian ordinal
    ext 8  time      payload: [hour, minute, second, microsecond, fold, tz]
    ext 9  timedelta payload: [days, seconds, microseconds]
    ext 10 Decimal   payload: ASCII str(value) (keeps sign, exponent, NaN, sNaN, Infinity)
    ext 11 UUID      payload: the 16 bytes
    ext 12 registered payload: [registered name, state]; state is the enum's value, the
                     dataclass's field dict, or the model's model_dump(mode="python") dict

    tz is nil (naive), an int (fixed offset in microseconds), [offset, name] (a
    datetime.timezone with an explicit name), or a str (a zoneinfo.ZoneInfo key).

The canonical form used by `digest` is the same format with every dict (including the field
dicts of registered objects) and every set ordered by the encoded bytes of its keys/members, so
equal values give one digest whatever their insertion order; it decodes with `decode` too.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
import threading
from collections.abc import Callable, Iterable
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from decimal import Decimal
from enum import Enum
from typing import Any, Literal, TypeVar
from uuid import UUID
from zoneinfo import ZoneInfo

import msgpack
from msgpack import ExtType

from ratchet._errors import (
    CodecError,
    CorruptDataError,
    InvalidArgumentError,
    InvalidTypeError,
    UnknownTypeError,
)

__all__ = [
    "CodecError",
    "CorruptDataError",
    "UnknownTypeError",
    "UnknownValue",
    "check_admissible",
    "decode",
    "digest",
    "encode",
    "encode_canonical",
    "lookup",
    "register",
    "registered_name",
]

T = TypeVar("T", bound=type)


# --- wire constants ------------------------------------------------------------------------

_BIGINT = 1
_TUPLE = 2
_SET = 3
_FROZENSET = 4
_BYTEARRAY = 5
_DATETIME = 6
_DATE = 7
_TIME = 8
_TIMEDELTA = 9
_DECIMAL = 10
_UUID = 11
_REGISTERED = 12

_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1

# Nesting deeper than this is refused (and a self-reference always is): it keeps encode and
# decode far from Python's recursion limit, and turns cycles into a clear error.
MAX_DEPTH = 100

_REGISTER_HINT = "ratchet.register_type"

# --- the registry --------------------------------------------------------------------------

_ENUM = 0
_DATACLASS = 1
_MODEL = 2


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    kind: int
    fields: tuple[str, ...] = ()  # dataclasses: every field, in definition order
    no_init: frozenset[str] = frozenset()  # dataclasses: fields with init=False


_BY_CLS: dict[type, _Entry] = {}
_BY_NAME: dict[str, type] = {}
_REGISTRY_LOCK = threading.Lock()


def _pydantic_base() -> type | None:
    """pydantic's BaseModel if pydantic is loaded; a class cannot be a model otherwise."""
    module = sys.modules.get("pydantic")
    return getattr(module, "BaseModel", None) if module is not None else None


def register(cls: T, name: str | None = None) -> T:
    """Admit instances of `cls` (an Enum, a dataclass or a pydantic model) under `name`.

    Only registered classes can be encoded or decoded, so stored data can never make the
    decoder import or build anything the program did not choose. The name is what is stored;
    keep it stable (it defaults to "module.QualName"). Returns `cls`, so it works as a
    decorator. Registering a different class under a taken name, or one class under two
    names, raises ValueError; registering the same class again under its name is a no-op.
    """
    if not isinstance(cls, type):
        # e.g. @register("name"), which passes the name as the class
        raise InvalidTypeError(
            f"register() takes a class, not {cls!r}; use register(cls, name=...)"
        )
    if name is None:
        name = f"{cls.__module__}.{cls.__qualname__}"
    if type(name) is not str or not name:
        raise InvalidTypeError(f"register() name must be a non-empty str, not {name!r}")
    base = _pydantic_base()
    if issubclass(cls, Enum):
        entry = _Entry(name, _ENUM)
    elif base is not None and issubclass(cls, base):
        entry = _Entry(name, _MODEL)
    elif dataclasses.is_dataclass(cls):
        fields = dataclasses.fields(cls)
        entry = _Entry(
            name,
            _DATACLASS,
            tuple(f.name for f in fields),
            frozenset(f.name for f in fields if not f.init),
        )
    else:
        raise InvalidTypeError(
            f"register() takes an Enum, a dataclass or a pydantic BaseModel class, not {cls!r}; "
            "convert other objects to one of those or to a dict"
        )
    with _REGISTRY_LOCK:
        taken = _BY_NAME.get(name)
        if taken is not None and taken is not cls:
            raise InvalidArgumentError(
                f"cannot register {cls!r} as {name!r}: that name is already registered "
                f"for {taken!r}; pass a different name"
            )
        known = _BY_CLS.get(cls)
        if known is not None and known.name != name:
            raise InvalidArgumentError(
                f"cannot register {cls!r} as {name!r}: it is already registered as {known.name!r}"
            )
        _BY_CLS[cls] = entry
        _BY_NAME[name] = cls
    return cls


def registered_name(cls: type) -> str | None:
    """The name `cls` is stored under, or None if it is not registered."""
    entry = _BY_CLS.get(cls)
    return entry.name if entry is not None else None


def lookup(name: str) -> type:
    """The class registered under `name`; raises UnknownTypeError if there is none."""
    cls = _BY_NAME.get(name)
    if cls is None:
        raise UnknownTypeError(_unknown_message(name))
    return cls


def _unknown_message(name: object) -> str:
    return (
        f"the data names registered type {name!r}, which is not registered in this process; "
        f"call {_REGISTER_HINT}(<the class>, name={name!r}) before decoding"
    )


# --- packing -------------------------------------------------------------------------------

_tls = threading.local()


def _packers() -> tuple[msgpack.Packer, msgpack.Packer]:
    """This thread's packers: reusing one is twice as fast as msgpack.packb on small values.

    They are never re-entered: lowered values need no `default` hook, so a pack call never
    runs Python code.
    """
    pair = (
        msgpack.Packer(strict_types=True, autoreset=True),
        msgpack.Packer(strict_types=True, autoreset=True, unicode_errors="surrogatepass"),
    )
    _tls.packers = pair
    return pair


def _pack(lowered: Any) -> bytes:
    """Pack a lowered value; strs with lone surrogates take a slower, lossless retry."""
    try:
        fast, slow = _tls.packers
    except AttributeError:
        fast, slow = _packers()
    try:
        packed: bytes = fast.pack(lowered)
    except UnicodeEncodeError:
        packed = slow.pack(lowered)
    return packed


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


# --- rejection and paths -------------------------------------------------------------------


class _Reject(Exception):
    """Internal: an inadmissible value; containers add their path part as it propagates."""

    def __init__(self, what: str, advice: str, kind: str = "value") -> None:
        super().__init__(what)
        self.what = what
        self.advice = advice
        self.kind = kind  # "value", "key" (a dict key), "deep" (too deep or a cycle)
        self.parts: list[tuple[str, Any]] = []  # innermost first
        self.key: Any = None
        self.key_pending = False  # a key failure not yet claimed by its dict
        self.key_inner = ""  # for a tuple key: where inside the key the problem is


def _short_repr(obj: object, limit: int = 60) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{type(obj).__name__} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _render(prefix: str, parts: list[tuple[str, Any]]) -> str:
    """Render path parts (outermost first) after `prefix`: a.b, a["x y"], a[2], a{member}."""
    out = prefix
    for tag, item in parts:
        if tag == "i":
            out += f"[{item}]"
        elif tag == "m":
            out += "{" + _short_repr(item) + "}"
        elif type(item) is str and item.isidentifier():
            out += f".{item}" if out else item
        elif type(item) is str:
            out += "[" + json.dumps(item, ensure_ascii=False) + "]"
        else:
            out += f"[{_short_repr(item)}]"
    return out


def _where(path: str) -> str:
    return f"'{path}'" if path else "the top level"


def _error(rej: _Reject, value: Any, prefix: str, limit: int = MAX_DEPTH) -> CodecError:
    """Turn an internal rejection into the public error, with the full path."""
    path = _render(prefix, rej.parts[::-1])
    if rej.kind == "key":
        inner = f" contains, at {rej.key_inner}, something that" if rej.key_inner else ""
        return CodecError(
            f"dict key {_short_repr(rej.key)} at {_where(path)}{inner} {rej.what}; {rej.advice}"
        )
    if rej.kind == "deep":
        cycle = _find_cycle(value, [], {})
        if cycle is not None:
            back, ancestor = cycle
            anc = _render(prefix, ancestor)
            return CodecError(
                f"value at '{_render(prefix, back)}' refers back to "
                f"{f'its container {anc!r}' if anc else 'the top-level value'} "
                "(a self-referencing structure); break the cycle, e.g. store an id instead"
            )
        shown = path if len(path) <= 120 else path[:117] + "..."
        return CodecError(
            f"value at '{shown}' is nested more than {limit} levels deep; "
            "flatten it (e.g. store a list of records with parent ids)"
        )
    subject = f"value at '{path}'" if path else "top-level value"
    return CodecError(f"{subject} {rej.what}; {rej.advice}")


_ADMITTED = (
    "None, bool, int, float, str, bytes, bytearray, list, tuple, dict, set, frozenset, "
    "datetime, date, time, timedelta, Decimal, UUID and registered classes"
)

# Admitted base types, most specific first, to explain why a subclass is refused.
_BASES: tuple[type, ...] = (
    bool,
    int,
    float,
    str,
    bytes,
    bytearray,
    list,
    tuple,
    dict,
    frozenset,
    set,
    datetime,
    date,
    time,
    timedelta,
    Decimal,
    UUID,
)


# Advice for values of a type that is never admitted, by the layer that defines the type (the
# codec imports no agent code): a memory view sent in an event is told to send `.to_dict()`.
_ADVICE: dict[type, tuple[str, str]] = {}


def advise(cls: type, what: str, advice: str) -> None:
    """Refuse instances of `cls` with this description (after "is a") and advice."""
    _ADVICE[cls] = (what, advice)


def _reject_type(value: Any) -> _Reject:
    """Explain why a value of an unadmitted type is refused and what to use instead."""
    t = type(value)
    advised = _ADVICE.get(t)
    if advised is not None:
        return _Reject(f"is a {advised[0]}", advised[1])
    what = f"is a {t!r}"
    qual = getattr(t, "__qualname__", t.__name__)
    module = getattr(t, "__module__", "") or ""
    base = _pydantic_base()
    if isinstance(value, Enum):
        return _Reject(
            what, f"register the enum with {_REGISTER_HINT}({qual}) or store its .value instead"
        )
    if base is not None and isinstance(value, base):
        return _Reject(
            what, f"register it with {_REGISTER_HINT}({qual}) or store its model_dump() instead"
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _Reject(
            what, f"register it with {_REGISTER_HINT}({qual}) or convert it to a dict instead"
        )
    if module.split(".")[0] in ("numpy", "pandas", "torch", "jax", "tensorflow"):
        return _Reject(
            what,
            "convert it to plain Python values instead: arrays with .tolist(), "
            "scalars with .item() (or int()/float())",
        )
    if t is memoryview:
        return _Reject(what, "convert it with bytes(value) instead")
    if t is UnknownValue:
        return _Reject(
            f"{what} standing in for registered type {value.type_name!r}, which this process "
            "has not registered",
            f"register that class with {_REGISTER_HINT}(...) and decode the data again",
        )
    for admitted in _BASES:
        if isinstance(value, admitted):
            name = admitted.__name__
            extra = " or a registered dataclass" if admitted is tuple else ""
            return _Reject(
                f"{what}, a subclass of {name}",
                f"subclasses are refused because they would come back as a plain {name}; "
                f"convert it with {name}(value){extra} instead",
            )
    return _Reject(
        what,
        f"only {_ADMITTED} are admitted: convert it to one of those (e.g. a dict, list or "
        f"float), or make it a dataclass or pydantic model and register it with "
        f"{_REGISTER_HINT}(...) instead",
    )


def _reject_key(key: Any) -> _Reject:
    t = type(key)
    if t is bool:
        advice = "keys must be str, int, bytes or tuple (bool keys are refused: True == 1)"
    else:
        advice = "keys must be str, int, bytes or tuple: convert the key, e.g. str(key)"
    rej = _Reject(f"is a {t!r}", advice, kind="key")
    rej.key = key
    rej.key_pending = True
    return rej


# --- lowering: validation + conversion to what msgpack packs natively -----------------------


def _lower(v: Any, depth: int, canon: bool) -> Any:
    """Check `v` and return it in packable form (ExtType records for non-native types)."""
    t = type(v)
    if t is str or t is bool or t is float or v is None or t is bytes:
        return v
    if t is int:
        if -9223372036854775808 <= v <= 18446744073709551615:
            return v
        return ExtType(_BIGINT, v.to_bytes((v.bit_length() + 8) // 8, "big", signed=True))
    if depth >= MAX_DEPTH:
        raise _Reject("", "", kind="deep")
    if t is dict:
        return _lower_dict(v, depth, canon)
    if t is list:
        return _lower_list(v, depth, canon)
    lowerer = _LOWERERS.get(t)
    if lowerer is not None:
        return lowerer(v, depth, canon)
    entry = _BY_CLS.get(t)
    if entry is not None:
        return _lower_registered(v, entry, depth, canon)
    raise _reject_type(v)


def _lower_key(k: Any, depth: int, canon: bool) -> Any:
    t = type(k)
    if t is str or t is bytes:
        return k
    if t is int:
        return _lower(k, depth, canon)
    if t is tuple:
        try:
            return _lower_tuple(k, depth, canon)
        except _Reject as rej:
            if rej.kind == "deep":
                raise
            key_rej = _Reject(rej.what, rej.advice, kind="key")
            key_rej.key = k
            key_rej.key_pending = True
            key_rej.key_inner = "'" + _render("", rej.parts[::-1]) + "'"
            raise key_rej from None
    raise _reject_key(k)


def _lower_dict(d: dict[Any, Any], depth: int, canon: bool) -> dict[Any, Any]:
    if canon:
        return _lower_dict_canonical(d, depth)
    out: dict[Any, Any] | None = None
    k: Any = None
    depth += 1
    try:
        for k, x in d.items():
            lk = k if type(k) is str else _lower_key(k, depth, False)
            tx = type(x)
            if (
                tx is str
                or tx is bool
                or tx is float
                or x is None
                or tx is bytes
                or (tx is int and -9223372036854775808 <= x <= 18446744073709551615)
            ):
                lx = x
            else:
                lx = _lower(x, depth, False)
            if out is None:
                if lk is k and lx is x:
                    continue
                out = {}
                for k2, x2 in d.items():
                    if k2 is k:
                        break
                    out[k2] = x2
            out[lk] = lx
    except _Reject as rej:
        if rej.key_pending:
            rej.key_pending = False
        else:
            rej.parts.append(("k", k))
        raise
    if out is None:
        return d
    if len(out) != len(d):
        raise _Reject("has keys that encode identically", "make the keys distinct")
    return out


def _lower_dict_canonical(d: dict[Any, Any], depth: int) -> dict[Any, Any]:
    """Rebuild `d` with keys in the order of their encoded bytes (for digests)."""
    items: list[tuple[bytes, Any, Any]] = []
    k: Any = None
    depth += 1
    try:
        for k, x in d.items():
            lk = _lower_key(k, depth, True)
            items.append((_pack(lk), lk, _lower(x, depth, True)))
    except _Reject as rej:
        if rej.key_pending:
            rej.key_pending = False
        else:
            rej.parts.append(("k", k))
        raise
    items.sort(key=lambda item: item[0])
    out = {lk: lx for _, lk, lx in items}
    if len(out) != len(d):
        raise _Reject("has keys that encode identically", "make the keys distinct")
    return out


def _lower_items(seq: list[Any] | tuple[Any, ...], depth: int, canon: bool) -> list[Any] | None:
    """Lowered items of a list or tuple, or None when every item is already packable."""
    out: list[Any] | None = None
    x: Any = None
    depth += 1
    try:
        for x in seq:
            tx = type(x)
            if (
                tx is str
                or tx is bool
                or tx is float
                or x is None
                or tx is bytes
                or (tx is int and -9223372036854775808 <= x <= 18446744073709551615)
            ):
                lx = x
            else:
                lx = _lower(x, depth, canon)
            if out is None:
                if lx is x:
                    continue
                out = []
                for x2 in seq:
                    if x2 is x:
                        break
                    out.append(x2)
            out.append(lx)
    except _Reject as rej:
        index = next(i for i, item in enumerate(seq) if item is x)
        rej.parts.append(("i", index))
        raise
    return out


def _lower_list(v: list[Any], depth: int, canon: bool) -> list[Any]:
    out = _lower_items(v, depth, canon)
    return v if out is None else out


def _lower_tuple(v: tuple[Any, ...], depth: int, canon: bool) -> ExtType:
    out = _lower_items(v, depth, canon)
    return ExtType(_TUPLE, _pack(list(v) if out is None else out))


def _lower_set(v: set[Any] | frozenset[Any], depth: int, canon: bool) -> ExtType:
    code = _SET if type(v) is set else _FROZENSET
    members: list[Any] = []
    x: Any = None
    depth += 1
    try:
        for x in v:
            members.append(_lower(x, depth, canon))
    except _Reject as rej:
        rej.parts.append(("m", x))
        raise
    if canon:
        packed = sorted(_pack(m) for m in members)
        return ExtType(code, _array_header(len(packed)) + b"".join(packed))
    return ExtType(code, _pack(members))


def _lower_bytearray(v: bytearray, depth: int, canon: bool) -> ExtType:
    return ExtType(_BYTEARRAY, bytes(v))


def _lower_tz(tz: tzinfo | None, kind: str) -> Any:
    if tz is None:
        return None
    t = type(tz)
    if t is timezone:
        offset = tz.utcoffset(None)
        assert offset is not None  # a fixed-offset timezone always has one
        micros = (offset.days * 86400 + offset.seconds) * 1000000 + offset.microseconds
        name = tz.tzname(None)
        if name == timezone(offset).tzname(None):
            return micros
        return [micros, name]
    if isinstance(tz, ZoneInfo) and t is ZoneInfo and tz.key is not None:
        return tz.key
    fix = (
        "value.astimezone(timezone(value.utcoffset()))"
        if kind == "datetime"
        else "value.replace(tzinfo=timezone(value.utcoffset()))"
    )
    if t is ZoneInfo:
        raise _Reject(
            f"is a {kind} whose ZoneInfo has no key (loaded from a file)",
            f"use ZoneInfo(key) or a fixed offset: {fix}",
        )
    raise _Reject(
        f"is a {kind} with tzinfo {t!r}",
        f"only datetime.timezone and zoneinfo.ZoneInfo time zones are admitted: convert it "
        f"with {fix} instead",
    )


def _lower_datetime(v: datetime, depth: int, canon: bool) -> ExtType:
    tz = _lower_tz(v.tzinfo, "datetime")
    return ExtType(
        _DATETIME,
        _pack([v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond, v.fold, tz]),
    )


def _lower_date(v: date, depth: int, canon: bool) -> ExtType:
    return ExtType(_DATE, _pack(v.toordinal()))


def _lower_time(v: time, depth: int, canon: bool) -> ExtType:
    tz = _lower_tz(v.tzinfo, "time")
    return ExtType(_TIME, _pack([v.hour, v.minute, v.second, v.microsecond, v.fold, tz]))


def _lower_timedelta(v: timedelta, depth: int, canon: bool) -> ExtType:
    return ExtType(_TIMEDELTA, _pack([v.days, v.seconds, v.microseconds]))


def _lower_decimal(v: Decimal, depth: int, canon: bool) -> ExtType:
    return ExtType(_DECIMAL, str(v).encode("ascii"))


def _lower_uuid(v: UUID, depth: int, canon: bool) -> ExtType:
    return ExtType(_UUID, v.bytes)


_LOWERERS: dict[type, Callable[[Any, int, bool], Any]] = {
    tuple: _lower_tuple,
    set: _lower_set,
    frozenset: _lower_set,
    bytearray: _lower_bytearray,
    datetime: _lower_datetime,
    date: _lower_date,
    time: _lower_time,
    timedelta: _lower_timedelta,
    Decimal: _lower_decimal,
    UUID: _lower_uuid,
}


def _lower_registered(v: Any, entry: _Entry, depth: int, canon: bool) -> ExtType:
    if entry.kind == _ENUM:
        try:
            state = _lower(v.value, depth + 1, canon)
        except _Reject as rej:
            rej.parts.append(("k", "value"))
            raise
    else:
        if entry.kind == _DATACLASS:
            try:
                fields = {name: getattr(v, name) for name in entry.fields}
            except AttributeError as exc:
                raise _Reject(f"is a {type(v)!r} with an unset field ({exc})", "set it") from None
        else:
            try:
                fields = v.model_dump(mode="python")
            except Exception as exc:
                raise _Reject(
                    f"is a {type(v)!r} whose model_dump() failed ({exc})",
                    "make the model dumpable (no cycles, no unserializable fields)",
                ) from None
        if type(fields) is dict:
            # Lowered at this object's depth, so field names extend the path directly
            # ("order.items"), as if the object were the dict.
            state = _lower_dict(fields, depth, canon)
        else:  # a RootModel dumps its root value
            state = _lower(fields, depth + 1, canon)
    return ExtType(_REGISTERED, _pack([entry.name, state]))


def _children(v: Any) -> list[tuple[tuple[str, Any], Any]]:
    """Direct children of a container with their path parts (for finding cycles)."""
    t = type(v)
    if t is list or t is tuple:
        return [(("i", i), x) for i, x in enumerate(v)]
    if t is dict:
        return [(("k", k), x) for k, x in v.items()]
    if t is set or t is frozenset:
        return [(("m", x), x) for x in v]
    entry = _BY_CLS.get(t)
    if entry is not None and entry.kind == _DATACLASS:
        return [(("k", name), getattr(v, name, None)) for name in entry.fields]
    return []


def _find_cycle(
    v: Any,
    parts: list[tuple[str, Any]],
    active: dict[int, list[tuple[str, Any]]],
    done: set[int] | None = None,
) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]] | None:
    """(path of a back-reference, path of the container it points to), or None.

    A depth-first search that skips containers already fully explored, so shared
    sub-structures cost linear time, not one visit per path.
    """
    if done is None:
        done = set()
    children = _children(v)
    ident = id(v)
    if not children or ident in done or len(parts) > MAX_DEPTH + 1:
        return None
    if ident in active:
        return parts, active[ident]
    active[ident] = parts
    for part, child in children:
        found = _find_cycle(child, [*parts, part], active, done)
        if found is not None:
            return found
    del active[ident]
    done.add(ident)
    return None


def _lower_top(value: Any, prefix: str, canon: bool, depth: int = 0) -> Any:
    try:
        return _lower(value, depth, canon)
    except _Reject as rej:
        raise _error(rej, value, prefix, MAX_DEPTH - depth) from None
    except RecursionError:
        raise CodecError(
            f"value at {_where(prefix)} is nested too deeply to encode; flatten it"
        ) from None


# --- public encode side ----------------------------------------------------------------------


def check_admissible(value: Any, path: str = "", depth: int = 0) -> None:
    """Raise CodecError (a TypeError) unless `encode(value)` would succeed.

    Lets a caller refuse a value when it is handed over (e.g. a memory `set()`), long before
    it is written. `path` names the value in the message ("order" gives "order.items[2]").
    `depth`: how many containers the value will be stored under (a memory write sits five
    down in a run's journal), so one too deep for that place is refused here too.
    """
    if type(value) is dict and _plain(value, depth):
        return  # plain data: admitted
    _lower_top(value, path, False, depth)


def encode(value: Any) -> bytes:
    """Encode an admitted value to bytes that `decode` turns back into an equal, same-typed value.

    Dicts keep their insertion order. Raises CodecError naming the path of the first
    inadmissible part.
    """
    t = type(value)
    if (t is dict or t is list) and _plain(value, 0):
        return _pack(value)  # lowering would give it back as it is
    return _pack(_lower_top(value, "", False))


_PLAIN_LEAVES = frozenset((str, bool, float, bytes, type(None)))


def _plain(v: dict[Any, Any] | list[Any], depth: int) -> bool:
    """Whether `v` (a dict or list at nesting `depth`) holds only dicts with str keys, lists,
    and None, bool, float, str, bytes and 64-bit int leaves, within the depth limit: a value
    `_lower` returns unchanged (so it packs as it is). False says nothing: `_lower` decides."""
    if depth >= MAX_DEPTH:
        return False
    depth += 1
    items: Iterable[Any] = v
    if type(v) is dict:
        for k in v:
            if type(k) is not str:
                return False
        items = v.values()
    for x in items:
        t = type(x)
        if t in _PLAIN_LEAVES:
            continue
        if t is int:
            if not -9223372036854775808 <= x <= 18446744073709551615:
                return False
        elif t is not dict and t is not list or not _plain(x, depth):
            return False
    return True


def encode_built(value: Any) -> bytes:
    """`encode(value)` for a record ratchet builds itself (a run's trace, say), faster.

    For a value whose dicts have only str keys and whose leaves are None, bool, int, float,
    str or bytes, lowering changes nothing, so the value is packed as it is: the bytes are
    those `encode` gives. Anything msgpack refuses that way (a big int, a tuple, a str with
    lone surrogates, a registered type) takes `encode`. Not for user data: msgpack would also
    pack a bool key or a bytearray, which `encode` refuses or tags.
    """
    try:
        fast, _slow = _tls.packers
    except AttributeError:
        fast, _slow = _packers()
    try:
        packed: bytes = fast.pack(value)
    except (TypeError, ValueError, OverflowError):  # UnicodeEncodeError is a ValueError
        fast.reset()
        return encode(value)
    return packed


def encode_canonical(value: Any) -> bytes:
    """Like `encode`, but dicts and sets are ordered by their encoded keys/members.

    Equal values give identical bytes regardless of insertion order; `decode` reads them.
    """
    return _pack(_lower_top(value, "", True))


def digest(value: Any) -> str:
    """sha256 hex digest of `encode_canonical(value)`: a stable fingerprint of an admitted value.

    Stable across processes and insertion orders (it depends on the frozen wire format); used
    for durable-call argument digests. Exact types count: 1, 1.0 and True differ.
    """
    return hashlib.sha256(encode_canonical(value)).hexdigest()


# --- decode side -----------------------------------------------------------------------------

# How deeply extension records may nest in data given to `decode`. encode writes at most
# MAX_DEPTH nested containers, and the innermost of them may hold one more record (a big int, a
# tuple key), so MAX_DEPTH + 1 is the deepest any encoded value goes; deeper data did not come
# from encode and is refused as corrupt. Each level re-enters the unpacker from its ext_hook,
# so without this bound a few hundred nested records in a crafted blob overflowed the C stack
# and killed the process. Lists and maps nested inside one record need no recursion; msgpack
# refuses more than 1024 of them (StackError, reported as CorruptDataError).
MAX_DECODE_DEPTH = MAX_DEPTH + 1

# The first levels use msgpack.unpackb: the fastest, but its parser state (about 45 KB) lives on
# the C stack. Deeper levels use a heap-allocated Unpacker (about twice as slow, a few hundred
# bytes of stack), so even MAX_DECODE_DEPTH levels fit in a thread with a 512 KB stack.
_STACK_LEVELS = 8


class UnknownValue:
    """A value of a registered type that this process has not registered, as a stand-in.

    Only `decode(data, unknown="generic")` makes these (the default raises UnknownTypeError),
    for tools that must show any state, such as `ratchet inspect`. `type_name` is the name the
    value was stored under; `state` is what was stored for it, decoded: the field dict of a
    dataclass or pydantic model, the value of an enum, the root value of a RootModel. It is a
    display form, not the object: `encode` refuses it. Equal name and state make equal
    stand-ins; it is hashable (as a set member or dict key) when its state's contents are.
    """

    __slots__ = ("state", "type_name")

    def __init__(self, type_name: str, state: Any) -> None:
        self.type_name = type_name
        self.state = state

    def __repr__(self) -> str:
        return f"UnknownValue({self.type_name!r}, {self.state!r})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not UnknownValue:
            return NotImplemented
        return self.type_name == other.type_name and self.state == other.state

    def __hash__(self) -> int:
        return hash((UnknownValue, self.type_name, _hashable(self.state)))


def _hashable(v: Any) -> Any:
    """A hashable value equal-for-equal to a decoded state: dicts and lists frozen, recursively."""
    t = type(v)
    if t is dict:
        return frozenset((k, _hashable(x)) for k, x in v.items())
    if t is list:
        return tuple(_hashable(x) for x in v)
    if t is set:
        return frozenset(v)
    if t is bytearray:
        return bytes(v)
    return v


def _unpack(data: bytes, depth: int, generic: bool) -> Any:
    """Unpack one msgpack document whose extension records are nested `depth + 1` deep."""
    # timestamp=3: a foreign msgpack Timestamp (ext -1, which never reaches ext_hook) becomes
    # an aware UTC datetime rather than a msgpack object; encode never writes one.
    hook = _HOOKS[generic][depth]
    if depth < _STACK_LEVELS:
        return msgpack.unpackb(
            data,
            ext_hook=hook,
            strict_map_key=False,
            unicode_errors="surrogatepass",
            timestamp=3,
        )
    unpacker = msgpack.Unpacker(
        ext_hook=hook,
        strict_map_key=False,
        unicode_errors="surrogatepass",
        timestamp=3,
        max_buffer_size=max(len(data), 1),
    )
    unpacker.feed(data)
    try:
        value = unpacker.unpack()
    except msgpack.OutOfData:
        # What unpackb says; the record's ext_hook reports it as CorruptDataError.
        raise ValueError("Unpack failed: incomplete input") from None
    if unpacker.tell() != len(data):
        raise ValueError(f"{len(data) - unpacker.tell()} bytes of extra data after the value")
    return value


def _expect(obj: Any, t: type, what: str) -> Any:
    if type(obj) is not t:
        raise CorruptDataError(f"{what} payload is a {type(obj).__name__}, not a {t.__name__}")
    return obj


def _items(obj: Any, n: int, what: str) -> list[Any]:
    """The `n` items of a payload that must be a list of exactly that many."""
    items: list[Any] = _expect(obj, list, what)
    if len(items) != n:
        raise CorruptDataError(f"{what} payload has {len(items)} items, not {n}")
    return items


def _decode_tz(tz: Any) -> tzinfo | None:
    if tz is None:
        return None
    if type(tz) is int:
        return timezone(timedelta(microseconds=tz))
    if type(tz) is str:
        try:
            return ZoneInfo(tz)
        except (KeyError, ValueError, OSError) as exc:  # ZoneInfoNotFoundError is a KeyError
            raise CorruptDataError(
                f"the data names time zone {tz!r}, which cannot be loaded here ({exc})"
            ) from exc
    offset, name = _items(tz, 2, "time zone")
    return timezone(timedelta(microseconds=offset), name)


def _decode_bigint(data: bytes, depth: int, generic: bool) -> int:
    return int.from_bytes(data, "big", signed=True)


def _decode_tuple(data: bytes, depth: int, generic: bool) -> tuple[Any, ...]:
    return tuple(_expect(_unpack(data, depth, generic), list, "tuple"))


def _decode_set(data: bytes, depth: int, generic: bool) -> set[Any]:
    return set(_expect(_unpack(data, depth, generic), list, "set"))


def _decode_frozenset(data: bytes, depth: int, generic: bool) -> frozenset[Any]:
    return frozenset(_expect(_unpack(data, depth, generic), list, "frozenset"))


def _decode_bytearray(data: bytes, depth: int, generic: bool) -> bytearray:
    return bytearray(data)


def _decode_datetime(data: bytes, depth: int, generic: bool) -> datetime:
    y, mo, d, h, mi, s, us, fold, tz = _items(_unpack(data, depth, generic), 9, "datetime")
    return datetime(y, mo, d, h, mi, s, us, tzinfo=_decode_tz(tz), fold=fold)


def _decode_date(data: bytes, depth: int, generic: bool) -> date:
    return date.fromordinal(_expect(_unpack(data, depth, generic), int, "date"))


def _decode_time(data: bytes, depth: int, generic: bool) -> time:
    h, mi, s, us, fold, tz = _items(_unpack(data, depth, generic), 6, "time")
    return time(h, mi, s, us, tzinfo=_decode_tz(tz), fold=fold)


def _decode_timedelta(data: bytes, depth: int, generic: bool) -> timedelta:
    days, seconds, micros = _items(_unpack(data, depth, generic), 3, "timedelta")
    return timedelta(days, seconds, micros)


def _decode_decimal(data: bytes, depth: int, generic: bool) -> Decimal:
    return Decimal(data.decode("ascii"))


def _decode_uuid(data: bytes, depth: int, generic: bool) -> UUID:
    return UUID(bytes=data)


def _decode_registered(data: bytes, depth: int, generic: bool) -> Any:
    name, state = _items(_unpack(data, depth, generic), 2, "registered object")
    if type(name) is not str:
        raise CorruptDataError(f"registered object name is a {type(name).__name__}, not a str")
    cls = _BY_NAME.get(name)
    if cls is None:
        if generic:
            return UnknownValue(name, state)
        raise UnknownTypeError(_unknown_message(name))
    entry = _BY_CLS[cls]
    try:
        if entry.kind == _ENUM:
            return cls(state)
        if entry.kind == _MODEL:
            # model_validate (not model_construct) so nested models are rebuilt from their
            # dicts and the model's invariants hold; validators must accept their own output.
            return cls.model_validate(state)  # type: ignore[attr-defined]
        fields = _expect(state, dict, "dataclass")
        late = {k: fields.pop(k) for k in entry.no_init if k in fields}
        obj = cls(**fields)
        for k, x in late.items():  # init=False fields: restore the stored state as it was
            object.__setattr__(obj, k, x)
        return obj
    except Exception as exc:
        raise CorruptDataError(
            f"cannot rebuild registered type {name!r} ({cls!r}) from the stored data: "
            f"{_short(str(exc), 300)}; did the class change since the data was written?"
        ) from exc


_DECODERS: dict[int, tuple[str, Callable[[bytes, int, bool], Any]]] = {
    _BIGINT: ("big int", _decode_bigint),
    _TUPLE: ("tuple", _decode_tuple),
    _SET: ("set", _decode_set),
    _FROZENSET: ("frozenset", _decode_frozenset),
    _BYTEARRAY: ("bytearray", _decode_bytearray),
    _DATETIME: ("datetime", _decode_datetime),
    _DATE: ("date", _decode_date),
    _TIME: ("time", _decode_time),
    _TIMEDELTA: ("timedelta", _decode_timedelta),
    _DECIMAL: ("Decimal", _decode_decimal),
    _UUID: ("UUID", _decode_uuid),
    _REGISTERED: ("registered object", _decode_registered),
}


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _ext_hook(depth: int, generic: bool, code: int, data: bytes) -> Any:
    """Rebuild one extension record found `depth` records deep; any failure is CorruptDataError."""
    known = _DECODERS.get(code)
    if known is None:
        raise CorruptDataError(f"unknown extension type code {code}")
    if depth > MAX_DECODE_DEPTH:
        raise CorruptDataError(
            f"extension records are nested more than {MAX_DECODE_DEPTH} deep, deeper than "
            "encode ever writes them"
        )
    what, decoder = known
    try:
        return decoder(data, depth, generic)
    except (CorruptDataError, UnknownTypeError):
        raise
    except Exception as exc:
        # Bad field values (ValueError, TypeError, OverflowError), a garbage Decimal
        # (decimal.InvalidOperation), a payload that is not msgpack, unhashable set members...
        detail = _short(str(exc), 300) or "not valid msgpack"
        raise CorruptDataError(
            f"cannot decode a {what} record (ext {code}, {len(data)} bytes): "
            f"{type(exc).__name__}: {detail}"
        ) from exc


# _HOOKS[generic][depth] is the ext_hook of a document `depth` records deep: made once, so a
# decode allocates nothing to track its depth. A document MAX_DECODE_DEPTH deep is the deepest
# unpacked; its hook refuses every record.
_HOOKS: tuple[tuple[Callable[[int, bytes], Any], ...], ...] = tuple(
    tuple(functools.partial(_ext_hook, d + 1, generic) for d in range(MAX_DECODE_DEPTH + 1))
    for generic in (False, True)
)


def decode(data: bytes, *, unknown: Literal["raise", "generic"] = "raise") -> Any:
    """Rebuild the value `encode` (or `encode_canonical`) wrote.

    Never imports or runs anything the data names: registered classes come from the registry.
    Whatever the bytes, it raises only CorruptDataError (bytes `encode` did not write:
    truncated, damaged, foreign, or extension records nested more than MAX_DECODE_DEPTH deep)
    or UnknownTypeError (the data names a class not registered in this process); it never
    crashes the process.

    `unknown="generic"` decodes a value of a registered type that this process has not
    registered into an `UnknownValue(type_name, state)` stand-in instead of raising
    UnknownTypeError, so a tool can show any well-formed state. Data that does not fit a class
    that *is* registered is still CorruptDataError.
    """
    if type(data) is not bytes and not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidTypeError(f"decode() takes bytes, not {type(data)!r}")
    if unknown == "raise":
        hook = _HOOKS[False][0]
    elif unknown == "generic":
        hook = _HOOKS[True][0]
    else:
        raise InvalidArgumentError(
            f'decode() unknown= must be "raise" or "generic", not {unknown!r}'
        )
    try:
        return msgpack.unpackb(  # what _unpack(data, 0, ...) does, without the extra call
            data,
            ext_hook=hook,
            strict_map_key=False,
            unicode_errors="surrogatepass",
            timestamp=3,
        )
    except (CorruptDataError, UnknownTypeError):
        raise
    except Exception as exc:
        # msgpack's own errors (ExtraData, FormatError, StackError, incomplete input) are
        # ValueErrors; unhashable map keys are TypeErrors; RecursionError when called with
        # little stack left; MemoryError. Any of them means these bytes cannot be decoded.
        detail = _short(str(exc), 300) or "not valid msgpack"
        raise CorruptDataError(
            f"cannot decode {len(data)} bytes: {type(exc).__name__}: {detail}"
        ) from exc
