"""The per-step path's shortcuts give what the general path gives (issue 19): a run's trace
laid out directly packs to the bytes `pack_trace` makes of its step dicts, and an output
record whose fields the codec admitted when it was sent packs with `encode_built` to the
bytes `encode` makes."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ratchet.agents._events import OutputEvent, freeze
from ratchet.runtime._engine import _trace_packer
from ratchet.runtime._machine import TaskResult, TraceStep, trace_dicts
from ratchet.store import codec
from ratchet.store._traces import pack_trace, unpack_trace

names = st.text(min_size=1, max_size=10)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=4),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers(-5, 5)), inner, max_size=3),
    ),
    max_leaves=8,
)
ops = st.one_of(
    st.tuples(st.just("s"), names, values),
    st.tuples(st.just("d"), names),
    st.tuples(st.just("o"), names),
)


@st.composite
def trace_steps(draw: Any) -> list[TraceStep]:
    out: list[TraceStep] = []
    for _ in range(draw(st.integers(0, 4))):
        path = draw(st.lists(names, min_size=1, max_size=3))
        task_id = ">".join(["r", *path])
        action = path[-1] if draw(st.booleans()) else draw(names)
        res = TaskResult(
            draw(st.lists(ops, max_size=3)),
            [],
            draw(st.lists(names, max_size=3)),
            draw(
                st.none()
                | st.dictionaries(st.sampled_from(["calls", "notes", "attempts"]), scalars)
            ),
        )
        if draw(st.integers(0, 9)):  # now and then a step that was not timed (replayed)
            res.started = draw(st.floats(1e9, 2e9, allow_nan=False))
            res.duration = draw(st.floats(0, 100, allow_nan=False))
        out.append(
            (task_id, action, draw(st.integers(0, 999)), draw(names), draw(st.booleans()), res)
        )
    return out


def describe(event: Any) -> str:
    return f"<{event}>"


@settings(max_examples=300, deadline=None)
@given(trace_steps(), st.none() | st.floats(1e9, 2e9, allow_nan=False))
def test_a_trace_laid_out_directly_packs_to_the_bytes_of_its_step_dicts(
    steps: list[TraceStep], started: float | None
) -> None:
    packed = _trace_packer(describe)(started, steps)
    assert packed == pack_trace(started, trace_dicts(steps, describe))
    unpack_trace(packed)  # and it reads back


@settings(max_examples=300, deadline=None)
@given(values, st.one_of(st.text(max_size=5), st.integers(), st.tuples(st.integers(), names)))
def test_an_admitted_output_record_packs_with_encode_built_as_with_encode(
    output: Any, key: Any
) -> None:
    try:
        emitted = freeze(OutputEvent(output=output))
    except codec.CodecError:
        return  # refused when sent: never an output record
    assert emitted.encoded
    record = {"id": f"{key}:1:r>a:0", "key": key, "seq": 1, "task": "r>a"}
    record["output"] = emitted.field("output")
    assert codec.encode_built(record) == codec.encode(record)
