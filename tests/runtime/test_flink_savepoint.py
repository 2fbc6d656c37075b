"""What `ratchet flink run --from-savepoint` reads from a savepoint without Flink: the execution
mode it was taken in (state names), the input files its job read (the source's URIs), and
whether a run to completion may continue from it (ratchet's marker). No PyFlink needed:
synthetic savepoint folders holding bytes the way Flink writes them."""

from __future__ import annotations

import argparse
import struct
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ratchet._errors import ConfigError
from ratchet.cli._flink import (
    _checkpoint_dir,
    _refuse_earlier_outputs,
    _restores_to_completion,
    _savepoint_target,
    _warn_unread_inputs,
    execution_mode,
)
from ratchet.runtime._flink_savepoint import (
    MARKER,
    MODE_ENV,
    PROCESS_STATES,
    THREAD_STATES,
    earlier_outputs,
    local_path,
    newest_restore_point,
    note_job,
    output_jobs,
    read_marker,
    savepoint_mode,
    unread_inputs,
    write_marker,
)
from support.job_client import JobStatus, check_a_refused_stop_reports_the_jobs_failure


def utf(name: str) -> bytes:
    raw = name.encode()
    return struct.pack(">H", len(raw)) + raw


def process_name(name: str) -> bytes:
    return utf("python-state-" + name)


def savepoint(tmp: Path, *chunks: bytes, file: str = "_metadata") -> Path:
    d = tmp / "savepoint-abc"
    d.mkdir(parents=True, exist_ok=True)
    (d / file).write_bytes(b"".join(chunks))
    return d


@given(
    which=st.sampled_from(["process", "thread"]),
    name=st.integers(0, 3),
    before=st.binary(max_size=200),
    after=st.binary(max_size=200),
)
def test_the_mode_is_read_from_any_state_name_wherever_it_sits(
    tmp_path_factory: pytest.TempPathFactory, which: str, name: int, before: bytes, after: bytes
) -> None:
    tmp = tmp_path_factory.mktemp("sp")
    token = process_name(PROCESS_STATES[name]) if which == "process" else utf(THREAD_STATES[name])
    d = savepoint(tmp, before, token, after)
    assert savepoint_mode(str(d)) == which
    assert savepoint_mode(d.as_uri()) == which
    assert savepoint_mode(str(d / "_metadata")) == which  # the metadata file named itself


def test_large_state_keeps_its_names_in_a_state_file_beside_metadata(tmp_path: Path) -> None:
    d = savepoint(tmp_path, b"\x00" * 100)  # no names inline
    (d / "3f2a-state").write_bytes(b"\x01\x02" + utf(THREAD_STATES[0]) + b"\x00" * 5000)
    assert savepoint_mode(str(d)) == "thread"


def test_undecidable_savepoints_leave_the_choice_to_the_default(tmp_path: Path) -> None:
    # No ratchet state (a job that never wrote a key), both layouts, a process-mode name
    # without PyFlink's prefix, a name that only starts like ours, nothing there.
    assert savepoint_mode(str(savepoint(tmp_path / "a", b"other-state"))) is None
    both = savepoint(tmp_path / "b", process_name("ratchet-wake"), utf("ratchet-run-t"))
    assert savepoint_mode(str(both)) is None
    assert savepoint_mode(str(savepoint(tmp_path / "c", utf("ratchet-key")))) is None
    assert savepoint_mode(str(savepoint(tmp_path / "d", utf("ratchet-key-tx")))) is None
    assert savepoint_mode(str(tmp_path / "missing")) is None
    assert savepoint_mode("s3://bucket/savepoints/savepoint-1") is None
    assert local_path("hdfs://nn/sp") is None
    assert local_path("file:///tmp/a%20b") == Path("/tmp/a b")


def args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"execution_mode": None, "from_savepoint": None, "jobmanager": None}
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_default_is_thread_locally_and_process_on_a_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(MODE_ENV, raising=False)
    assert execution_mode(args()) == "thread"
    assert execution_mode(args(jobmanager="jm:8081")) == "process"
    assert execution_mode(args(execution_mode="process")) == "process"
    monkeypatch.setenv(MODE_ENV, "process")
    assert execution_mode(args()) == "process"
    assert execution_mode(args(execution_mode="thread")) == "thread"  # the flag wins


