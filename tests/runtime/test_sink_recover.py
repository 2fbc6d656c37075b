"""`JsonlSink` reads the output file at start to learn which ids it holds: lines laid out as
ratchet writes them are read a block at a time by one regular expression. Whatever the
file holds, that must decide exactly what reading it a line at a time decides (the ids,
another job's lines, the refusal, a cut last line dropped, a bad line refused)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ratchet import ConfigError
from ratchet.runtime import _io
from ratchet.runtime._io import JobIdentity, JsonlSink, _line_id

JOB, OTHER = "ab12", "cd34"
ids = st.text(min_size=0, max_size=6)


def line_at_a_time(path: Path, job: JobIdentity | None) -> tuple[set[str], dict[Any, int], int]:
    """The reading before blocks: (ids of this job, other jobs' line counts, bytes kept)."""
    keep = 0
    mine: set[str] = set()
    others: dict[Any, int] = {}
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            keep += len(raw)
            out_id, line_job = _line_id(raw)
            if job is None or line_job == job.id or (line_job is None and job.legacy_outputs):
                mine.add(out_id)
            else:
                others[line_job] = others.get(line_job, 0) + 1
    return mine, others, keep


@st.composite
def lines(draw: Any) -> bytes:
    out_id = draw(ids)
    kind = draw(st.sampled_from(["mine", "other", "legacy", "escaped", "bare", "garbage"]))
    if kind == "garbage":
        return draw(st.sampled_from([b"not json", b'{"x": 1}', b'{"id":"\xff","job":"ab12",1}']))
    rec: dict[str, Any] = {"id": out_id}
    if kind in ("mine", "other", "escaped"):
        rec["job"] = OTHER if kind == "other" else JOB
    if kind != "bare":
        rec["key"] = draw(st.integers(0, 3))
    text = json.dumps(rec, separators=(",", ":"), ensure_ascii=kind == "escaped")
    return text.encode()


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=st.lists(lines(), max_size=12),
    cut=st.booleans(),
    legacy=st.booleans(),
    block=st.sampled_from([7, 64, 1 << 22]),
)
def test_blocks_decide_what_lines_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: list[bytes], cut: bool, legacy: bool,
    block: int,
) -> None:  # fmt: skip
    monkeypatch.setattr(_io, "_RECOVER_BLOCK", block)
    path = tmp_path / "o.jsonl"
    path.write_bytes(b"".join(x + b"\n" for x in body) + (b'{"id":"cut' if cut else b""))
    job = JobIdentity(JOB, tmp_path, legacy_outputs=legacy)
    try:
        want: Any = line_at_a_time(path, job)
    except (ValueError, KeyError, TypeError, AttributeError):
        want = ConfigError
    sink = JsonlSink(path, append=True)
    others: dict[Any, int] = {}
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        end = data.rfind(b"\n") + 1
        sink._read_lines(data[:end], job, others)
        got: Any = (sink._ids, others, end)
    except ConfigError:
        got = ConfigError
    assert got == want
    # and through open(): the same ids, the cut line gone
    if want is not ConfigError:
        sink = JsonlSink(path, append=True)
        sink.open(job)
        sink.close()
        assert sink._ids == want[0] and path.stat().st_size == want[2]


@pytest.mark.parametrize("tail", [b'{"note":1}', b"plain text", b"[1, 2]", b'{"users":[1,2]} '])
@pytest.mark.parametrize("append", [False, True])
def test_a_foreign_last_line_without_its_newline_is_refused_and_left_alone(
    tmp_path: Path, tail: bytes, append: bool
) -> None:
    path = tmp_path / "o.jsonl"
    body = b'{"id":"a","job":"ab12","key":1}\n' + tail
    path.write_bytes(body)
    with pytest.raises(ConfigError, match="not a ratchet output"):
        JsonlSink(path, append=append).open(JobIdentity(JOB, tmp_path))
    assert path.read_bytes() == body


