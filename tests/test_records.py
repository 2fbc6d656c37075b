"""`ratchet._records.NamedTuple` builds at run time the class `typing.NamedTuple` builds from
the same body (fields, defaults, docstring, methods), without importing `typing`; and the
Protocols moved out of the start-up path still resolve where they were."""

from __future__ import annotations

import pickle
import types
import typing
from typing import Any

import pytest

import ratchet
import ratchet.checks
from ratchet import _clock
from ratchet._records import NamedTuple
from ratchet.checks import _seams
from ratchet.checks._decide import Decision, Facts, LogEvidence


def _body() -> dict[str, Any]:
    def describe(self: Any) -> str:
        return f"{self.name}:{self.size}"

    return {
        "__module__": __name__,
        "__qualname__": "Entry",
        "__doc__": "One entry.",
        "__annotations__": {"name": "str", "size": "int", "tags": "tuple[str, ...]"},
        "size": 0,
        "tags": (),
        "describe": describe,
        "LIMIT": 3,
    }


def _entry(base: Any) -> Any:
    """`class Entry(base): ...` with the body above, as a class statement would make it."""
    return types.new_class("Entry", (base,), exec_body=lambda ns: ns.update(_body()))


def test_the_class_is_the_one_typing_builds_from_the_same_body() -> None:
    ours, theirs = _entry(NamedTuple), _entry(typing.NamedTuple)
    assert ours.__mro__[1:] == theirs.__mro__[1:] == (tuple, object)
    assert ours._fields == theirs._fields == ("name", "size", "tags")
    assert ours._field_defaults == theirs._field_defaults == {"size": 0, "tags": ()}
    assert ours.__doc__ == theirs.__doc__ == "One entry."
    assert ours.__module__ == theirs.__module__ == __name__
    assert ours.LIMIT == theirs.LIMIT == 3
    for cls in (ours, theirs):
        entry = cls("a", 2)
        assert entry == ("a", 2, ())
        assert entry.describe() == "a:2"
        assert entry._replace(size=5).size == 5
        assert entry._asdict() == {"name": "a", "size": 2, "tags": ()}
    # what is left different: typing turns the annotations into ForwardRefs
    assert ours.__annotations__ == {"name": "str", "size": "int", "tags": "tuple[str, ...]"}


def test_it_refuses_what_typing_refuses() -> None:
    meta = type(NamedTuple)
    with pytest.raises(TypeError, match="Non-default namedtuple field b cannot follow"):
        meta(
            "Bad",
            (NamedTuple,),
            {"__module__": __name__, "__annotations__": {"a": "int", "b": "int"}, "a": 1},
        )
    with pytest.raises(AttributeError, match="Cannot overwrite NamedTuple attribute _replace"):
        meta("Bad", (NamedTuple,), {"__module__": __name__, "_replace": None})
    with pytest.raises(TypeError, match="can only inherit from NamedTuple"):
        meta("Bad", (NamedTuple, object), {"__module__": __name__})


def test_the_decision_records_are_named_tuples_with_their_defaults() -> None:
    assert LogEvidence._fields == ("sha256", "missing", "error")
    assert LogEvidence() == (None, False, None)
    facts = Facts("s", "auto", "key", None, None)
    assert facts.log is None and facts.outputs is None
    assert facts._replace(log=LogEvidence("x")).log == LogEvidence("x", False, None)
    decision = Decision("run", ("fresh run (no --resume)",))
    assert decision.explanation("r1") == {
        "resumed_from": "r1",
        "decision": "ran",
        "reasons": ["fresh run (no --resume)"],
    }
    assert pickle.loads(pickle.dumps(decision)) == decision
    assert Decision.__doc__ is not None and Decision.__doc__.startswith("`run`, `reuse`")


def test_the_protocols_resolve_where_they_were() -> None:
    for name in ("Executor", "Prober"):
        assert getattr(ratchet.checks, name) is getattr(_seams, name)
        assert getattr(ratchet.checks, name)._is_protocol
        assert name in dir(ratchet.checks)
    assert _seams.Waiter._is_protocol and _seams.ProberFactory._is_protocol
    assert ratchet.Clock is _clock.Clock
    assert isinstance(_clock.SYSTEM_CLOCK, _clock.Clock)
    assert not isinstance(object(), _clock.Clock)
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        _seams.Nope  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        _clock.Nope  # noqa: B018
