"""The stored form of run traces (`ratchet.store._traces`): the compact format gives back
what was packed (times to the microsecond), the first format is still read, and anything
unusual falls back to the first format rather than being lost."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratchet.store import codec
from ratchet.store._traces import pack_trace, unpack_trace

names = st.text(min_size=1, max_size=12)
times = st.floats(1e9, 2e9, allow_nan=False)
durations = st.floats(0, 100, allow_nan=False)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**31), 2**31), st.text(max_size=8))


@st.composite
def steps(draw: Any) -> dict[str, Any]:
    path = draw(st.lists(names, min_size=1, max_size=3))
    task = ">".join(["r", *path])
    action = path[-1] if draw(st.booleans()) else draw(names)
    step: dict[str, Any] = {
        "task": task,
        "action": action,
        "index": draw(st.integers(0, 10_000)),
        "on": draw(names),
        "replayed": draw(st.booleans()),
        "memory": draw(st.lists(st.lists(scalars, min_size=2, max_size=3), max_size=3)),
        "events": draw(st.lists(names, max_size=3)),
        "started": draw(times),
        "duration": draw(durations),
    }
    extra = draw(st.dictionaries(st.sampled_from(["attempts", "calls", "notes"]), scalars))
    step.update(extra)
    return step


@settings(deadline=None)  # a loaded machine is slow, not wrong
@given(started=st.one_of(st.none(), times), tasks=st.lists(steps(), max_size=6))
def test_the_compact_format_gives_back_the_steps(
    started: float | None, tasks: list[dict[str, Any]]
) -> None:
    got_started, got = unpack_trace(pack_trace(started, tasks))
    assert got_started == started
    assert len(got) == len(tasks)
    for want, step in zip(tasks, got):
        assert step.keys() == want.keys()
        for k, v in want.items():
            if k in ("started", "duration"):
                assert step[k] == pytest.approx(v, abs=2e-6)
            else:
                assert step[k] == v, k


def test_the_first_format_is_still_read() -> None:
    tasks = [{"task": "r>one", "action": "one", "index": 0, "on": "ratchet.InputEvent",
              "replayed": False, "memory": [], "events": [], "started": 1.5, "duration": 0.25}]  # fmt: skip
    blob = codec.encode_built({"started": None, "tasks": tasks})
    assert unpack_trace(blob) == (None, tasks)


def test_steps_without_the_usual_fields_are_kept_in_the_first_format() -> None:
    odd = [{"task": "r>one", "what": "else"}, {"started": 1, "duration": 2}]
    assert unpack_trace(pack_trace(3.0, odd)) == (3.0, odd)


def test_it_is_smaller() -> None:
    step = {"task": "r>one.0>two", "action": "two", "index": 1, "on": "peers.Mid",
            "replayed": False, "memory": [["s", "v", 0]], "events": ["peers.Last"],
            "started": 1796175625.6840894, "duration": 5.1021575927734375e-05}  # fmt: skip
    tasks = [dict(step, index=i) for i in range(3)]
    old = codec.encode_built({"started": None, "tasks": tasks})
    assert len(pack_trace(None, tasks)) < len(old) / 2


def test_a_list_that_is_not_a_trace_is_corrupt_data() -> None:
    with pytest.raises(codec.CorruptDataError, match="not one"):
        unpack_trace(codec.encode([7, None]))


def test_the_format_with_a_name_table_is_read() -> None:
    # Written only by this branch's first commit of the compact form: read, never written.
    names = ["r>one", "ratchet.InputEvent", "x", "peers.Mid"]
    blob = codec.encode([2, None, 10.0, names, [[0, -1, 0, 1, False, [], [3], 5, 7],
                                               [0, 2, 1, 3, True, [["s", "v", 1]], [], 9, 1]]])  # fmt: skip
    _started, (first, second) = unpack_trace(blob)
    assert first["action"] == "one" and first["on"] == "ratchet.InputEvent"
    assert first["events"] == ["peers.Mid"] and first["started"] == 10.000005
    assert second["action"] == "x" and second["memory"] == [["s", "v", 1]]
