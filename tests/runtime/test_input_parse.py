"""The JSONL sources parse a line with the C scanner directly (`ratchet.runtime._io._loads`),
not with `json.loads` on bytes: for any line, the value or the error must be `json.loads`'s;
and a line too deeply nested for Python to read is a bad line like any other. Values nested
deeper than ratchet can store are refused where they are handed over (an input line, a
memory write), not by every checkpoint after them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ratchet import (
    Agent,
    BadInputError,
    EngineConfig,
    Event,
    InputEvent,
    OutputEvent,
    action,
    run,
)
from ratchet.agents._memory import WRITE_DEPTH
from ratchet.runtime._io import INPUT_MAX_DEPTH, _loads, _not_json, _too_deep
from ratchet.store import codec
from support.engines import run_flink_core


class Echo(Agent):
    @action(InputEvent, inline=True)
    def echo(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output=event.input))


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def outcome(fn: Any, text: bytes) -> tuple[str, str]:
    """What parsing gives, comparable: the value's canonical JSON, or the error's type and
    message (NaN compares as its JSON spelling)."""
    try:
        return "value", json.dumps(fn(text), sort_keys=True)
    except Exception as exc:  # noqa: BLE001 - any error must be the same one
        return type(exc).__name__, str(exc)


def strict_loads(text: bytes) -> Any:
    """`json.loads` as the sources read a line: NaN and Infinity, not JSON, are refused."""
    return json.loads(text, parse_constant=_not_json)


@settings(max_examples=400)
@given(
    value=JSON,
    ascii_only=st.booleans(),
    compact=st.booleans(),
    prefix=st.sampled_from([b"", b"\xef\xbb\xbf", b"\x00", b" "]),
    suffix=st.sampled_from([b"", b"x", b" 1", b"\x00", b"}"]),
)
def test_a_serialized_value_parses_as_json_loads_parses_it(
    value: Any, ascii_only: bool, compact: bool, prefix: bytes, suffix: bytes
) -> None:
    sep = (",", ":") if compact else (", ", ": ")
    text = prefix + json.dumps(value, ensure_ascii=ascii_only, separators=sep).encode() + suffix
    text = text.strip()
    if text:
        assert outcome(_loads, text) == outcome(strict_loads, text), text


@settings(max_examples=400)
@given(st.binary(min_size=1, max_size=40).map(bytes.strip).filter(bool))
@example(b"1\x00")
@example(b'"\xed\xa0\x80"')  # an encoded lone surrogate: json.loads takes it ("surrogatepass")
@example(b"\xff\xfe{\x00}\x00")  # a UTF-16 BOM
@example(b'{"a": 1} {"b": 2}')
@example(b"\xc2\xa01")  # a no-break space is not JSON whitespace
@example(b"[NaN]")
@example(b"\xef\xbb\xbf-Infinity")  # the slow path refuses it too
def test_any_bytes_parse_or_fail_as_json_loads_does(text: bytes) -> None:
    assert outcome(_loads, text) == outcome(strict_loads, text), text


def test_nan_and_infinity_in_an_input_line_are_a_bad_input(tmp_path: Path) -> None:
    """Python's reader took them (JSON has neither), and an output echoing one was written
    as `NaN`, which no standard JSON reader reads."""
    src = tmp_path / "in.jsonl"
    src.write_text(
        '{"key": "a", "v": 1.5}\n{"key": "b", "v": NaN}\n{"key": "c", "v": [-Infinity]}\n'
    )
    out = tmp_path / "out.jsonl"
    config = EngineConfig(on_bad_input="skip")
    result = run(Echo(), inputs=src, output=out, state_dir=tmp_path / "s", config=config)
    assert result.bad_inputs == [
        f"{src}:2: invalid JSON (NaN is not JSON; write null or a string)",
        f"{src}:3: invalid JSON (-Infinity is not JSON; write null or a string)",
    ]
    assert [json.loads(x)["output"] for x in out.read_text().splitlines()] == [
        {"key": "a", "v": 1.5}
    ]


def test_a_line_nested_too_deeply_to_read_is_a_bad_input_line(tmp_path: Path) -> None:
    """Python's JSON reader raises RecursionError for ~1,000 nested arrays; that is a bad line
    (its policy applies: here "stop", exit 3 on the command line), not a traceback."""
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"key": "a", "v": 1}) + "\n" + '{"key": "b", "v": ' + deep + "}\n"
    )
    with pytest.raises(BadInputError, match=r"in\.jsonl:2: invalid JSON \(.*nested too deeply"):
        run(
            Echo(),
            inputs=str(tmp_path / "in.jsonl"),
            output=str(tmp_path / "out.jsonl"),
            state_dir=str(tmp_path / "state"),
        )
    assert [json.loads(x)["output"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] == [
        {"key": "a", "v": 1}
    ]


def echo_skipping(tmp_path: Path, inputs: Any, name: str) -> tuple[Any, list[Any]]:
    """`Echo` over `inputs` with --on-bad-input skip: the result and the outputs' payloads."""
    out = tmp_path / f"{name}.jsonl"
    result = run(
        Echo(),
        inputs=inputs,
        output=str(out),
        state_dir=str(tmp_path / name),
        config=EngineConfig(on_bad_input="skip"),
    )
    return result, [json.loads(x)["output"] for x in out.read_text().splitlines()]