@pytest.mark.parametrize("taken", ["process", "thread"])
def test_a_savepoint_runs_in_its_mode_and_naming_the_other_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: str
) -> None:
    monkeypatch.delenv(MODE_ENV, raising=False)
    name = process_name("ratchet-key") if taken == "process" else utf("ratchet-key-t")
    sp = str(savepoint(tmp_path, name))
    other = "thread" if taken == "process" else "process"
    assert execution_mode(args(from_savepoint=sp)) == taken
    assert execution_mode(args(from_savepoint=sp, jobmanager="jm:8081")) == taken
    assert execution_mode(args(from_savepoint=sp, execution_mode=taken)) == taken
    with pytest.raises(ConfigError) as err:
        execution_mode(args(from_savepoint=sp, execution_mode=other))
    msg = str(err.value)
    assert f"taken in {taken} mode" in msg and f"--execution-mode {taken}" in msg, msg
    monkeypatch.setenv(MODE_ENV, other)
    with pytest.raises(ConfigError, match=MODE_ENV):
        execution_mode(args(from_savepoint=sp))


def test_input_files_the_savepoint_does_not_name_are_the_unread_ones(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    (inputs / "sub").mkdir(parents=True)
    for name in ("a.jsonl", "a.jsonl.bak", "b.jsonl", "sub/c.jsonl", ".hidden", "_skip"):
        (inputs / name).write_text("{}\n")
    a, c = inputs / "a.jsonl", inputs / "sub" / "c.jsonl"
    # Flink keeps each read file's URI (a length, then the text) in the source's state.
    d = savepoint(
        tmp_path, b"\x00\x00\x00N" + f"file:{a}".encode(), b"\x00\x01", f"file:{c}".encode()
    )
    unread = unread_inputs(str(d), str(inputs))
    assert unread == [inputs / "a.jsonl.bak", inputs / "b.jsonl"], unread
    assert unread_inputs(str(d), str(a)) == []  # a single file
    assert unread_inputs("s3://bucket/sp", str(inputs)) == []  # cannot tell: nothing refused


def restore_args(sp: Path, **kw: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "from_savepoint": str(sp), "follow": None, "jobmanager": None, "detach": False,
    }  # fmt: skip
    base.update(kw)
    return argparse.Namespace(**base)


def test_only_a_savepoint_that_ended_a_run_to_completion_restores_to_completion(
    tmp_path: Path,
) -> None:
    sp = savepoint(tmp_path, utf(THREAD_STATES[0]))
    # Not a local run to completion: nothing to check here.
    assert not _restores_to_completion(restore_args(sp, follow=500))
    assert not _restores_to_completion(restore_args(sp, jobmanager="jm:8081"))
    assert not _restores_to_completion(restore_args(sp, detach=True))
    with pytest.raises(ConfigError, match=MARKER):  # taken by a job that may re-read files
        _restores_to_completion(restore_args(sp))
    write_marker(str(sp), {"input": "in", "execution_mode": "thread", "drained": True})
    with pytest.raises(ConfigError, match="ended its job for good"):
        _restores_to_completion(restore_args(sp))
    write_marker(sp.as_uri(), {"input": "in", "execution_mode": "thread", "drained": False})
    assert read_marker(str(sp / "_metadata")) == {
        "input": "in", "execution_mode": "thread", "drained": False,
    }  # fmt: skip
    assert _restores_to_completion(restore_args(sp))


def test_a_restored_bounded_cluster_job_warns_of_files_it_will_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.jsonl").write_text("{}\n")
    sp = savepoint(tmp_path, f"file:{inputs / 'a.jsonl'}".encode() + b"\x00")
    ns = restore_args(sp, input=str(inputs), jobmanager="jm:8081")
    _warn_unread_inputs(ns)
    assert capsys.readouterr().err == ""  # every file is named
    (inputs / "b.jsonl").write_text("{}\n")
    _warn_unread_inputs(ns)
    err = capsys.readouterr().err
    assert "b.jsonl not named in the savepoint" in err and "--follow" in err, err
    for quiet in (restore_args(sp, input=str(inputs), jobmanager="jm:8081", follow=500),
                  restore_args(sp, input=str(inputs))):  # fmt: skip
        _warn_unread_inputs(quiet)  # watching, or a local run to completion (which reads it)
        assert capsys.readouterr().err == ""


def test_a_new_run_into_an_earlier_runs_outputs_is_refused_naming_what_continues_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    args = argparse.Namespace(
        output=str(out), from_savepoint=None, checkpoint_dir=None, jobmanager=None
    )
    _refuse_earlier_outputs(args)  # no folder yet
    out.mkdir()
    (out / ".part-1.inprogress").write_text("{}\n")  # not committed: not an output
    (out / "_progress").mkdir()
    (out / "_progress" / "part-0").write_text("{}\n")
    assert earlier_outputs(str(out)) == 0
    _refuse_earlier_outputs(args)
    (out / "part-0").write_text("{}\n")
    assert earlier_outputs(out.as_uri()) == 1 and earlier_outputs("s3://b/out") == 0
    with pytest.raises(ConfigError, match="no savepoint or retained checkpoint"):
        _refuse_earlier_outputs(args)
    # A kill left retained checkpoints (the newest is named), then a finished run a savepoint.
    chk = out / "_checkpoints" / "0f3a"
    for n in (3, 4):
        (chk / f"chk-{n}").mkdir(parents=True)
        (chk / f"chk-{n}" / "_metadata").write_bytes(b"m")
        time.sleep(0.01)
    (chk / "chk-5").mkdir()  # being written: no _metadata yet
    with pytest.raises(ConfigError, match=f"--from-savepoint {chk / 'chk-4'} --follow MS"):
        _refuse_earlier_outputs(args)
    sp = out / "_savepoints" / "savepoint-0f3a-1"
    sp.mkdir(parents=True)
    (sp / "_metadata").write_bytes(b"m")
    write_marker(str(sp), {"input": "in", "execution_mode": "thread", "drained": False})
    assert newest_restore_point([str(out / "_savepoints"), str(out / "_checkpoints")]) == sp
    with pytest.raises(ConfigError, match=f"--from-savepoint {sp}, or write to another"):
        _refuse_earlier_outputs(args)
    args.from_savepoint = str(sp)
    _refuse_earlier_outputs(args)  # continuing it: allowed
    # With --checkpoint-dir, its checkpoints are looked at (and its savepoints/ folder).
    elsewhere = tmp_path / "ck"
    (elsewhere / "9b" / "chk-9").mkdir(parents=True)
    (elsewhere / "9b" / "chk-9" / "_metadata").write_bytes(b"m")
    args = argparse.Namespace(
        output=str(out), from_savepoint=None, checkpoint_dir=str(elsewhere), jobmanager=None
    )
    with pytest.raises(ConfigError, match=f"--from-savepoint {elsewhere / '9b' / 'chk-9'} "):
        _refuse_earlier_outputs(args)


def _args(out: Path | str, checkpoint_dir: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        output=str(out),
        from_savepoint=None,
        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
        jobmanager=None,
    )


def _point(path: Path, marker: dict[str, object] | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "_metadata").write_bytes(b"m")
    if marker is not None:
        write_marker(str(path), marker)
    return path


def test_a_drained_savepoint_is_not_offered_as_a_way_to_continue(tmp_path: Path) -> None:
    """A `--memory-output` run's savepoint ended its job for good: it reads nothing new."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-0").write_text("{}\n")
    sp = _point(out / "_savepoints" / "savepoint-0f3a00-1", {"input": "in", "drained": True})
    with pytest.raises(ConfigError, match="ended that job for good") as info:
        _refuse_earlier_outputs(_args(out))
    assert f"--from-savepoint {sp}" not in str(info.value)


def test_only_the_restore_points_of_the_jobs_that_wrote_the_folder_are_named(
    tmp_path: Path,
) -> None:
    """Two runs share a --checkpoint-dir: each folder's refusal names its own job's."""
    ck = tmp_path / "ck"
    mine, theirs = "aaaaaa" + "0" * 26, "bbbbbb" + "1" * 26
    out = tmp_path / "out1"
    note_job(str(out), mine)
    (out / "part-0").write_text("{}\n")
    own_chk = _point(ck / mine / "chk-3")
    time.sleep(0.01)
    _point(ck / theirs / "chk-7")
    _point(ck / "savepoints" / f"savepoint-{theirs[:6]}-1", {"input": "in"})
    assert output_jobs(str(out)) == {mine}
    with pytest.raises(ConfigError, match=f"--from-savepoint {own_chk} --follow MS"):
        _refuse_earlier_outputs(_args(out, ck))
    own_sp = _point(ck / "savepoints" / f"savepoint-{mine[:6]}-2", {"input": "in"})
    with pytest.raises(ConfigError, match=f"--from-savepoint {own_sp}, or write"):
        _refuse_earlier_outputs(_args(out, ck))


def test_an_earlier_run_given_other_flags_is_still_found(tmp_path: Path) -> None:
    """The earlier run kept its savepoint in the output folder; this command adds
    --checkpoint-dir (and the other way round): both places are looked at."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-0").write_text("{}\n")
    sp = _point(out / "_savepoints" / "savepoint-cc0000-1", {"input": "in"})
    with pytest.raises(ConfigError, match=f"--from-savepoint {sp}, or write"):
        _refuse_earlier_outputs(_args(out, tmp_path / "ck"))
    out2 = tmp_path / "out2"
    out2.mkdir()
    (out2 / "part-0").write_text("{}\n")
    with pytest.raises(ConfigError, match="another --checkpoint-dir keeps them there"):
        _refuse_earlier_outputs(_args(out2))


