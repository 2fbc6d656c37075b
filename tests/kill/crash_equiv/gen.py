"""Hypothesis strategies for `Case`s: agents, memory values, inputs and kill schedules.

The event graph is a DAG by construction: an action on `Ei` (or on the input) emits only
`Ej` with j > i, so every run ends; `ErrorEvent` handlers emit nothing but outputs. The
number of tasks one input can cause is bounded (`MAX_TASKS`) by dropping emits. Simpler
choices come first in every `sampled_from`, so shrinking moves towards them.
"""

from __future__ import annotations

import dataclasses
import datetime
import zoneinfo
from typing import Any

from hypothesis import strategies as st

from crash_equiv import agentlib
from crash_equiv.spec import (
    ERROR,
    INPUT,
    MODES,
    ActionSpec,
    Append,
    Bump,
    Burst,
    Call,
    Case,
    Delete,
    Emit,
    Features,
    Gather,
    Kill,
    Mutate,
    NewObject,
    Output,
    Raise,
    Read,
    Sleep,
    Write,
)

MAX_TASKS = 40  # per input, not counting error handlers
KEYS = ("k0", "k1", "k2", 7, "7")  # an int key and a str key that prints alike
SCOPES = ("stm", "sen")

# --- memory values: every type the codec admits ------------------------------------------------

_tz = st.sampled_from(
    [
        None,
        datetime.UTC,
        datetime.timezone(datetime.timedelta(hours=-5, minutes=-30)),
        datetime.timezone(datetime.timedelta(hours=2), "CEST"),
        zoneinfo.ZoneInfo("Europe/Paris"),
    ]
)
_datetimes = st.builds(
    lambda dt, tz, fold: dt.replace(tzinfo=tz, fold=fold),
    st.datetimes(min_value=datetime.datetime(1900, 1, 1), max_value=datetime.datetime(2100, 1, 1)),
    _tz,
    st.sampled_from([0, 1]),
)
_hashable = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-(2**200), 2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.dates(),
    st.timedeltas(),
    st.times(timezones=_tz),
    _datetimes,
    st.uuids(),
    st.sampled_from(list(agentlib.Color)),
    st.builds(agentlib.Point, st.integers(-5, 5), st.integers(-5, 5)),
)
_scalars = st.one_of(
    _hashable,
    st.binary(max_size=6).map(bytearray),
    st.decimals(allow_nan=True, places=None).filter(lambda d: not d.is_snan()),
    st.builds(
        agentlib.Tag, n=st.integers(-9, 9), label=st.text(max_size=4), blob=st.binary(max_size=4)
    ),
)
_keys = st.one_of(st.text(max_size=4), st.integers(-5, 5), st.binary(max_size=3))
_keys = _keys | st.tuples(st.integers(0, 3), st.text(max_size=2))


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(_keys, children, max_size=3),
        st.frozensets(_hashable, max_size=3),
        st.sets(_hashable, max_size=3),
        st.builds(agentlib.Point, st.integers(0, 3), children),
    )


values = st.recursive(_scalars, _containers, max_leaves=6)

# --- steps -------------------------------------------------------------------------------------


def _memory_steps() -> list[st.SearchStrategy[Any]]:
    scope = st.sampled_from(SCOPES)
    return [
        st.builds(Bump, scope, st.sampled_from(["n0", "n1"]), st.sampled_from([1, 2**70, -3])),
        st.builds(Append, scope, st.sampled_from(["l0", "l1"])),
        st.builds(Write, scope, st.sampled_from(["v0", "v1", "o0.f0", "o1.f1"]), values),
        st.builds(Delete, scope, st.sampled_from(["n0", "l0", "v0", "v1", "o0", "o1"])),
        st.builds(NewObject, scope, st.sampled_from(["o0", "o1"])),
        st.builds(Read, scope, st.sampled_from(["n0", "n1"])),
    ]


def _step_strategy(
    mode: str, listens: tuple[str, ...], targets: tuple[str, ...], feats: Features
) -> st.SearchStrategy[Any]:
    """One step of an action; a (weight, strategy) list, so graph and call steps are common."""
    handler = listens[0] == ERROR
    fns = ["call", "fail"] + (["acall"] if mode == "async" else [])
    if feats.custom_exceptions:
        fns += ["fail_custom", "fail_custom"]
    calls = st.builds(Call, st.none(), st.sampled_from(fns), st.booleans())
    if handler and not feats.handler_raises:
        # a handler whose call fails uncaught raises too
        calls = calls.filter(lambda c: c.caught or c.fn in ("call", "acall"))
    weighted: list[tuple[int, st.SearchStrategy[Any]]] = [
        *((1, m) for m in _memory_steps()),
        (2, calls),
        (1, st.just(Output(0))),
        (1, st.builds(Output, st.integers(1, 3))),
    ]
    if targets:
        model = st.booleans() if feats.model_fields else st.just(False)
        weighted.append((3, st.builds(Emit, st.sampled_from(targets), st.integers(0, 3), model)))
    if mode == "async":
        size = st.integers(1, 2) if feats.gather_sequential else st.just(1)
        group = size.map(lambda n: (None,) * n)
        gather = st.lists(group, min_size=2, max_size=3).map(lambda g: Gather(tuple(g)))
        weighted.append((2, gather))
    if mode != "inline":
        weighted.append((1, st.builds(Sleep, st.integers(0, 15))))
    if not handler:
        weighted.append((1, st.builds(Burst, st.integers(2, 12))))
    if not handler or feats.handler_raises:
        raises = st.sampled_from([1, 2, 3]).flatmap(
            lambda m: st.builds(Raise, st.just(m), st.integers(0, m - 1))
        )
        weighted.append((1, raises))
    if feats.mutate_events:
        what = {INPUT: ["input"], ERROR: ["message"]}.get(listens[0], ["v", "items"])
        weighted.append((3, st.builds(Mutate, st.sampled_from(what))))
    return st.one_of(*(strategy for weight, strategy in weighted for _ in range(weight)))


