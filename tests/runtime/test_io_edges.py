"""The edges of the JSONL connectors: outputs the sink cannot write, outputs of another job,
an input file that is not the one the position was taken in, and rotated logs."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest

from ratchet import (
    Agent,
    BadInputError,
    ConfigError,
    EngineConfig,
    InputEvent,
    OutputEvent,
    SinkError,
    StateError,
    action,
    run,
)
from ratchet.runtime._io import (
    JOB_FILE,
    CallbackSink,
    JsonlFilesSource,
    JsonlSink,
    JsonlSource,
    Sink,
)
from ratchet.store._sqlite import SqliteStore


class Echo(Agent):
    @action(InputEvent, inline=True)
    def echo(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output=event.input))


class Tupled(Agent):
    """Emits a dict with a tuple key (the codec stores it; JSON cannot) when asked to."""

    @action(InputEvent, inline=True)
    def emit(self, event: InputEvent, ctx: Any) -> None:
        value = event.input
        if value.get("bad"):
            ctx.send_event(OutputEvent(output={"scores": {(1, 2): "pair"}, "i": value["i"]}))
        else:
            ctx.send_event(OutputEvent(output={"i": value["i"]}))


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def write_lines(path: Path, rows: list[dict[str, Any]], mode: str = "w") -> None:
    with path.open(mode) as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def position(state: Path) -> dict[str, Any]:
    store = SqliteStore.open_readonly(state)
    try:
        return dict(store.load().source["position"])
    finally:
        store.close()


# -- 6: an output the sink cannot write -----------------------------------------------------------


def test_an_unwritable_output_becomes_an_error_record_and_blocks_nothing(tmp_path: Path) -> None:
    inputs = [{"key": f"k{i % 2}", "i": i, "bad": i == 1} for i in range(6)]
    out = tmp_path / "o.jsonl"
    result = run(Tupled(), inputs=inputs, output=out, state_dir=tmp_path / "s")
    recs = lines(out)
    assert sorted(r["seq"] for r in recs) == list(range(6))  # nothing held back
    (bad,) = [r for r in recs if r["output"] is None]
    assert bad["id"] == "k1:1:r>emit:0" and bad["seq"] == 1 and bad["task"] == "r>emit"
    assert bad["error"]["action"] == "emit"
    assert bad["error"]["type"] == "ratchet._errors.CodecError"
    assert bad["error"]["event_type"] is None
    assert "output['scores'] has a key (1, 2) of type tuple" in bad["error"]["message"]
    assert "JSON object keys must be str, int, float, bool or None" in bad["error"]["message"]
    assert result.outputs == 6
    assert result.metrics["outputs.unwritable"] == 1
    # A restart writes nothing again.
    again = run(Tupled(), inputs=inputs, output=out, state_dir=tmp_path / "s")
    assert again.inputs == 0 and lines(out) == recs


class NonFinite(Agent):
    """Outputs NaN, an infinity nested in a list, or a finite float, and keeps each in memory."""

    @action(InputEvent, inline=True)
    def emit(self, event: InputEvent, ctx: Any) -> None:
        value = {"nan": float("nan"), "inf": [float("-inf")], "ok": 1.5}[event.input["v"]]
        ctx.short_term_memory.set("v", value)
        ctx.send_event(OutputEvent(output=value))


def _strict(text: str) -> Any:
    """json.loads as a standard JSON reader reads: NaN and Infinity are errors."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} in the JSON")

    return json.loads(text, parse_constant=refuse)