def test_a_file_uri_output_is_its_local_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-0").write_text("{}\n")
    sp = _point(out / "_savepoints" / "savepoint-dd0000-1", {"input": "in"})
    with pytest.raises(ConfigError, match=f"--from-savepoint {sp}, or write"):
        _refuse_earlier_outputs(_args(out.as_uri()))
    args = _args(out.as_uri())
    assert _checkpoint_dir(args) == str(out / "_checkpoints")
    assert _savepoint_target(args) == str(out / "_savepoints")
    assert _checkpoint_dir(_args("s3://bucket/out")) is None


def test_equal_times_order_checkpoints_by_number_and_prefer_a_savepoint(tmp_path: Path) -> None:
    import os

    ck = tmp_path / "ck"
    points = [_point(ck / "job" / f"chk-{n}") for n in (9, 10, 2)]
    for p in points:
        os.utime(p / "_metadata", (1_000_000, 1_000_000))
    assert newest_restore_point([str(ck)]) == ck / "job" / "chk-10"
    sp = _point(tmp_path / "sp" / "savepoint-000000-1")
    os.utime(sp / "_metadata", (1_000_000, 1_000_000))
    assert newest_restore_point([str(ck), str(tmp_path / "sp")]) == sp


def test_counting_outputs_skips_hidden_folders_and_what_vanishes_or_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    out = tmp_path / "out"
    (out / "a" / "b").mkdir(parents=True)
    (out / "a" / "b" / "part-1").write_text("{}\n")
    (out / "part-0").write_text("{}\n")
    (out / "_checkpoints" / "job" / "chk-1").mkdir(parents=True)
    (out / "_checkpoints" / "job" / "chk-1" / "x").write_text("state")
    real_walk = os.walk
    entered: list[str] = []

    def walk(top: object, *a: object, **k: object) -> object:
        for here, dirs, files in real_walk(top, *a, **k):  # type: ignore[call-overload]
            entered.append(str(here))
            yield here, dirs, [*files, "vanished-part"]  # listed, gone before it is looked at

    monkeypatch.setattr(os, "walk", walk)
    assert earlier_outputs(str(out)) == 2
    assert not any("_checkpoints" in e for e in entered), entered


