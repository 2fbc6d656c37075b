"""Exceptions of durable calls as data: what is recorded when a call raises, and what a replay
raises in its place.

Why: after a crash a recorded failure is raised again without calling, and the action's
`except` clauses must pick the same branch as they did live, or the recovered run diverges
from a crash-free one. So the exception comes back with its own class when ratchet may build
it, and otherwise as a stand-in that is still caught by the same built-in bases.

A record stores the exception's `module.qualname`, its registered name (if any), its args, its
message, the names of the built-in exception classes in its MRO, and its instance attributes,
as far as the codec admits them. Replaying one never imports anything the record names (stored
bytes are untrusted): a class is found only among Python's built-in exceptions or in the
registry that the program filled with `ratchet.register_type`. In that order of preference:

1. a registered class: rebuilt as `cls(*args)` (or, when its constructor does not take the
   stored args, e.g. keyword-only parameters, without calling `__init__`), then its args and
   attributes are restored;
2. a built-in exception class: rebuilt as `cls(*args)`;
3. anything else: an instance of a `ReplayedCallError` subclass that also derives from the
   original's built-in bases (`RuntimeError` for `class RateLimited(RuntimeError)`), named
   like the original, with its args, its message as `str()`, and its attributes. One such
   class is made per (type name, bases) and reused.

Only `Exception` subclasses are rebuilt (a durable call records nothing else); a record naming
another base, e.g. `SystemExit`, comes back as a stand-in deriving from `Exception`.
"""

from __future__ import annotations

import builtins
import threading
from typing import Any, Final, TypeVar, cast

from ratchet import _errors
from ratchet._errors import (
    CorruptDataError,
    InvalidArgumentError,
    InvalidTypeError,
    RatchetError,
    ReplayedCallError,
)
from ratchet.store import codec

__all__ = ["encode_error", "register_exception", "register_type", "rebuild_error"]

T = TypeVar("T", bound=type)
E = TypeVar("E", bound=type[BaseException])

_BY_NAME: dict[str, type[BaseException]] = {}
_BY_CLS: dict[type[BaseException], str] = {}
_REGISTRY_LOCK = threading.Lock()

# Stand-in classes per (original type name, built-in bases). Bounded, because type names come
# from stored data: past the bound a new class is made each time instead of being kept.
_CARRIERS: dict[tuple[str, tuple[type[Exception], ...]], type[ReplayedCallError]] = {}
_CARRIERS_LOCK = threading.Lock()
_MAX_CARRIERS: Final = 1024

_NOTES: Final = "__notes__"


def _is_builtin_exception(cls: type) -> bool:
    return (
        cls.__module__ == "builtins"
        and getattr(builtins, cls.__name__, None) is cls
        and issubclass(cls, Exception)
    )


# --- registration ------------------------------------------------------------------------------


def register_exception(cls: E, name: str | None = None) -> E:
    """Let a replayed durable call raise `cls` itself; `name` is what records store.

    Keep the name stable (it defaults to "module.QualName"). Registering a different class
    under a taken name, or one class under two names, raises InvalidArgumentError; registering
    the same class again under its name is a no-op. Built-in exceptions need no registration.
    """
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        raise InvalidTypeError(
            f"register_exception() takes an Exception subclass, not {cls!r}; a durable call "
            f"records only exceptions that derive from Exception"
        )
    if _is_builtin_exception(cls):
        return cls  # rebuilt by type without registering
    if name is None:
        name = f"{cls.__module__}.{cls.__qualname__}"
    if type(name) is not str or not name:
        raise InvalidTypeError(f"register_type() name must be a non-empty str, not {name!r}")
    with _REGISTRY_LOCK:
        taken = _BY_NAME.get(name)
        if taken is not None and taken is not cls:
            raise InvalidArgumentError(
                f"cannot register exception {cls!r} as {name!r}: that name is already "
                f"registered for {taken!r}; pass a different name"
            )
        known = _BY_CLS.get(cls)
        if known is not None and known != name:
            raise InvalidArgumentError(
                f"cannot register exception {cls!r} as {name!r}: it is already registered "
                f"as {known!r}"
            )
        _BY_NAME[name] = cls
        _BY_CLS[cls] = name
    return cls