@pytest.mark.parametrize("job", [JOB, OTHER])
def test_a_whole_last_line_that_only_lacks_its_newline_is_kept_and_ended(
    tmp_path: Path, job: str
) -> None:
    """Another job's whole line (or this job's) that lost only its newline is an output
    that was written: kept, its id known, the line ended before the next one is appended."""
    path = tmp_path / "o.jsonl"
    path.write_bytes(
        b'{"id":"a","job":"ab12","key":1}\n{"id":"b","job":"%s","key":2}' % job.encode()
    )
    sink = JsonlSink(path, append=True)
    sink.open(JobIdentity(JOB, tmp_path))
    sink.write_lines([("c", '{"id":"c","job":"ab12","key":3}')])
    sink.close()
    assert sink._ids >= ({"a", "b", "c"} if job == JOB else {"a", "c"})
    got = [_line_id(raw) for raw in path.read_bytes().splitlines()]
    assert got == [("a", JOB), ("b", job), ("c", JOB)]


def test_a_cut_ratchet_line_is_dropped(tmp_path: Path) -> None:
    for cut in (b"{", b'{"id', b'{"id":"x","job":"ab12","ke'):
        path = tmp_path / "o.jsonl"
        path.write_bytes(b'{"id":"a","job":"ab12","key":1}\n' + cut)
        sink = JsonlSink(path, append=False)
        sink.open(JobIdentity(JOB, tmp_path))
        sink.close()
        assert path.read_bytes() == b'{"id":"a","job":"ab12","key":1}\n'


@pytest.mark.parametrize("zeros", [1, 37, 4096])
def test_a_last_line_of_nul_bytes_is_dropped_as_a_crash_leaves_it(
    tmp_path: Path, zeros: int
) -> None:
    """A machine that stops between a write and its fsync can leave the file's new end as
    NUL bytes (XFS; ext4 with delayed allocation): torn, dropped, written again."""
    path = tmp_path / "o.jsonl"
    whole = b'{"id":"a","job":"ab12","key":1}\n'
    for tail in (b"\0" * zeros, b'{"id":"b","job":"ab12","ke' + b"\0" * zeros):
        path.write_bytes(whole + tail)
        sink = JsonlSink(path, append=False)
        sink.open(JobIdentity(JOB, tmp_path))
        sink.close()
        assert path.read_bytes() == whole


class _Echo:
    """An agent whose outputs are its inputs (made inside the test: ratchet is imported)."""

    @staticmethod
    def make() -> Any:
        import ratchet

        class Echo(ratchet.Agent):
            @ratchet.action(ratchet.InputEvent, inline=True)
            def echo(self, event: ratchet.InputEvent, ctx: ratchet.RunnerContext) -> None:
                ctx.send_event(ratchet.OutputEvent(output=event.input))

        return Echo()


def _cut_last_line(out: Path, keep: int) -> str:
    data = out.read_bytes()
    last = data[:-1].rsplit(b"\n", 1)[-1]
    out.write_bytes(data[: len(data) - len(last) - 1 + keep])
    return str(json.loads(last)["id"])


@pytest.mark.parametrize("keep", [40, 12])  # the whole id kept, or only its start
def test_a_line_cut_after_its_output_was_released_is_named_as_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, keep: int
) -> None:
    import ratchet

    inp, out, state = tmp_path / "in.jsonl", tmp_path / "o.jsonl", tmp_path / "s"
    inp.write_text("".join(json.dumps({"key": f"k{i}", "i": i}) + "\n" for i in range(10)))
    ratchet.run(_Echo.make(), inputs=inp, output=out, state_dir=state)
    lost = _cut_last_line(out, keep)
    with inp.open("a") as fh:
        fh.write(json.dumps({"key": "k1", "i": 99}) + "\n")
    with caplog.at_level("INFO", logger="ratchet"):
        ratchet.run(_Echo.make(), inputs=inp, output=out, state_dir=state)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "that output is lost" in warned[0], warned
    assert repr(lost if keep == 40 else lost[: keep - len('{"id":"')]) in warned[0]
    assert lost not in {json.loads(x)["id"] for x in out.read_text().splitlines()}


