"""A full or failing disk under the state is not a damaged state.

Before the fix, restarting a job while the disk holding its state was still full said the
database was damaged and to restore it from a backup (SQLite's raw error from the restore's
COMMIT reached the CLI, which called every sqlite3 error damage; opening the database on a
disk that could not take its `-shm` file said "corrupted"), and a checkpoint that failed on
a full disk said only "restart". A restore throws committed work away; the disk needed room.
Now the store says it (`StateWriteError`, one line naming the state directory and the fix),
and the job's failure says to free space (or check the disk) before the same command.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ratchet
from ratchet import Agent, InputEvent, OutputEvent, StateError, StateWriteError, action
from ratchet._errors import EXIT_OK, EXIT_USAGE
from ratchet.cli import main
from ratchet.store import _sqlite
from ratchet.store._files import resume_after
from ratchet.store._sqlite import SqliteStore

RATCHET = [sys.executable, "-m", "ratchet.cli"]
AGENT = '''
from ratchet import Agent, InputEvent, OutputEvent, action

class Big(Agent):
    """Call records of 3 KB: the state grows much faster than the output."""

    @action(InputEvent)
    async def go(self, event, ctx):
        value = await ctx.durable_execute_async(lambda: "y" * 3000)
        ctx.send_event(OutputEvent(output=len(value)))
'''


class Echo(Agent):
    @action(InputEvent, inline=True)
    def echo(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output=event.input))


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def _disk_error(name: str, message: str) -> sqlite3.OperationalError:
    """A sqlite3 error as the module raises it for `name` (it sets these two attributes)."""
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorcode = {"SQLITE_FULL": 13, "SQLITE_IOERR_WRITE": 778}[name]
    exc.sqlite_errorname = name
    return exc


class _FailingCommit(sqlite3.Connection):
    """A real connection whose COMMIT raises `fail` (once set): a disk that fills up then."""

    fail: sqlite3.Error | None = None

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:  # type: ignore[override]
        if sql == "COMMIT" and self.fail is not None:
            raise self.fail
        return super().execute(sql, *args)


@pytest.mark.parametrize(
    ("name", "message", "words"),
    [
        ("SQLITE_FULL", "database or disk is full", ["is full", "free space there"]),
        ("SQLITE_IOERR_WRITE", "disk I/O error", ["could not be written", "ulimit -f"]),
    ],
)
def test_a_restart_whose_restore_cannot_be_written_is_a_state_write_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, message: str, words: list[str]
) -> None:
    """The reviewer's case: `record_restore`'s COMMIT fails on a full disk at a restart."""
    state = tmp_path / "state"
    out = tmp_path / "out.jsonl"
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"key": f"k{i}"}) + "\n" for i in range(5)))
    ratchet.run(Echo(), inputs=src, output=out, state_dir=state)
    with src.open("a") as fh:
        fh.write("".join(json.dumps({"key": f"k{i}"}) + "\n" for i in range(5, 8)))
    before = (state / _sqlite.DB_NAME).read_bytes()

    def connect(path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=30, factory=_FailingCommit
        )
        return conn

    record_restore = SqliteStore.record_restore

    def full_at_restore(self: SqliteStore) -> dict[str, Any] | None:
        self.conn.fail = _disk_error(name, message)  # type: ignore[attr-defined]
        return record_restore(self)

    monkeypatch.setattr(_sqlite, "_connect", connect)
    monkeypatch.setattr(SqliteStore, "record_restore", full_at_restore)
    with pytest.raises(StateWriteError) as caught:
        ratchet.run(Echo(), inputs=src, output=out, state_dir=state)
    err = caught.value
    assert isinstance(err, StateError)
    assert err.state_dir == str(state)
    assert err.disk_full is (name == "SQLITE_FULL")
    assert isinstance(err.__cause__, sqlite3.OperationalError)
    text = str(err)
    for word in [f"state directory {state}", message, "run the same command again", *words]:
        assert word in text, text
    assert "damaged" not in text and "backup" not in text, text
    assert (state / _sqlite.DB_NAME).read_bytes() == before  # the failed write changed nothing

    monkeypatch.undo()  # the disk has room again: the same call resumes, every output once
    ratchet.run(Echo(), inputs=src, output=out, state_dir=state)
    ids = _ids(out)
    assert len(ids) == 8 == len(set(ids))


def _limited(limit: int | None) -> Any:
    if limit is None:
        return None
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_the_cli_says_the_disk_not_damage_and_the_same_command_resumes(tmp_path: Path) -> None:
    """Real `ratchet run` processes under a file size limit (RLIMIT_FSIZE: writes past it
    fail, as on a full disk; Python ignores SIGXFSZ): during the job, then at its restart
    (opening the database cannot size its `-shm` file), then with the limit lifted."""
    (tmp_path / "agent.py").write_text(AGENT)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"key": f"k{i}"}) + "\n" for i in range(120)))
    argv = [*RATCHET, "run", "agent.py:Big", "--input", "in.jsonl", "--output", "out.jsonl"]
    argv += ["--state", "st"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))

    def ratchet_run(limit: int | None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
            preexec_fn=_limited(limit),  # noqa: PLW1509 - no threads in the child before exec
        )  # fmt: skip

    for limit, then in [(96 << 10, "then run the same command"), (8 << 10, "run the same")]:
        proc = ratchet_run(limit)
        assert proc.returncode == EXIT_USAGE, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ratchet: error: ")]
        assert len(errors) == 1, proc.stderr
        line = errors[0]
        assert "state directory st " in line, line
        assert "could not be" in line or "is full" in line, line
        assert "ulimit -f" in line or "free space" in line, line
        assert then in line and "nothing committed is lost" in line, line
        assert "damaged" not in line and "corrupted" not in line and "backup" not in line, line

    proc = ratchet_run(None)
    assert proc.returncode == EXIT_OK, proc.stderr
    ids = _ids(tmp_path / "out.jsonl")
    assert len(ids) == 120 == len(set(ids))


@pytest.mark.parametrize(
    ("exc", "fix"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "free space on the disk holding"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "free space on the disk holding"),
        (OSError(errno.EFBIG, "File too large", "st/x"), "free space on the disk holding st/x"),
        (OSError(errno.EIO, "Input/output error"), "ulimit -f"),
        (_disk_error("SQLITE_FULL", "database or disk is full"), "free space"),
        (_disk_error("SQLITE_IOERR_WRITE", "disk I/O error"), "ulimit -f"),
    ],
)
def test_a_job_stopped_by_a_full_or_failing_disk_says_what_to_fix_first(
    exc: BaseException, fix: str
) -> None:
    what, then = resume_after(exc)
    assert str(exc) in what
    assert fix in then and "run the same command to resume from it" in then


def test_any_other_failed_write_still_says_restart() -> None:
    assert resume_after(RuntimeError("boom")) == ("RuntimeError: boom", "restart to resume from it")


def test_a_raw_disk_error_reaching_the_cli_is_not_called_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the store does not translate (a read needing its `-shm` file, say) still is not
    damage at the CLI; a malformed database still is (test_cli_errors)."""
    state = tmp_path / "state"
    ratchet.run(Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=state)

    def failing(self: SqliteStore) -> dict[str, Any]:
        raise _disk_error("SQLITE_IOERR_WRITE", "disk I/O error")

    monkeypatch.setattr(SqliteStore, "summary", failing)
    assert main(["status", "--state", str(state)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"ratchet: error: the state directory {state} could not be used ("), err
    assert "ulimit -f" in err and "damaged" not in err, err