def register_type(cls: T, name: str | None = None) -> T:
    """Register a class whose instances ratchet stores by name; returns `cls` (a decorator).

    - An Enum, a dataclass or a pydantic model: admitted in memory, events and call results,
      and decoded back as that class.
    - An Exception subclass: a durable call that raised it raises it again, as that class,
      when it is replayed after a crash (unregistered classes come back as a stand-in that
      keeps the built-in bases, see docs/runtime.md "Durable calls").

    Only the name is stored; decoding finds the class in this process's registry and never
    imports anything stored data names. Keep the name stable: it defaults to
    "module.QualName". Registering a different class under a taken name, or one class under
    two names, raises InvalidArgumentError.
    """
    if isinstance(cls, type) and issubclass(cls, BaseException):
        register_exception(cls, name)
        return cls
    return codec.register(cls, name)


def _register_own_errors() -> None:
    """ratchet's errors come back as themselves (a ModelCallError keeps `transient`, `status`)."""
    for cls in vars(_errors).values():
        if isinstance(cls, type) and issubclass(cls, RatchetError):
            register_exception(cls, f"ratchet.{cls.__name__}")


_register_own_errors()


# --- recording ---------------------------------------------------------------------------------


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the call's own failure
        return f"<unprintable {type(exc).__name__}>"


def _admissible(value: Any) -> bool:
    try:
        codec.check_admissible(value)
    except TypeError:
        return False
    return True


def _keep_attribute(name: object) -> bool:
    return type(name) is str and (not name.startswith("__") or name == _NOTES)


def encode_error(exc: BaseException) -> bytes:
    """The record of a durable call that raised `exc`: enough to raise it again on replay."""
    cls = type(exc)
    args: tuple[Any, ...] = tuple(exc.args)
    if not _admissible(args):
        args = (_safe_str(exc),)
    state = {
        k: v
        for k, v in getattr(exc, "__dict__", {}).items()
        if _keep_attribute(k) and _admissible(v)
    }
    record: dict[str, Any] = {
        "type": f"{cls.__module__}.{cls.__qualname__}",
        "qualname": cls.__qualname__,
        "args": args,
        "message": _safe_str(exc),
        "bases": tuple(b.__name__ for b in cls.__mro__ if _is_builtin_exception(b)),
    }
    name = _BY_CLS.get(cls)
    if name is not None:
        record["name"] = name
    if state:
        record["state"] = state
    return codec.encode(record)


# --- replaying ---------------------------------------------------------------------------------