@pytest.mark.parametrize("prefix", ["k", 'k"\\é'])  # escapes in the line's id
@pytest.mark.parametrize("keep", [40, 14])  # the whole id kept, or only its start
def test_a_line_a_crash_cut_is_written_again_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, prefix: str, keep: int
) -> None:
    """What a kill -9 between the line's write and its sync leaves: the output still in the
    outbox (released only after the sync), its line cut."""
    import sqlite3

    import ratchet
    from ratchet.store import codec

    inp, out, state = tmp_path / "in.jsonl", tmp_path / "o.jsonl", tmp_path / "s"
    inp.write_text("".join(json.dumps({"key": f"{prefix}{i}", "i": i}) + "\n" for i in range(10)))
    ratchet.run(_Echo.make(), inputs=inp, output=out, state_dir=state)
    line = json.loads(out.read_text().splitlines()[-1])
    record = {k: line[k] for k in ("id", "key", "seq", "task", "output")}
    with sqlite3.connect(state / "ratchet.db") as db:
        db.execute(
            "INSERT INTO outbox(id, seq, record) VALUES (?, ?, ?)",
            (record["id"], record["seq"], codec.encode(record)),
        )
    _cut_last_line(out, keep)
    with caplog.at_level("INFO", logger="ratchet"):
        ratchet.run(_Echo.make(), inputs=inp, output=out, state_dir=state)
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert "was cut by a crash; it is written again" in caplog.text
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in lines].count(record["id"]) == 1
    assert len(lines) == 10


ECHO_FILE = """
import ratchet


class Echo(ratchet.Agent):
    @ratchet.action(ratchet.InputEvent, inline=True)
    def echo(self, event: ratchet.InputEvent, ctx: ratchet.RunnerContext) -> None:
        ctx.send_event(ratchet.OutputEvent(output=event.input))
"""


@pytest.mark.parametrize("crash", [False, True], ids=["by-hand", "by-a-crash"])
def test_a_cut_line_of_a_sharded_job_is_named_as_lost_unless_a_shard_still_holds_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, crash: bool
) -> None:
    """With --workers 2 the coordinator writes the output file and the shards hold the
    outboxes: a line cut by hand after its output was released was dropped silently."""
    import sqlite3

    import ratchet
    from ratchet.runtime._shards import read_layout, shard_of
    from ratchet.store import codec

    (tmp_path / "echo.py").write_text(ECHO_FILE)
    agent = f"{tmp_path / 'echo.py'}:Echo"
    inp, out, state = tmp_path / "in.jsonl", tmp_path / "o.jsonl", tmp_path / "s"
    inp.write_text("".join(json.dumps({"key": f"k{i}", "i": i}) + "\n" for i in range(10)))
    ratchet.run(agent, inputs=inp, output=out, state_dir=state, workers=2)
    line = json.loads(out.read_text().splitlines()[-1])
    if crash:  # what a kill -9 between the line's write and its sync leaves behind
        dirs = read_layout(state).dirs
        record = {k: line[k] for k in ("id", "key", "seq", "task", "output")}
        db = sqlite3.connect(dirs[shard_of(line["key"], len(dirs))] / "ratchet.db")
        try:  # closed before the workers are forked from this process
            with db:
                db.execute(
                    "INSERT INTO outbox(id, seq, record) VALUES (?, ?, ?)",
                    (record["id"], record["seq"], codec.encode(record)),
                )
        finally:
            db.close()
    lost = _cut_last_line(out, 40)
    with caplog.at_level("INFO", logger="ratchet"):
        ratchet.run(agent, inputs=inp, output=out, state_dir=state, workers=2)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    if crash:
        assert warned == [] and "was cut by a crash; it is written again" in caplog.text
        assert ids.count(lost) == 1 and len(ids) == 10
    else:
        assert len(warned) == 1 and "that output is lost" in warned[0], warned
        assert repr(lost) in warned[0] and lost not in ids