def nested(depth: int) -> str:
    """A JSON input line whose arrays and objects nest `depth` deep (the object counts)."""
    return '{"key": "k", "v": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def test_an_input_nested_deeper_than_ratchet_stores_is_a_bad_line(tmp_path: Path) -> None:
    """An input nested deeper than the codec stores used to be admitted and then fail every
    checkpoint, so nothing after it could ever be done; it is refused as a bad line now, and
    --on-bad-input skip goes past it. The deepest input that is taken is stored and echoed."""
    assert not _too_deep(json.loads(nested(INPUT_MAX_DEPTH)))
    assert _too_deep(json.loads(nested(INPUT_MAX_DEPTH + 1)))
    lines = [nested(INPUT_MAX_DEPTH + 1), nested(INPUT_MAX_DEPTH), nested(500)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result, outs = echo_skipping(tmp_path, str(tmp_path / "in.jsonl"), "state")
    said = f"in.jsonl:{{}}: the input nests more than {INPUT_MAX_DEPTH} arrays or objects"
    assert len(result.bad_inputs) == 2, result.bad_inputs
    assert said.format(1) in result.bad_inputs[0] and said.format(3) in result.bad_inputs[1]
    assert outs == [json.loads(nested(INPUT_MAX_DEPTH))]


class Later(Event):
    event_name = "tests.input_parse.Later"
    n: int


class Keeps(Agent):
    """Puts the input where ratchet nests it deepest: in memory and in an output, with an async
    task after them, so the run (and its journal) is stored while it is in flight."""

    @action(InputEvent, inline=True)
    def keep(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("last", event.input)
        ctx.send_event(OutputEvent(output=event.input))
        ctx.send_event(Later(n=1))

    @action(Later)
    async def later(self, event: Later, ctx: Any) -> None:
        await asyncio.sleep(0.01)


def test_the_deepest_input_taken_is_stored_by_both_engines(tmp_path: Path) -> None:
    """An input at the limit survives every place ratchet stores it: the embedded engine (its
    input row, memory, outbox, in-flight run journal) and the Flink core's keyed state (the
    run journal with the echoed output is the deepest, six containers down)."""
    row = json.loads(nested(INPUT_MAX_DEPTH))
    outputs, memory = run_flink_core(Keeps(), [row])
    assert [o["output"] for o in outputs] == [row] and memory["k"]["last"] == row
    (tmp_path / "in.jsonl").write_text(nested(INPUT_MAX_DEPTH) + "\n")
    result = run(
        Keeps(),
        inputs=str(tmp_path / "in.jsonl"),
        output=str(tmp_path / "out.jsonl"),
        state_dir=str(tmp_path / "state"),
        config=EngineConfig(checkpoint_interval=0.001),
    )
    assert not result.bad_inputs
    outs = [json.loads(x)["output"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert outs == [row]


def test_a_number_python_cannot_read_and_deep_python_inputs_are_bad_inputs(tmp_path: Path) -> None:
    """An integer over Python's 4,300 digits raised a plain ValueError through the JSONL
    source; a Python iterable's input nested in tuples is held to the same depth, and a
    self-referencing one keeps the codec's own message."""
    (tmp_path / "in.jsonl").write_text('{"key": "a", "v": ' + "7" * 5000 + "}\n")
    result, _ = echo_skipping(tmp_path, str(tmp_path / "in.jsonl"), "s1")
    assert (
        len(result.bad_inputs) == 1
        and "in.jsonl:1: invalid JSON (Exceeds" in (result.bad_inputs[0])
    )
    deep: Any = ()
    for _ in range(INPUT_MAX_DEPTH):
        deep = (deep,)
    loop: list[Any] = []
    loop.append(loop)
    inputs = [{"key": "a", "v": deep}, {"key": "b", "v": loop}, {"key": "c", "v": 1}]
    result, outs = echo_skipping(tmp_path, inputs, "s2")
    assert "input item 1: the input nests more than" in result.bad_inputs[0]
    assert "self-referencing" in result.bad_inputs[1], result.bad_inputs
    assert outs == [{"key": "c", "v": 1}]


def nest(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


class Stores(Agent):
    """Writes a value `d` lists deep into memory, then does async work (the run, with the
    write in its journal, is stored while in flight)."""

    @action(InputEvent, inline=True)
    def keep(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("x", nest(event.input["d"]))
        ctx.send_event(Later(n=1))

    @action(Later)
    async def later(self, event: Later, ctx: Any) -> None:
        await asyncio.sleep(0.01)
        ctx.send_event(OutputEvent(output="done"))


def test_a_memory_write_too_deep_to_store_fails_its_action_not_every_checkpoint(
    tmp_path: Path,
) -> None:
    """`set()` checked a value from its own top, but a run's journal keeps the write five
    containers down: a value 96 deep was taken and then failed every checkpoint (the job
    stopped, and stopped again on restart). It fails the action now, naming the limit;
    the job goes on, and a value at the limit is stored by both engines."""
    limit = codec.MAX_DEPTH - WRITE_DEPTH
    rows = [{"key": "k", "d": limit + 1}, {"key": "j", "d": limit}]
    outputs, memory = run_flink_core(Stores(), rows)
    (state_dir := tmp_path / "state").mkdir()
    result = run(
        Stores(),
        inputs=rows,
        output=str(tmp_path / "out.jsonl"),
        state_dir=str(state_dir),
        config=EngineConfig(checkpoint_interval=0.001),
    )
    embedded = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    for outs in (outputs, embedded):
        by_key = {o["key"]: o for o in outs}
        assert by_key["j"]["output"] == "done", outs
        assert f"nested more than {limit} levels deep" in by_key["k"]["error"]["message"]
    assert memory["j"]["x"] == nest(limit) and "x" not in memory.get("k", {})
    assert result.runs_failed == 1, result