def test_nan_and_infinity_outputs_are_error_records_and_inspect_json_is_standard(
    tmp_path: Path,
) -> None:
    """They were written as `NaN` and `-Infinity`, which is not JSON; `inspect --json`
    printed them so too."""
    import subprocess
    import sys

    import ratchet

    inputs = [{"key": "a", "v": "nan"}, {"key": "b", "v": "inf"}, {"key": "c", "v": "ok"}]
    out = tmp_path / "o.jsonl"
    result = run(NonFinite(), inputs=inputs, output=out, state_dir=tmp_path / "s")
    assert result.metrics["outputs.unwritable"] == 2
    recs = {r["key"]: r for r in (_strict(x) for x in out.read_text().splitlines())}
    assert recs["c"]["output"] == 1.5
    assert recs["a"]["output"] is None and recs["a"]["error"]["message"] == (
        "the output was not written: output is nan, and JSON has no NaN or Infinity; write "
        "None or a string (e.g. 'NaN') instead"
    )
    assert recs["b"]["error"]["message"].startswith(
        "the output was not written: output[0] is -inf, and JSON has no NaN or Infinity"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "inspect", "--state", str(tmp_path / "s"), "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    shown = {"a": {"v": "NaN"}, "b": {"v": ["-Infinity"]}, "c": {"v": 1.5}}
    assert _strict(proc.stdout) == shown
    with ratchet.open_state(tmp_path / "s") as state:  # what the REST API serves
        assert state.memory("a", as_json=True) == {"v": "NaN"}
        assert state.memory_fields("a") == [{"path": "v", "type": "float", "value": "NaN"}]
        assert math.isnan(state.memory("a")["v"])  # as_json=False: the value itself


class _Down(Sink):
    """A sink that is down: every write fails, so outputs stay in the outbox."""

    def write(self, records: list[dict[str, Any]]) -> None:
        raise OSError("sink unavailable")


def test_an_unwritable_output_restored_from_the_outbox_gives_the_same_error_record(
    tmp_path: Path,
) -> None:
    inputs = [{"key": "k", "i": i, "bad": i % 2 == 1} for i in range(4)]
    run(Tupled(), inputs=inputs, output=tmp_path / "ref.jsonl", state_dir=tmp_path / "ref")
    # The first process checkpoints the outputs but cannot hand them over; the second one
    # restores them from the outbox, as after a crash between checkpoint and release.
    with pytest.raises(SinkError, match=r"4 output\(s\) .* \(OSError: sink unavailable\)"):
        run(Tupled(), inputs=inputs, output=_Down(), state_dir=tmp_path / "s")
    assert position(tmp_path / "s")["index"] == 4
    out = tmp_path / "o.jsonl"
    result = run(Tupled(), inputs=inputs, output=out, state_dir=tmp_path / "s")
    assert result.inputs == 0 and result.metrics["outputs.unwritable"] == 2

    def strip(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(({k: v for k, v in r.items() if k != "job"} for r in recs), key=str)

    assert strip(lines(out)) == strip(lines(tmp_path / "ref.jsonl"))


def test_sinks_say_what_they_can_write(tmp_path: Path) -> None:
    record = {"id": "k:0:r>a:0", "key": "k", "seq": 0, "task": "r>a", "output": {(1,): 1}}
    assert CallbackSink(lambda r: None).validate(record) is None
    sink = JsonlSink(tmp_path / "o.jsonl")  # checks the path, creates nothing
    assert not (tmp_path / "o.jsonl").exists()
    problem = sink.validate(record)
    assert problem is not None and "output has a key (1,) of type tuple" in problem
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    problem = sink.validate({**record, "output": deep})
    assert problem is not None and "nested too deeply" in problem
    loop: list[Any] = []
    loop.append(loop)
    problem = sink.validate({**record, "output": {"a": loop}})
    assert problem is not None and "output['a'][0] contains itself" in problem
    shared = [1, 2]  # the same list twice is no cycle: the tuple key is the problem
    problem = sink.validate({**record, "output": {"x": shared, "y": shared, "z": {(2,): 0}}})
    assert problem is not None and "output['z'] has a key (2,) of type tuple" in problem


# -- 7: an output file written by another job -----------------------------------------------------


def test_a_new_state_refuses_an_output_file_of_another_job(tmp_path: Path) -> None:
    inputs = [{"key": "a", "i": i} for i in range(3)]
    out = tmp_path / "o.jsonl"
    run(Echo(), inputs=inputs, output=out, state_dir=tmp_path / "s1")
    first = json.loads((tmp_path / "s1" / JOB_FILE).read_text())["job"]
    before = out.read_bytes()
    assert {r["job"] for r in lines(out)} == {first}

    # Reprocess with a clean state: the same ids, another job. Refused, nothing written.
    with pytest.raises(
        ConfigError, match=rf"--output {out} holds 3 output\(s\) of job {first}"
    ) as e:
        run(Echo(), inputs=inputs, output=out, state_dir=tmp_path / "s2")
    second = json.loads((tmp_path / "s2" / JOB_FILE).read_text())["job"]
    assert second != first
    assert f"is job {second}" in str(e.value) and "--append-output" in str(e.value)
    assert out.read_bytes() == before

    # Asked to append: every output of the new job is written, none dropped as a duplicate.
    result = run(Echo(), inputs=inputs, output=out, state_dir=tmp_path / "s2", append_output=True)
    assert result.outputs == 3
    recs = lines(out)
    assert [r["job"] for r in recs] == [first] * 3 + [second] * 3
    assert [r["id"] for r in recs[:3]] == [r["id"] for r in recs[3:]]
    # A restart of either job on the file keeps exactly-once, without the flag.
    more = [*inputs, {"key": "a", "i": 3}]
    run(Echo(), inputs=more, output=out, state_dir=tmp_path / "s2")
    run(Echo(), inputs=more, output=out, state_dir=tmp_path / "s1", append_output=True)
    recs = lines(out)
    assert len(recs) == 8 and len({(r["job"], r["id"]) for r in recs}) == 8


def test_the_job_id_is_created_once_with_the_state(tmp_path: Path) -> None:
    run(Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    job = json.loads((tmp_path / "s" / JOB_FILE).read_text())
    run(Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    assert json.loads((tmp_path / "s" / JOB_FILE).read_text()) == job
    assert job["format"] == 1 and len(job["job"]) == 16 and job["legacy_outputs"] is False
    (tmp_path / "s" / JOB_FILE).write_text("{not json")
    with pytest.raises(StateError, match=rf"{tmp_path / 's' / JOB_FILE}.*not a ratchet job file"):
        run(Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")


def test_a_state_from_before_job_ids_keeps_its_own_output(tmp_path: Path) -> None:
    inputs = [{"key": "a", "i": i} for i in range(3)]
    out = tmp_path / "o.jsonl"
    run(Echo(), inputs=inputs, output=out, state_dir=tmp_path / "s")
    # What an older ratchet left: no job file, output lines without a job field.
    (tmp_path / "s" / JOB_FILE).unlink()
    old = [{k: v for k, v in r.items() if k != "job"} for r in lines(out)]
    write_lines(out, old)
    run(Echo(), inputs=[*inputs, {"key": "a", "i": 3}], output=out, state_dir=tmp_path / "s")
    assert json.loads((tmp_path / "s" / JOB_FILE).read_text())["legacy_outputs"] is True
    assert [r["output"]["i"] for r in lines(out)] == [0, 1, 2, 3]
    # A new state is not the job that wrote those lines.
    with pytest.raises(ConfigError, match=r"an earlier job \(lines without a job id"):
        run(Echo(), inputs=inputs, output=out, state_dir=tmp_path / "s2")


def test_a_file_that_is_not_ratchet_output_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    out.write_text("hello\n")
    with pytest.raises(ConfigError, match=rf"--output {out} has a line that is not a ratchet"):
        run(Echo(), inputs=[{"key": "a"}], output=out, state_dir=tmp_path / "s")


def test_output_paths_are_checked_before_the_state_is_created(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cases = {
        tmp_path: "is a directory",
        tmp_path / "file" / "o.jsonl": f"{tmp_path / 'file'} is a file, not a directory",
    }
    for out, why in cases.items():
        with pytest.raises(ConfigError, match=rf"--output {out}.*{why}"):
            run(Echo(), inputs=[{"key": "a"}], output=out, state_dir=tmp_path / "s")
        assert not (tmp_path / "s").exists()
    with pytest.raises(ConfigError, match="append_output applies to a JSONL output path"):
        run(Echo(), inputs=[], output=print, state_dir=tmp_path / "s", append_output=True)


# -- 8: the input file is bound to the position ---------------------------------------------------


def test_another_input_file_is_refused_naming_both(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_lines(a, [{"key": "k", "i": i} for i in range(3)])
    write_lines(b, [{"key": "k", "i": i} for i in range(100, 110)])
    out = tmp_path / "o.jsonl"
    run(Echo(), inputs=a, output=out, state_dir=tmp_path / "s")
    pos = position(tmp_path / "s")
    st = os.stat(a)
    assert (pos["dev"], pos["ino"]) == (st.st_dev, st.st_ino)
    assert pos["offset"] == st.st_size and pos["line"] == 3
    assert len(pos["head"]) == len(pos["tail"]) == 32 and pos["window"] == 4096
    with pytest.raises(ConfigError, match=rf"--input {b} is not the file .* taken in {a} ") as e:
        run(Echo(), inputs=b, output=out, state_dir=tmp_path / "s")
    assert "its first bytes differ; resuming would skip its first 63 bytes" in str(e.value)
    assert f"Pass --input {a} to continue that job, or use a new --state" in str(e.value)
    assert [r["output"]["i"] for r in lines(out)] == [0, 1, 2]


def test_a_file_replaced_in_place_is_refused_and_a_moved_one_resumes(tmp_path: Path) -> None:
    a = tmp_path / "a.jsonl"
    write_lines(a, [{"key": "k", "i": i} for i in range(3)])
    out = tmp_path / "o.jsonl"
    run(Echo(), inputs=a, output=out, state_dir=tmp_path / "s")
    # Moved (same file, same bytes), then appended to: it resumes after what it read.
    moved = tmp_path / "moved.jsonl"
    a.rename(moved)
    write_lines(moved, [{"key": "k", "i": 3}], mode="a")
    run(Echo(), inputs=moved, output=out, state_dir=tmp_path / "s")
    assert [r["output"]["i"] for r in lines(out)] == [0, 1, 2, 3]
    # Replaced by a new file at the same path, as long as the old one: refused.
    moved.unlink()
    write_lines(moved, [{"key": "k", "i": i} for i in range(200, 210)])
    with pytest.raises(ConfigError, match=rf"--input {moved} is not the file"):
        run(Echo(), inputs=moved, output=out, state_dir=tmp_path / "s")
    # The same file truncated below the position: bad input, as before.
    out2 = tmp_path / "o2.jsonl"
    run(Echo(), inputs=moved, output=out2, state_dir=tmp_path / "s2")
    moved.write_text("")
    with pytest.raises(
        BadInputError,
        match=rf"{moved} is shorter \(0 bytes\).*truncated\. Put its first \d+ bytes back.*"
        r"new --state directory",
    ):
        run(Echo(), inputs=moved, output=out2, state_dir=tmp_path / "s2")


def test_a_position_without_identity_is_still_resumed(tmp_path: Path) -> None:
    a = tmp_path / "a.jsonl"
    write_lines(a, [{"key": "k", "i": i} for i in range(4)])
    first = len(json.dumps({"key": "k", "i": 0})) + 1
    src = JsonlSource(a)
    src.restore({"offset": first, "line": 1, "path": "elsewhere.jsonl"})  # an older ratchet's
    got = []
    while (rec := src.next_record()) is not None:
        got.append(rec.value["i"])
    src.close()
    assert got == [1, 2, 3]


def test_sources_refuse_positions_of_another_kind(tmp_path: Path) -> None:
    a = tmp_path / "a.jsonl"
    write_lines(a, [{"key": "k"}])
    with pytest.raises(ConfigError, match="from a Python iterable"):
        JsonlSource(a).restore({"index": 3})
    with pytest.raises(ConfigError, match="from files matching 'logs/\\*'"):
        JsonlSource(a).restore({"pattern": "logs/*", "files": []})
    run(Echo(), inputs=a, output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    with pytest.raises(ConfigError, match=rf"from the file {a}.*not from a Python iterable"):
        run(Echo(), inputs=[{"key": "k"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")


def test_the_restart_check_reads_a_few_kilobytes_of_a_large_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = tmp_path / "big.jsonl"
    row = (json.dumps({"key": "k", "pad": "x" * 200}) + "\n").encode()
    with big.open("wb") as fh:
        fh.write(row * 200_000)  # about 45 MB, all of it read before the restart
    src = JsonlSource(big)
    src.restore({"offset": big.stat().st_size, "line": 200_000, "path": str(big)})
    assert src.next_record() is None
    pos = src.position()
    src.close()
    assert pos["head"] is not None and pos["tail"] is not None
    reads: list[int] = []
    real = os.pread

    def counting(fd: int, n: int, offset: int) -> bytes:
        reads.append(n)
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", counting)
    again = JsonlSource(big)
    again.restore(pos)  # checks the identity: two windows, whatever the file's length
    again.close()
    assert sum(reads) == 2 * 4096


def test_a_followed_file_that_is_rotated_stops_with_the_fix(tmp_path: Path) -> None:
    a = tmp_path / "app.jsonl"
    write_lines(a, [{"key": "k", "i": 0}])
    src = JsonlSource(a, follow=True)
    try:
        rec = src.next_record()
        assert rec is not None and rec.value["i"] == 0
        assert src.next_record() is None
        a.rename(tmp_path / "app.jsonl.1")
        write_lines(tmp_path / "app.jsonl.1", [{"key": "k", "i": 1}], mode="a")
        rec = src.next_record()  # a late line in the renamed file is still read
        assert rec is not None and rec.value["i"] == 1
        assert src.next_record() is None  # renamed away, no new file yet: waits
        write_lines(a, [{"key": "k", "i": 2}])
        with pytest.raises(ConfigError, match=rf"--input {a} was replaced .*--input '{a}\*'"):
            src.next_record()
    finally:
        src.close()
    b = tmp_path / "b.jsonl"
    write_lines(b, [{"key": "k", "i": 0}, {"key": "k", "i": 1}])
    src = JsonlSource(b, follow=True)
    try:
        assert src.next_record() is not None and src.next_record() is not None
        b.write_text("")  # copytruncate
        with pytest.raises(BadInputError, match=rf"{b} was truncated to 0 bytes .*copytruncate"):
            src.next_record()
    finally:
        src.close()


@pytest.mark.parametrize("aligned", [True, False])
def test_a_followed_file_truncated_and_written_past_the_position_is_bad_input(
    tmp_path: Path, aligned: bool
) -> None:
    """Copytruncate, then more lines than were read before the reader looked: the size never
    fell below the position, so the new file's first lines were skipped without a word (lines
    of the same length), or a line cut in two was called invalid JSON."""
    c = tmp_path / "c.jsonl"
    write_lines(c, [{"key": "k", "i": i} for i in range(3)])
    src = JsonlSource(c, follow=True)
    try:
        for _ in range(3):
            assert src.next_record() is not None
        assert src.next_record() is None  # caught up: at the end of the file
        width = 1 if aligned else 3  # the same line length as before, or not
        lines = [{"key": "k", "i": 10**width + j} for j in range(8)]
        with open(c, "r+b") as fh:  # copytruncate: the same file, cut, then written again
            fh.truncate(0)
        write_lines(c, lines)
        with pytest.raises(BadInputError, match=rf"{c} was rewritten in place .*copytruncate"):
            src.next_record()
        with pytest.raises(BadInputError):  # and again: nothing after it is taken
            src.next_record()
    finally:
        src.close()


# -- rotation: a pattern or a directory source ----------------------------------------------------


def _touch(path: Path, t: float) -> None:
    os.utime(path, (t, t))


def test_a_directory_is_read_oldest_first_and_rotation_loses_and_repeats_nothing(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    now = time.time()
    write_lines(logs / "app.jsonl.2", [{"key": "k", "i": 0}, {"key": "k", "i": 1}])
    write_lines(logs / "app.jsonl.1", [{"key": "k", "i": 2}])
    write_lines(logs / "app.jsonl", [{"key": "k", "i": 3}])
    for age, name in enumerate(["app.jsonl", "app.jsonl.1", "app.jsonl.2"]):
        _touch(logs / name, now - 100 * (age + 1))
    out = tmp_path / "o.jsonl"
    run(Echo(), inputs=logs, output=out, state_dir=tmp_path / "s")
    assert [r["output"]["i"] for r in lines(out)] == [0, 1, 2, 3]

    # More lines, then rotation: rename every file one up, drop the oldest, start a new one.
    write_lines(logs / "app.jsonl", [{"key": "k", "i": 4}], mode="a")
    (logs / "app.jsonl.2").unlink()
    (logs / "app.jsonl.1").rename(logs / "app.jsonl.2")
    (logs / "app.jsonl").rename(logs / "app.jsonl.1")
    write_lines(logs / "app.jsonl", [{"key": "k", "i": 5}])
    _touch(logs / "app.jsonl", now + 10)
    run(Echo(), inputs=logs, output=out, state_dir=tmp_path / "s")
    assert [r["output"]["i"] for r in lines(out)] == [0, 1, 2, 3, 4, 5]
    pos = position(tmp_path / "s")
    assert pos["pattern"] == str(logs / "*")
    assert [Path(f["path"]).name for f in pos["files"]] == [
        "app.jsonl.2",
        "app.jsonl.1",
        "app.jsonl",
    ]


def test_a_glob_source_takes_over_a_single_file_position(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    write_lines(logs / "app.jsonl", [{"key": "k", "i": 0}, {"key": "k", "i": 1}])
    out = tmp_path / "o.jsonl"
    run(Echo(), inputs=logs / "app.jsonl", output=out, state_dir=tmp_path / "s")
    write_lines(logs / "app.jsonl", [{"key": "k", "i": 2}], mode="a")
    (logs / "app.jsonl").rename(logs / "app.jsonl.1")
    write_lines(logs / "app.jsonl", [{"key": "k", "i": 3}])
    # The single file was rotated: refused by name, with the fix ...
    with pytest.raises(ConfigError, match=rf"fewer than the 42 .* --input '{logs}/app.jsonl\*'"):
        run(Echo(), inputs=logs / "app.jsonl", output=out, state_dir=tmp_path / "s")
    # ... which resumes the old file where it was, then reads the new one.
    run(Echo(), inputs=str(logs / "app.jsonl*"), output=out, state_dir=tmp_path / "s")
    assert [r["output"]["i"] for r in lines(out)] == [0, 1, 2, 3]


def test_a_file_that_vanishes_before_it_is_read_is_bad_input(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    now = time.time()
    write_lines(logs / "a.jsonl", [{"key": "k", "i": 0}])
    write_lines(logs / "b.jsonl", [{"key": "k", "i": 1}])
    _touch(logs / "a.jsonl", now - 10)
    src = JsonlFilesSource(str(logs / "*.jsonl"))
    rec = src.next_record()
    assert rec is not None and rec.value["i"] == 0
    pos = src.position()
    src.close()
    (logs / "b.jsonl").rename(logs / "b.old")  # out of the pattern before it was read
    src = JsonlFilesSource(str(logs / "*.jsonl"))
    src.restore(pos)
    rec = src.next_record()
    assert rec is not None and rec.error is not None
    assert f"{logs / 'b.jsonl'}" in rec.error and "no longer matches" in rec.error
    assert "--on-bad-input skip" in rec.error
    src.unread()
    rec = src.next_record()
    assert rec is not None and rec.error is not None  # still there after stepping back
    assert src.next_record() is None
    src.close()


def test_a_pattern_that_matches_nothing_is_refused_unless_followed(tmp_path: Path) -> None:
    pattern = str(tmp_path / "logs" / "*.jsonl")
    with pytest.raises(ConfigError, match=r"--input '.*\*\.jsonl' matches no file.*--follow"):
        run(Echo(), inputs=pattern, output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    assert not (tmp_path / "s").exists()
    src = JsonlFilesSource(pattern, follow=True)
    assert src.next_record() is None  # waits for files to appear
    (tmp_path / "logs").mkdir()
    write_lines(tmp_path / "logs" / "a.jsonl", [{"key": "k", "i": 0}])
    rec = src.next_record()
    assert rec is not None and rec.value == {"key": "k", "i": 0}
    src.close()


class _Unstorable:
    pass


def test_an_iterable_input_the_state_cannot_store_is_bad_input_named(tmp_path: Path) -> None:
    """A JSONL line is always storable; a Python object in an iterable may not be. It is bad
    input, named by its position, with the usual choices; not a failing checkpoint."""
    items = [{"key": "a", "i": 0}, {"key": "b", "v": _Unstorable()}, {"key": "c", "i": 2}]
    with pytest.raises(BadInputError, match=r"input item 2\.v.*_Unstorable"):
        run(Echo(), inputs=items, output=tmp_path / "out.jsonl", state_dir=tmp_path / "s")
    assert [r["output"] for r in lines(tmp_path / "out.jsonl")] == [{"key": "a", "i": 0}]
    res = run(
        Echo(),
        inputs=items,
        output=tmp_path / "out.jsonl",
        state_dir=tmp_path / "s",
        config=EngineConfig(on_bad_input="skip"),
    )
    assert len(res.bad_inputs) == 1 and "input item 2" in res.bad_inputs[0]
    assert [r["output"]["key"] for r in lines(tmp_path / "out.jsonl")] == ["a", "c"]


def test_a_followed_file_restored_reads_no_more_than_a_window_to_check_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restore the last line's start is not known: the check read the whole file up
    to the position, twice (gigabytes for a long log)."""
    from ratchet.runtime import _io

    big = tmp_path / "big.jsonl"
    write_lines(big, [{"key": "k", "i": i, "pad": "x" * 200} for i in range(2000)])
    first = JsonlSource(big, follow=True)
    while first.next_record() is not None:
        pass
    position = first.position()
    first.close()
    reads: list[int] = []
    real = _io.os.pread

    def spy(fd: int, n: int, at: int) -> bytes:
        reads.append(n)
        return real(fd, n, at)

    monkeypatch.setattr(_io.os, "pread", spy)
    src = JsonlSource(big, follow=True)
    try:
        src.restore(position)
        assert src.next_record() is None
        write_lines(big, [{"key": "k", "i": 2000}], mode="a")
        rec = src.next_record()
        assert rec is not None and rec.value["i"] == 2000
    finally:
        src.close()
    assert reads and max(reads) <= _io.WINDOW, reads