def _field(data: dict[Any, Any], key: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = data.get(key, default)
    if type(value) not in kinds:
        raise CorruptDataError(
            f"a recorded durable-call error has a {type(value).__name__} as its {key!r}, not a "
            f"{' or '.join(k.__name__ for k in kinds)}; the state directory was changed outside "
            f"ratchet"
        )
    return value


def _restore(exc: BaseException, args: tuple[Any, ...], state: dict[Any, Any]) -> None:
    exc.args = args
    for k, v in state.items():
        if _keep_attribute(k):
            exc.__dict__[k] = v


def _works(exc: BaseException) -> bool:
    try:
        str(exc)
    except Exception:  # noqa: BLE001 - a half-built exception: use a stand-in instead
        return False
    return True


def _build(
    cls: type[BaseException], args: tuple[Any, ...], bypass_init: bool
) -> BaseException | None:
    """`cls(*args)`; with `bypass_init`, also `cls.__new__(cls, *args)` when that fails."""
    try:
        exc = cls(*args)
    except Exception:  # noqa: BLE001 - a constructor that does not take the stored args
        if not bypass_init:
            return None
        try:
            exc = cls.__new__(cls, *args)
        except Exception:  # noqa: BLE001 - a __new__ that needs other args too
            return None
    if not isinstance(exc, cls):  # a __new__ that returned something else
        return None
    return exc


def _carrier_init(self: ReplayedCallError, *args: Any) -> None:
    # The built-in base's own __init__ (OSError parses errno from its args), not
    # ReplayedCallError's (type_name, message): a stand-in takes the original's args.
    super(ReplayedCallError, self).__init__(*args)


def _carrier_str(self: ReplayedCallError) -> str:
    return str(self.__dict__.get("message", ""))


def _carrier_class(
    type_name: str, qualname: str, bases: tuple[type[Exception], ...]
) -> type[ReplayedCallError] | None:
    key = (type_name, bases)
    with _CARRIERS_LOCK:
        found = _CARRIERS.get(key)
    if found is not None:
        return found
    module = type_name[: -len(qualname) - 1] if type_name.endswith("." + qualname) else ""
    namespace = {
        "__module__": module or "ratchet.replayed",
        "__qualname__": qualname,
        "__doc__": (
            f"Stand-in for {type_name}, raised by a replayed durable call: ratchet cannot "
            f"rebuild that class (it is not registered, or it refuses the stored args), so it "
            f"raises this subclass of ReplayedCallError and of the original's built-in bases."
        ),
        "__init__": _carrier_init,
        "__str__": _carrier_str,
    }
    try:
        made: type[ReplayedCallError] = cast(
            "type[ReplayedCallError]",
            type(qualname.rpartition(".")[2], (ReplayedCallError, *bases), namespace),
        )
    except (TypeError, ValueError):  # bases that cannot be combined, a name with a NUL
        return None
    with _CARRIERS_LOCK:
        if len(_CARRIERS) < _MAX_CARRIERS:
            made = _CARRIERS.setdefault(key, made)
    return made


def _leaves(bases: list[type[Exception]]) -> tuple[type[Exception], ...]:
    """The bases that are not an ancestor of another one, in their order."""
    return tuple(b for b in bases if not any(o is not b and issubclass(o, b) for o in bases))


def _stand_in(
    type_name: str,
    qualname: str,
    bases: list[type[Exception]],
    args: tuple[Any, ...],
    message: str,
    state: dict[Any, Any],
) -> ReplayedCallError:
    """A ReplayedCallError that is also an instance of the original's built-in bases.

    Tries all of them together, then each one and its built-in ancestors alone, then
    Exception: some bases refuse the stored args (an ExceptionGroup needs its exceptions).
    """
    attempts: list[tuple[type[Exception], ...]] = []
    leaves = _leaves(bases)
    if leaves:
        attempts.append(leaves)
    for leaf in leaves:
        attempts += [(b,) for b in leaf.__mro__ if _is_builtin_exception(b)]
    attempts.append((Exception,))
    for combo in dict.fromkeys(attempts):
        cls = _carrier_class(type_name, qualname, combo)
        if cls is None:
            continue
        exc = _build(cls, args, bypass_init=False)
        if exc is None:
            continue
        assert isinstance(exc, ReplayedCallError)
        _restore(exc, args, state)
        exc.type_name = type_name
        exc.message = message
        return exc
    return ReplayedCallError(type_name, message)  # a type name that type() refuses


def _registered_by_type_name(type_name: str) -> type[BaseException] | None:
    """A registered class whose "module.QualName" is `type_name` (only registered ones)."""
    found = _BY_NAME.get(type_name)
    if found is not None:
        return found
    with _REGISTRY_LOCK:
        classes = list(_BY_CLS)
    for c in classes:
        if f"{c.__module__}.{c.__qualname__}" == type_name:
            return c
    return None


def rebuild_error(payload: bytes) -> BaseException:
    """The exception a replayed durable call raises for the record `encode_error` wrote."""
    data = codec.decode(payload)
    if type(data) is not dict:
        raise CorruptDataError(
            f"a recorded durable-call error is a {type(data).__name__}, not a record; the state "
            f"directory was changed outside ratchet"
        )
    type_name: str = _field(data, "type", (str,), "builtins.Exception")
    message: str = _field(data, "message", (str,), "")
    args = tuple(_field(data, "args", (tuple, list), (message,)))
    state: dict[Any, Any] = _field(data, "state", (dict,), {})
    qualname: str = _field(data, "qualname", (str,), type_name.rpartition(".")[2])
    name = data.get("name")

    cls: type[BaseException] | None = None
    if type(name) is str:
        cls = _BY_NAME.get(name)
    if cls is None:  # recorded before the class was registered, or by an older ratchet
        cls = _registered_by_type_name(type_name)
    if cls is not None:
        exc = _build(cls, args, bypass_init=True)
        if exc is not None:
            _restore(exc, args, state)
            if _works(exc):
                return exc
    module, _, short = type_name.rpartition(".")
    if module == "builtins":
        builtin = getattr(builtins, short, None)
        if isinstance(builtin, type) and _is_builtin_exception(builtin):
            cls = builtin
            exc = _build(builtin, args, bypass_init=False)
            if exc is not None:
                _restore(exc, args, state)
                return exc

    names = data.get("bases")
    bases: list[type[Exception]] = []
    if isinstance(names, tuple | list):
        for n in names:
            b = getattr(builtins, n, None) if type(n) is str else None
            if isinstance(b, type) and _is_builtin_exception(b):
                bases.append(b)
    elif cls is not None:  # a record from before bases were stored
        bases = [b for b in cls.__mro__ if _is_builtin_exception(b)]
    return _stand_in(type_name, qualname, bases, args, message, state)