def test_a_second_local_run_into_a_folder_being_written_is_refused(tmp_path: Path) -> None:
    """The run writing into a folder holds it while it runs; a second one meanwhile is refused
    naming it, and once the first is gone (SIGKILL too) the folder is free again."""
    import signal
    import subprocess
    import sys

    from ratchet.cli import _flink

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time, argparse; from ratchet.cli._flink import _hold_output; "
         f"_hold_output(argparse.Namespace(output={str(out)!r}, jobmanager=None, detach=False));"
         " print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        args = argparse.Namespace(output=str(out), jobmanager=None, detach=False)
        with pytest.raises(ConfigError, match=f"another ratchet flink run \\(pid {holder.pid}\\)"):
            _flink._hold_output(args)
        # A cluster or detached job outlives its command: nothing is held for it.
        _flink._hold_output(argparse.Namespace(output=str(out), jobmanager="h:1", detach=False))
        _flink._hold_output(argparse.Namespace(output=str(out), jobmanager=None, detach=True))
        assert not _flink._held
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    _flink._hold_output(args)  # the killed run let go
    assert earlier_outputs(str(out)) == 0  # the lock file is not an output
    _flink._let_go()
    _flink._hold_output(args)  # and this process let go of its own
    _flink._let_go()


def test_a_stop_refused_because_the_job_failed_reports_the_jobs_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_a_refused_stop_reports_the_jobs_failure(monkeypatch, JobStatus)


def test_an_output_that_cannot_be_a_folder_is_refused_by_name(tmp_path: Path) -> None:
    from ratchet.cli import _flink

    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    args = argparse.Namespace(output=str(taken), jobmanager=None, detach=False)
    with pytest.raises(ConfigError, match="cannot be used as the output folder"):
        _flink._hold_output(args)
    assert not _flink._held


def test_an_output_folder_that_cannot_be_read_is_refused_not_taken_for_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root reads every folder here, so the walk is made to meet what another user would."""
    import os

    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    real_walk = os.walk

    def walk(top: object, onerror: object = None, **k: object) -> object:
        assert callable(onerror)
        onerror(PermissionError(13, "Permission denied", str(out / "sub")))
        yield from real_walk(top, **k)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "walk", walk)
    with pytest.raises(ConfigError, match="cannot be read"):
        earlier_outputs(str(out))
    monkeypatch.setattr(
        os, "walk", lambda top, onerror=None, **k: (onerror(FileNotFoundError(2, "gone")), [])[1]
    )
    assert earlier_outputs(str(out)) == 0  # a folder that vanished holds nothing