@st.composite
def _action(draw: Any, index: int, events: tuple[str, ...], feats: Features) -> ActionSpec:
    level = {INPUT: 0, ERROR: len(events) + 1, **{e: i + 1 for i, e in enumerate(events)}}
    if index == 0:
        listens: tuple[str, ...] = (INPUT,)
    else:
        src = draw(st.sampled_from([INPUT, *events, ERROR]))
        listens = (src,)
        later = [e for e in events if level[e] > level[src]]
        if src in events and later and draw(st.integers(0, 3)) == 0:
            listens = (src, draw(st.sampled_from(later)))
    top = max(level[s] for s in listens)
    targets = tuple(e for e in events if level[e] > top) if ERROR not in listens else ()
    mode = draw(st.sampled_from(MODES))
    steps = draw(st.lists(_step_strategy(mode, listens, targets, feats), max_size=7))
    if draw(st.booleans()):
        steps.append(Output(9))  # most actions report what they saw
    return ActionSpec(f"a{index}", listens, mode, tuple(steps))


# --- whole cases -------------------------------------------------------------------------------


def _name_sites(actions: list[ActionSpec]) -> list[ActionSpec]:
    """Give every durable call site a unique name c0, c1, ... in order of appearance."""
    n = 0
    out = []
    for a in actions:
        steps = []
        for s in a.steps:
            if isinstance(s, Call):
                s = dataclasses.replace(s, site=f"c{n}")
                n += 1
            elif isinstance(s, Gather):
                groups = []
                for g in s.groups:
                    groups.append(tuple(f"c{n + i}" for i in range(len(g))))
                    n += len(g)
                s = Gather(tuple(groups))
            steps.append(s)
        out.append(dataclasses.replace(a, steps=tuple(steps)))
    return out


def tasks_per_input(actions: list[ActionSpec]) -> int:
    memo: dict[str, int] = {}

    def tasks(src: str) -> int:
        if src not in memo:
            memo[src] = sum(
                1 + sum(tasks(s.event) for s in a.steps if isinstance(s, Emit))
                for a in actions
                if src in a.listens
            )
        return memo[src]

    return tasks(INPUT)


def _bound(actions: list[ActionSpec]) -> list[ActionSpec]:
    """Drop emits (last action first) until one input causes at most MAX_TASKS tasks."""
    actions = list(actions)
    while tasks_per_input(actions) > MAX_TASKS:
        for i in reversed(range(len(actions))):
            steps = list(actions[i].steps)
            emits = [j for j, s in enumerate(steps) if isinstance(s, Emit)]
            if emits:
                del steps[emits[-1]]
                actions[i] = dataclasses.replace(actions[i], steps=tuple(steps))
                break
    return actions


def kills(feats: Features, max_kills: int = 4) -> st.SearchStrategy[tuple[Kill, ...]]:
    delay = st.sampled_from([0, 1, 3, 10])
    by_lines = st.builds(Kill, st.integers(1, 95), st.just("lines"), delay)
    by_calls = st.builds(Kill, st.integers(1, 95), st.just("calls"), delay)
    by_time = st.builds(Kill, st.integers(1, 120), st.just("time"))
    any_kill = st.one_of(by_lines, by_calls, by_time)
    # a kill by time may hit the very first start, before the state database is set up
    first = any_kill if feats.early_kills else st.one_of(by_lines, by_calls)
    rest = st.integers(0, max(0, max_kills - 1)).flatmap(
        lambda n: st.lists(any_kill, min_size=n, max_size=n)
    )
    schedule = st.builds(lambda a, b: (a, *b), first, rest)
    # one case in ten runs the killed chain without kills: a second crash-free run
    return st.integers(0, 9).flatmap(lambda i: st.just(()) if i == 9 else schedule)


@st.composite
def cases(
    draw: Any, features: Features | None = None, max_inputs: int = 8, max_kills: int = 4
) -> Case:
    """A whole case: agent, inputs, checkpoint interval, concurrency and kill schedule."""
    feats = features or Features()
    events = tuple(f"E{i}" for i in range(1, draw(st.integers(1, 4)) + 1))
    n_actions = draw(st.integers(1, 7))
    actions = [draw(_action(i, events, feats)) for i in range(n_actions)]
    actions = _bound(_name_sites(actions))
    inputs = draw(
        st.lists(
            st.tuples(st.sampled_from(KEYS), st.integers(0, 60)), min_size=1, max_size=max_inputs
        )
    )
    return Case(
        events=events,
        actions=tuple(actions),
        inputs=tuple(inputs),
        kills=draw(kills(feats, max_kills)),
        interval_ms=draw(st.sampled_from([20, 0, 5, 50, 200])),
        max_runs=draw(st.sampled_from([64, 1, 3])),
        features=feats,
    )
