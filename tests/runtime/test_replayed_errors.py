"""What a replayed durable call raises: the recorded exception's own class when it is built-in or
registered, else a `ReplayedCallError` stand-in that keeps the original's built-in bases."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

import ratchet
from ratchet import (
    Agent,
    CorruptDataError,
    InputEvent,
    InvalidArgumentError,
    InvalidTypeError,
    ModelCallError,
    OutputEvent,
    RatchetError,
    ReplayedCallError,
    action,
    register_type,
    run,
)
from ratchet.agents._exceptions import encode_error as _encode_error
from ratchet.agents._exceptions import rebuild_error as _rebuild_error
from ratchet.store import codec


def replay(exc: BaseException) -> BaseException:
    """The exception a replay raises for a call that raised `exc` (through the stored bytes)."""
    return _rebuild_error(bytes(_encode_error(exc)))


class RateLimited(RuntimeError):
    pass


class PlainFailure(Exception):
    pass


class KeywordOnly(ValueError):
    def __init__(self, *, field: str) -> None:
        super().__init__(f"field {field!r} is invalid")
        self.field = field


@register_type
class Registered(RuntimeError):
    def __init__(self, reason: str, attempts: int = 1) -> None:
        super().__init__(reason, attempts)
        self.attempts = attempts


@register_type
class RegisteredKeywordOnly(RuntimeError):
    def __init__(self, *, retry_after: float) -> None:
        super().__init__(f"retry after {retry_after}s")
        self.retry_after = retry_after


class NeedsKeywordsToExist(RuntimeError):
    def __new__(cls, *, code: int) -> NeedsKeywordsToExist:
        return super().__new__(cls)

    def __init__(self, *, code: int) -> None:
        super().__init__(f"code {code}")


register_type(NeedsKeywordsToExist, "tests.NeedsKeywordsToExist")


# --- built-in ----------------------------------------------------------------------------------


def test_a_builtin_exception_comes_back_as_itself_with_its_args() -> None:
    err = replay(KeyError("missing 3"))
    assert type(err) is KeyError
    assert err.args == ("missing 3",)
    assert str(err) == "'missing 3'"
    assert not isinstance(err, ReplayedCallError)


def test_an_oserror_keeps_its_subclass_and_errno() -> None:
    err = replay(FileNotFoundError(2, "no such file"))
    assert type(err) is FileNotFoundError
    assert isinstance(err, OSError) and err.errno == 2 and err.strerror == "no such file"


def test_a_builtin_with_notes_keeps_them() -> None:
    exc = ValueError("bad")
    exc.add_note("while parsing line 3")
    assert replay(exc).__notes__ == ["while parsing line 3"]  # type: ignore[attr-defined]


def test_a_builtin_whose_constructor_refuses_the_stored_args_falls_back_to_a_stand_in() -> None:
    # An ExceptionGroup's sub-exceptions cannot be stored, so only its message is; the message
    # alone does not construct an ExceptionGroup.
    group = ExceptionGroup("two failed", [ValueError(1), KeyError(2)])
    err = replay(group)
    assert isinstance(err, ReplayedCallError) and isinstance(err, Exception)
    assert err.type_name == "builtins.ExceptionGroup"
    assert str(err) == str(group) == "two failed (2 sub-exceptions)"


# --- registered --------------------------------------------------------------------------------


def test_a_registered_exception_comes_back_as_itself_with_args_and_attributes() -> None:
    err = replay(Registered("quota", attempts=4))
    assert type(err) is Registered
    assert err.args == ("quota", 4)
    assert err.attempts == 4
    assert not isinstance(err, ReplayedCallError)


def test_a_registered_exception_with_a_keyword_only_constructor_comes_back_as_itself() -> None:
    err = replay(RegisteredKeywordOnly(retry_after=2.5))
    assert type(err) is RegisteredKeywordOnly
    assert str(err) == "retry after 2.5s"
    assert err.retry_after == 2.5


def test_a_registered_class_that_cannot_be_built_from_its_args_comes_back_as_a_stand_in() -> None:
    err = replay(NeedsKeywordsToExist(code=7))
    assert isinstance(err, ReplayedCallError) and isinstance(err, RuntimeError)
    assert not isinstance(err, NeedsKeywordsToExist)
    assert str(err) == "code 7"


def test_ratchets_own_errors_come_back_as_themselves() -> None:
    original = ModelCallError(
        "429 Too Many Requests", provider="openai", status=429, transient=True, retry_after=1.5
    )
    err = replay(original)
    assert type(err) is ModelCallError
    assert (err.provider, err.status, err.transient, err.retry_after) == ("openai", 429, True, 1.5)
    assert str(err) == "429 Too Many Requests"
    again = replay(ReplayedCallError("x.Y", "boom"))
    assert type(again) is ReplayedCallError
    assert (again.type_name, again.message) == ("x.Y", "boom")


# --- not registered ----------------------------------------------------------------------------


def test_an_unregistered_exception_is_a_stand_in_that_keeps_its_builtin_base() -> None:
    err = replay(RateLimited("slow down"))
    assert isinstance(err, RuntimeError)  # `except RuntimeError:` catches it, as it did live
    assert isinstance(err, ReplayedCallError) and isinstance(err, RatchetError)
    assert not isinstance(err, RateLimited)  # a class that is not registered is never built
    assert type(err).__name__ == "RateLimited"
    assert f"{type(err).__module__}.{type(err).__qualname__}" == f"{__name__}.RateLimited"
    assert err.type_name == f"{__name__}.RateLimited"
    assert err.message == str(err) == "slow down"
    assert err.args == ("slow down",)
    # One class per (type name, bases): `except type(first)` catches the next one too.
    assert type(replay(RateLimited("again"))) is type(err)
    assert str(copy.copy(err)) == "slow down"


def test_an_unregistered_exception_deriving_from_exception_only() -> None:
    err = replay(PlainFailure("no luck", 3))
    assert isinstance(err, ReplayedCallError)
    assert not isinstance(err, RuntimeError | ValueError | LookupError)
    assert type(err).__mro__[1:] == (
        ReplayedCallError,
        RatchetError,
        Exception,
        BaseException,
        object,
    )
    assert err.args == ("no luck", 3)
    assert str(err) == "('no luck', 3)"


def test_an_unregistered_exception_with_a_keyword_only_constructor() -> None:
    err = replay(KeywordOnly(field="email"))
    assert isinstance(err, ValueError) and isinstance(err, ReplayedCallError)
    assert str(err) == "field 'email' is invalid"
    assert err.field == "email"  # type: ignore[attr-defined]  # its attributes are kept


def test_every_builtin_base_is_kept_and_a_stand_in_replays_as_the_same_stand_in() -> None:
    class Both(ValueError, KeyError):
        pass

    err = replay(Both("x"))
    assert isinstance(err, ValueError) and isinstance(err, KeyError)
    again = replay(err)  # a stand-in raised inside another durable call
    assert type(again) is type(err) and str(again) == str(err)


def test_args_the_codec_cannot_store_are_replaced_by_the_message() -> None:
    err = replay(RateLimited(object()))
    assert isinstance(err, RuntimeError)
    assert err.args == (str(err),) and str(err).startswith("<object object at")


# --- records are untrusted ---------------------------------------------------------------------


def record(**fields: Any) -> bytes:
    return codec.encode(fields)


def test_a_record_never_imports_the_module_it_names() -> None:
    name = "ratchet_test_never_imported.Evil"
    err = _rebuild_error(
        record(type=name, args=("x",), message="x", bases=("RuntimeError", "Exception"))
    )
    assert "ratchet_test_never_imported" not in sys.modules
    assert isinstance(err, RuntimeError) and isinstance(err, ReplayedCallError)
    assert err.type_name == name


def test_a_record_cannot_make_a_replay_raise_systemexit() -> None:
    for data in (
        record(type="builtins.SystemExit", args=(0,), message="0"),
        record(type="x.Quit", args=(), message="", bases=("SystemExit", "KeyboardInterrupt")),
    ):
        err = _rebuild_error(data)
        assert isinstance(err, ReplayedCallError) and isinstance(err, Exception)
        assert not isinstance(err, SystemExit | KeyboardInterrupt)


def test_bases_that_are_not_builtin_exception_classes_are_ignored() -> None:
    err = _rebuild_error(
        record(type="x.Y", args=(), message="m", bases=("open", "print", 3, "RuntimeError"))
    )
    assert isinstance(err, RuntimeError) and str(err) == "m"


def test_a_record_from_before_bases_were_stored_still_replays() -> None:
    assert type(_rebuild_error(record(type="builtins.KeyError", args=("k",), message="'k'"))) is (
        KeyError
    )
    err = _rebuild_error(record(type="app.Old", args=("m",), message="m"))
    assert isinstance(err, ReplayedCallError) and str(err) == "m"
    # A registered class is found by its "module.QualName" too (ratchet's own, under its
    # registered "ratchet.ModelCallError", was stored as "ratchet._errors.ModelCallError").
    old = _rebuild_error(record(type="ratchet._errors.ModelCallError", args=("x",), message="x"))
    assert type(old) is ModelCallError
    mine = _rebuild_error(record(type=f"{__name__}.Registered", args=("r", 2), message="r"))
    assert type(mine) is Registered and mine.args == ("r", 2)


def test_a_damaged_record_is_a_corrupt_data_error() -> None:
    with pytest.raises(CorruptDataError, match=r"durable-call error is a list, not a record"):
        _rebuild_error(codec.encode([1, 2]))
    with pytest.raises(
        CorruptDataError, match=r"durable-call error has a int as its 'args', not a tuple or list"
    ):
        _rebuild_error(record(type="x.Y", args=3, message="m"))


# --- registering -------------------------------------------------------------------------------


def test_register_type_refuses_what_a_durable_call_never_records() -> None:
    class Stop(BaseException):
        pass

    with pytest.raises(InvalidTypeError, match=r"takes an Exception subclass.*Stop"):
        register_type(Stop)


def test_register_type_refuses_a_taken_name_and_a_second_name() -> None:
    class First(RuntimeError):
        pass

    class Second(RuntimeError):
        pass

    register_type(First, "tests.replayed.Taken")
    register_type(First, "tests.replayed.Taken")  # again under its name: a no-op
    with pytest.raises(InvalidArgumentError, match=r"'tests.replayed.Taken'.*already registered"):
        register_type(Second, "tests.replayed.Taken")
    with pytest.raises(InvalidArgumentError, match=r"already registered as 'tests.replayed.Taken'"):
        register_type(First, "tests.replayed.Other")


def test_register_type_still_registers_models_with_the_codec() -> None:
    import dataclasses

    @dataclasses.dataclass
    class Point:
        x: int

    assert register_type(Point, "tests.replayed.Point") is Point
    assert codec.decode(codec.encode(Point(2))) == Point(2)
    assert ratchet.register_type is register_type
    assert register_type(ValueError) is ValueError  # built-ins need no registration


# --- through the engine ------------------------------------------------------------------------


calls: list[str] = []


def limited(n: int) -> int:
    calls.append(f"limited {n}")
    raise RateLimited(f"rate limited on {n}")


def records(path: Path) -> list[dict[str, Any]]:
    """Output records without the job id (each state directory is its own job)."""
    lines = path.read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "job"} for line in lines]


def crash_then(agent_cls: type[Agent], inputs: list[dict[str, Any]], tmp: Path) -> Any:
    """Run `agent_cls` once crashing after its calls (SystemExit), then once to completion."""
    with pytest.raises(BaseException, match=r"crash after the call raised"):
        run(agent_cls(), inputs=inputs, output=tmp / "out.jsonl", state_dir=tmp / "state")
    return run(agent_cls(), inputs=inputs, output=tmp / "out.jsonl", state_dir=tmp / "state")


class Fallback(Agent):
    crash = False

    @action(InputEvent)
    async def go(self, event: InputEvent, ctx: Any) -> None:
        try:
            await ctx.durable_execute_async(limited, event.input["n"])
            path = "primary"
        except RuntimeError as exc:
            path = f"fallback: {type(exc).__name__}: {exc}"
        if type(self).crash:
            type(self).crash = False
            raise SystemExit("crash after the call raised")
        ctx.short_term_memory.set("path", path)
        ctx.send_event(OutputEvent(output=path))


def test_the_except_branch_after_a_crash_is_the_crash_free_one(tmp_path: Path) -> None:
    inputs = [{"key": "k", "n": 3}]
    calls.clear()
    free = run(Fallback(), inputs=inputs, output=tmp_path / "free.jsonl", state_dir=tmp_path / "f")
    assert calls == ["limited 3"]
    calls.clear()
    Fallback.crash = True
    crashed = crash_then(Fallback, inputs, tmp_path)
    assert calls == ["limited 3"]  # once, before the crash: the replay raised the record
    assert crashed.metrics == {"durable_calls.replayed": 1}
    assert records(tmp_path / "out.jsonl") == records(tmp_path / "free.jsonl")
    assert (
        records(tmp_path / "out.jsonl")[0]["output"] == "fallback: RateLimited: rate limited on 3"
    )
    assert free.outputs == crashed.outputs == 1
