"""A first start killed while it creates the state database must not fail every restart.

Before the fix, a SIGKILL between SQLite's switch to WAL mode and the commit of the tables
left a 4 KB database with no tables, refused forever as "not a ratchet state database", so a
supervised job ended as failed. Now the database is built in `ratchet.db.init` and renamed
into place, and an uninitialised database left by an older ratchet (no table at all, or only a
meta table without a schema_version record) is built again. A database that holds anything
else is never replaced: the usual checks refuse it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from ratchet import Agent, InputEvent, OutputEvent, StateError, action, run
from ratchet.store._sqlite import DB_NAME, SCHEMA_VERSION, SqliteStore

AGENT = f"{Path(__file__).parents[1] / 'kill' / 'kill_agent.py'}:KillAgent"
RATCHET = [sys.executable, "-m", "ratchet.cli"]


class Echo(Agent):
    @action(InputEvent, inline=True)
    def echo(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("n", ctx.short_term_memory.get("n", 0) + 1)
        ctx.send_event(OutputEvent(output=event.input))


# --- states an interrupted first start of an older ratchet left ----------------------------------

# Each script runs in a child process against `db` and ends with the child SIGKILLing itself,
# so SQLite's files are left exactly as a kill leaves them (-wal and -shm included).
_OLD_FIRST_START = """
    c = sqlite3.connect(db, isolation_level=None)
    c.execute("PRAGMA auto_vacuum=INCREMENTAL")
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("SELECT * FROM sqlite_master").fetchall()
"""
LEFT_BEHIND = {
    "empty file": None,
    "WAL-mode database with no tables": _OLD_FIRST_START,
    "killed inside the creating transaction": _OLD_FIRST_START
    + """
    c.execute("PRAGMA cache_size=1")  # spill uncommitted pages into the WAL
    c.execute("BEGIN IMMEDIATE")
    c.execute("CREATE TABLE meta(name TEXT PRIMARY KEY, value BLOB NOT NULL)")
    c.execute("CREATE TABLE keys(key BLOB PRIMARY KEY, memory BLOB)")
    for i in range(200):
        c.execute("INSERT INTO meta VALUES (?, ?)", (f"x{i}", bytes(2000)))
""",
    "only an empty meta table": _OLD_FIRST_START
    + """
    c.execute("CREATE TABLE meta(name TEXT PRIMARY KEY, value BLOB NOT NULL)")
""",
    "a meta table without schema_version": _OLD_FIRST_START
    + """
    c.execute("CREATE TABLE meta(name TEXT PRIMARY KEY, value BLOB NOT NULL)")
    c.execute("INSERT INTO meta VALUES ('agent_name', x'a3616263')")
""",
}


def leave_killed(db: Path, script: str | None) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    if script is None:
        db.write_bytes(b"")
        return
    code = "import os, signal, sqlite3, sys\ndb = sys.argv[1]\n" + textwrap.dedent(script)
    code += "os.kill(os.getpid(), signal.SIGKILL)\n"
    proc = subprocess.run([sys.executable, "-c", code, str(db)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def tables(db: Path) -> list[str]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master"))
    finally:
        conn.close()


@pytest.mark.parametrize("left", list(LEFT_BEHIND), ids=lambda s: s.replace(" ", "-"))
def test_an_uninitialised_database_is_initialised_and_used(tmp_path: Path, left: str) -> None:
    state = tmp_path / "s"
    db = state / DB_NAME
    leave_killed(db, LEFT_BEHIND[left])
    if left != "empty file":
        assert "keys_by_text" not in tables(db)  # what the old first start left: unusable

    inputs = [{"key": "a", "v": 1}, {"key": "b", "v": 2}, {"key": "a", "v": 3}]
    run(Echo(), inputs=inputs, output=tmp_path / "o.jsonl", state_dir=state)
    out = [json.loads(line)["output"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert out == inputs

    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # INCREMENTAL
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("SELECT COUNT(*) FROM keys").fetchone()[0] == 2
        assert conn.execute("SELECT name FROM meta WHERE name LIKE 'x%'").fetchall() == []
    finally:
        conn.close()
    assert not (state / (DB_NAME + ".init")).exists()
    # ... and it is ordinary state from now on: the next run resumes it.
    run(Echo(), inputs=inputs, output=tmp_path / "o.jsonl", state_dir=state)
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("rows", [1, 0], ids=["with-a-row", "empty"])
def test_a_database_with_any_other_table_is_refused_and_kept(tmp_path: Path, rows: int) -> None:
    db = tmp_path / "s" / DB_NAME
    db.parent.mkdir()
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE keys(key BLOB PRIMARY KEY, memory BLOB)")
    conn.executemany("INSERT INTO keys VALUES (?, ?)", [(b"k", b"memory")] * rows)
    conn.close()
    before = db.read_bytes()
    with pytest.raises(StateError, match=rf"{db} is not a ratchet state database .*no such table"):
        SqliteStore.open(tmp_path / "s", "agent", "fp", [])
    assert db.read_bytes() == before
    assert tables(db) == ["keys", "sqlite_autoindex_keys_1"]


def test_a_meta_table_that_is_not_ratchets_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "s" / DB_NAME
    db.parent.mkdir()
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("CREATE TABLE meta(k TEXT, v TEXT)")
    conn.execute("INSERT INTO meta VALUES ('owner', 'someone else')")
    conn.close()
    with pytest.raises(StateError, match="not a ratchet state database .*no such column"):
        SqliteStore.open(tmp_path / "s", "agent", "fp", [])
    assert tables(db) == ["meta"]


def test_a_wal_without_its_database_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "s"
    state.mkdir()
    (state / (DB_NAME + "-wal")).write_bytes(b"frames of a database that was removed")
    with pytest.raises(StateError, match=r"ratchet\.db-wal exists but its database .* is missing"):
        SqliteStore.open(state, "agent", "fp", [])
    assert not (state / DB_NAME).exists()
    assert (state / (DB_NAME + "-wal")).read_bytes() == b"frames of a database that was removed"


def test_leftovers_of_an_interrupted_build_are_removed(tmp_path: Path) -> None:
    state = tmp_path / "s"
    state.mkdir()
    (state / (DB_NAME + ".init")).write_bytes(b"half a database")
    (state / (DB_NAME + ".init-journal")).write_bytes(b"a hot journal of it")
    (state / (DB_NAME + "-shm")).write_bytes(b"\0" * 100)  # beside no database: nothing in it
    store = SqliteStore.open(state, "agent", "fp", ["act"])
    try:
        assert store.meta("schema_version") == SCHEMA_VERSION
        assert store.meta("actions") == ["act"]
    finally:
        store.close()
    assert sorted(p.name for p in state.iterdir() if "init" in p.name) == []


# --- real SIGKILLs during the first start ----------------------------------------------------------

N_INPUTS = 6


def _start(tmp: Path, state: Path, out: Path) -> subprocess.Popen[bytes]:
    with open(tmp / "stderr.log", "ab") as err:
        return subprocess.Popen(
            [*RATCHET, "run", AGENT, "--input", str(tmp / "in.jsonl")]
            + ["--output", str(out), "--state", str(state), "--checkpoint-interval", "5"],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _left(state: Path) -> str:
    """What a kill left in `state`, for the summary."""
    db = state / DB_NAME
    if not db.exists():
        return "build interrupted" if (state / (DB_NAME + ".init")).exists() else "no database"
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            n = conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return f"a database a reader cannot open yet ({exc})"
    return "database" if n else "database without tables"


@pytest.mark.kill
@pytest.mark.slow
def test_sigkills_during_the_first_start_never_leave_a_refused_state(tmp_path: Path) -> None:
    seed = int(os.environ.get("RATCHET_FIRST_START_SEED", random.randrange(2**32)))
    print(f"seed {seed} (set RATCHET_FIRST_START_SEED={seed} to replay)")
    rng = random.Random(seed)
    with (tmp_path / "in.jsonl").open("w") as fh:
        for i in range(N_INPUTS):
            fh.write(json.dumps({"key": f"k{i % 2}", "id": i, "value": i * 7}) + "\n")
    left: dict[str, int] = {}
    deadline = time.monotonic() + 10
    cycles = 0
    while time.monotonic() < deadline or cycles < 4:
        cycles += 1
        state, out = tmp_path / f"state{cycles}", tmp_path / f"out{cycles}.jsonl"
        proc = _start(tmp_path, state, out)
        # The state lock is taken just before the database is opened: kill 0-80 ms after it.
        lock_by = time.monotonic() + 30
        while not (state / "ratchet.lock").exists() and proc.poll() is None:
            assert time.monotonic() < lock_by, f"seed {seed}: no state lock after 30 s"
            time.sleep(0.0005)
        time.sleep(rng.uniform(0, 0.08))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        what = _left(state) if proc.returncode == -signal.SIGKILL else "finished before the kill"
        left[what] = left.get(what, 0) + 1

        again = _start(tmp_path, state, out)
        rc = again.wait(timeout=60)
        stderr = (tmp_path / "stderr.log").read_text()
        assert rc == 0, f"seed {seed}, cycle {cycles} (the kill left: {what}): {stderr[-2000:]}"
        outputs = [json.loads(line) for line in out.read_text().splitlines()]
        assert sorted(o["seq"] for o in outputs) == list(range(N_INPUTS)), (
            f"seed {seed}, cycle {cycles} (the kill left: {what}): outputs {outputs}"
        )
        assert len({o["id"] for o in outputs}) == N_INPUTS
        for o in outputs:
            assert o["output"] == {"value": o["seq"] * 7, "price": o["seq"] * 21 + 1}
    print(f"seed {seed}: {cycles} first starts killed; the kills left {left}")


# --- a database lost or truncated after the state has run ----------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("damage", ["truncated", "removed"])
def test_a_lost_database_of_a_state_that_has_run_is_refused(
    tmp_path: Path, damage: str, workers: int
) -> None:
    # It was taken for a first start: every input redone (durable calls repeated) and every
    # key's memory gone, exit 0. Every ratchet that writes job.json builds the database whole
    # before it, so an empty or missing database beside one was lost.
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"key": f"k{i % 3}", "value": i}) + "\n" for i in range(6))
    )
    argv = [*RATCHET, "run", AGENT, "--input", str(tmp_path / "in.jsonl"), "--output",
            str(tmp_path / "o.jsonl"), "--state", str(tmp_path / "st"), "--workers", str(workers)]  # fmt: skip
    first = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    dbs = sorted((tmp_path / "st").rglob(DB_NAME))
    assert len(dbs) == workers
    db = dbs[-1]
    for extra in (db.with_name(DB_NAME + "-wal"), db.with_name(DB_NAME + "-shm")):
        extra.unlink(missing_ok=True)
    if damage == "truncated":
        db.write_bytes(b"")
    else:
        db.unlink()
    outputs = (tmp_path / "o.jsonl").read_bytes()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2, (again.returncode, again.stderr)
    assert f"{db} is {'empty' if damage == 'truncated' else 'missing'}" in again.stderr
    assert "has run before" in again.stderr and "Traceback" not in again.stderr
    assert (tmp_path / "o.jsonl").read_bytes() == outputs
    assert (db.exists() and db.stat().st_size == 0) if damage == "truncated" else not db.exists()


# --- a shard of a sharded state lost, or a layout that names shards that are not there -------------


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job run to its end with --workers 2; each test damages its own copy."""
    base = tmp_path_factory.mktemp("sharded")
    (base / "in.jsonl").write_text(
        "".join(json.dumps({"key": f"k{i % 10}", "value": i}) + "\n" for i in range(40))
    )
    env = dict(os.environ, RATCHET_TEST_EXEC_LOG=str(base / "exec.log"))
    argv = [*RATCHET, "run", AGENT, "--input", str(base / "in.jsonl"), "--output",
            str(base / "o.jsonl"), "--state", str(base / "st"), "--workers", "2"]  # fmt: skip
    first = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 0, first.stderr
    assert {d.name for d in (base / "st" / "shards").iterdir() if d.is_dir()} == {
        "0-of-2",
        "1-of-2",
    }
    return base


def _layout(state: Path, workers: int | None) -> None:
    path = state / "shards" / "layout.json"
    if workers is None:
        path.unlink()
    else:
        path.write_text(json.dumps({"format": 1, "hash": "blake2b-64", "workers": workers}))


LOST_SHARD = {
    # A run made the shard afresh: its keys' inputs redone, every durable call repeated, exit 0.
    "shard directory removed": (lambda st: shutil.rmtree(st / "shards" / "1-of-2"),
                                "{st}/shards/1-of-2 is missing"),
    # Read commands showed the other shard's keys as all of them, exit 0.
    "shard database removed": (lambda st: (st / "shards" / "1-of-2" / DB_NAME).unlink(),
                               "{st}/shards/1-of-2/ratchet.db is missing"),
    # `run --workers 2` redid every input, then re-sharded over the shards that hold the work.
    "layout naming 4 workers": (lambda st: _layout(st, 4),
                                "{st}/shards/0-of-4, {st}/shards/1-of-4, {st}/shards/2-of-4 and "
                                "1 more are missing"),
    "layout removed": (lambda st: _layout(st, None), "{st}/shards/layout.json is missing"),
}  # fmt: skip


@pytest.mark.parametrize("damage", list(LOST_SHARD), ids=lambda s: s.replace(" ", "-"))
def test_a_sharded_state_missing_a_shard_is_refused_by_run_and_read_commands(
    sharded_run: Path, tmp_path: Path, damage: str
) -> None:
    state = tmp_path / "st"
    shutil.copytree(sharded_run / "st", state)
    shutil.copy(sharded_run / "o.jsonl", tmp_path / "o.jsonl")
    (tmp_path / "exec.log").write_bytes(calls := (sharded_run / "exec.log").read_bytes())
    hurt, said = LOST_SHARD[damage]
    hurt(state)
    said = said.format(st=state)
    files = sorted(str(p.relative_to(state)) for p in state.rglob("*") if "lock" not in p.name)
    outputs = (tmp_path / "o.jsonl").read_bytes()
    env = dict(os.environ, RATCHET_TEST_EXEC_LOG=str(tmp_path / "exec.log"))
    run_argv = [*RATCHET, "run", AGENT, "--input", str(sharded_run / "in.jsonl"), "--output",
                str(tmp_path / "o.jsonl"), "--state", str(state)]  # fmt: skip
    commands = [[*run_argv, "--workers", "2"], run_argv]
    if damage != "layout removed":  # then it reads as a state with no database, exit 2 too
        commands += [
            [*RATCHET, *cmd, "--state", str(state)]
            for cmd in (["status"], ["inspect"], ["dead-letters"], ["runs", "list"],
                        ["redrive", "--all"], ["trace", "--key", "k5"])
        ]  # fmt: skip
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for argv in commands
    ]
    for argv, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, (argv[3:], proc.returncode, out, err)
        assert said in err and "has run before" in err, (argv[3:], err)
        assert f"remove {state} and write to a new output" in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert (tmp_path / "exec.log").read_bytes() == calls  # no durable call repeated
    assert (tmp_path / "o.jsonl").read_bytes() == outputs
    assert sorted(str(p.relative_to(state)) for p in state.rglob("*") if "lock" not in p.name) == (
        files
    )


# --- a write-ahead log removed after a kill --------------------------------------------------------


def _killed_after_outputs(
    tmp_path: Path, n_outputs: int, workers: int = 1, keys: int = 4
) -> tuple[list[str], Path]:
    """A real job SIGKILLed once `n_outputs` outputs are in its file (0: before its first
    checkpoint): its committed work is in ratchet.db-wal (each shard's, with `workers`),
    which is left as the kill left it."""
    with (tmp_path / "in.jsonl").open("w") as fh:
        for i in range(400):
            fh.write(json.dumps({"key": f"k{i % keys}", "id": i, "value": i}) + "\n")
    out, state = tmp_path / "o.jsonl", tmp_path / "st"
    argv = [*RATCHET, "run", AGENT, "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
            "--state", str(state), "--checkpoint-interval", "20", "--workers", str(workers)]  # fmt: skip
    env = dict(os.environ, RATCHET_TEST_EXEC_LOG=str(tmp_path / "exec.log"))
    if n_outputs == 0:
        env["RATCHET_TEST_HOLD_AT"] = "1"  # the first execution blocks: no checkpoint yet
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the job ended before the kill"
            assert time.monotonic() < deadline, "no progress in 60 s"
            if n_outputs == 0 and (tmp_path / "exec.log").exists():
                break
            if n_outputs and out.exists() and out.read_bytes().count(b"\n") >= n_outputs:
                break
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)  # its workers die with it (PR_SET_PDEATHSIG)
        proc.wait()
    if workers == 1:
        assert (state / (DB_NAME + "-wal")).exists()
    return argv, state


def test_a_removed_write_ahead_log_after_outputs_is_refused(tmp_path: Path) -> None:
    # It was taken for a first start: every input redone and every durable call repeated,
    # exit 0 (the output file's dedup hid it). The main file held no checkpoint: all of them
    # were in the WAL.
    argv, state = _killed_after_outputs(tmp_path, 30)
    for name in (DB_NAME + "-wal", DB_NAME + "-shm"):
        (state / name).unlink()
    calls_before = (tmp_path / "exec.log").read_text()
    outputs = (tmp_path / "o.jsonl").read_bytes()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2, again.stderr
    assert "has no completed checkpoint, but --output" in again.stderr
    assert "ratchet.db-wal was removed" in again.stderr and "Traceback" not in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert (tmp_path / "exec.log").read_text() == calls_before  # nothing ran again
    assert (tmp_path / "o.jsonl").read_bytes() == outputs


def test_a_savepoint_of_a_state_that_lost_its_write_ahead_log_is_refused(tmp_path: Path) -> None:
    # `run` refused the state, but `savepoint` copied it (no checkpoint, 0 keys, exit 0), and
    # a run continued from that savepoint redid every input and repeated every durable call.
    argv, state = _killed_after_outputs(tmp_path, 30)
    for name in (DB_NAME + "-wal", DB_NAME + "-shm"):
        (state / name).unlink()
    sp = tmp_path / "sp.db"
    taken = subprocess.run(
        [*RATCHET, "savepoint", "--state", str(state), str(sp)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert taken.returncode == 2, (taken.stdout, taken.stderr)
    assert f"cannot take a savepoint of {state}: {state / DB_NAME} has no completed" in taken.stderr
    assert "ratchet.db-wal was removed" in taken.stderr and "Traceback" not in taken.stderr
    assert len(taken.stderr.strip().splitlines()) == 1, taken.stderr
    assert not sp.exists() and not list(tmp_path.glob(".sp.db.*"))


def test_a_savepoint_with_no_checkpoint_is_not_continued_past_the_jobs_outputs(
    tmp_path: Path,
) -> None:
    # Taken while the job ran, before its first checkpoint (allowed: the job is alive); the
    # job then released outputs. Continuing from the savepoint redid every input and repeated
    # every durable call, exit 0 (the output file dropped the repeated lines as duplicates).
    inp, out, state, sp = (tmp_path / x for x in ("in.jsonl", "o.jsonl", "st", "sp.db"))
    inp.write_text("")
    env = dict(os.environ, RATCHET_TEST_EXEC_LOG=str(tmp_path / "exec.log"))
    job = subprocess.Popen(
        [*RATCHET, "run", AGENT, "--input", str(inp), "--output", str(out), "--state",
         str(state), "--follow", "--checkpoint-interval", "60000"],
        env=env, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (state / "job.json").exists():  # its database is built before its job file
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.01)
        taken = subprocess.run(
            [*RATCHET, "savepoint", "--state", str(state), str(sp), "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert taken.returncode == 0, taken.stderr
        assert json.loads(taken.stdout)["checkpoint_id"] is None
        inp.write_text(
            "".join(json.dumps({"key": f"k{i % 3}", "value": i}) + "\n" for i in range(9))
        )
        while not out.exists() or not out.read_bytes():  # the first output's checkpoint
            assert job.poll() is None and time.monotonic() < deadline, "no outputs"
            time.sleep(0.01)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    calls = (tmp_path / "exec.log").read_bytes()
    outputs = out.read_bytes()
    for workers in ("1", "2"):
        again = subprocess.run(
            [*RATCHET, "run", AGENT, "--input", str(inp), "--output", str(out), "--state",
             str(tmp_path / f"restored{workers}"), "--from-savepoint", str(sp), "--workers",
             workers],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert again.returncode == 2, again.stderr
        last = again.stderr.strip().splitlines()[-1]
        assert "was restored from a savepoint of" in last, again.stderr
        assert "holds no completed checkpoint, but --output" in last, again.stderr
        assert "Traceback" not in again.stderr
        assert (tmp_path / "exec.log").read_bytes() == calls  # nothing ran again
        assert out.read_bytes() == outputs


def _shard_of_key(state: Path, key: str) -> Path:
    from ratchet.runtime._shards import read_layout, shard_of

    dirs = read_layout(state).dirs
    return dirs[shard_of(key, len(dirs))]


def test_a_removed_write_ahead_log_of_one_shard_is_refused(tmp_path: Path) -> None:
    # With --workers 2 the shard's own state was taken for a first start: its keys' inputs
    # redone and their durable calls repeated, exit 0 (the coordinator's output file
    # dropped the repeated outputs as duplicates, hiding it).
    argv, state = _killed_after_outputs(tmp_path, 60, workers=2)
    shard = _shard_of_key(state, "k1")
    assert (shard / (DB_NAME + "-wal")).exists()
    for name in (DB_NAME + "-wal", DB_NAME + "-shm"):
        (shard / name).unlink()
    store = SqliteStore.open_readonly(shard)
    try:  # all of its history was in the log
        assert store.stats()["counts"]["completed"] == 0
    finally:
        store.close()
    calls_before = (tmp_path / "exec.log").read_text()
    outputs = (tmp_path / "o.jsonl").read_bytes()
    assert any(json.loads(line)["id"].startswith("k1:") for line in outputs.decode().splitlines())
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2, again.stderr
    assert f"{shard / DB_NAME} has no completed checkpoint, but --output" in again.stderr
    assert f"remove {state} and write" in again.stderr and "Traceback" not in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert (tmp_path / "exec.log").read_text() == calls_before  # nothing ran again
    assert (tmp_path / "o.jsonl").read_bytes() == outputs


def test_a_removed_log_of_a_shard_that_had_no_work_resumes(tmp_path: Path) -> None:
    # One key: the other shard never had work, so it released nothing, and losing its log
    # loses nothing; the job goes on to every output, once.
    argv, state = _killed_after_outputs(tmp_path, 60, workers=2, keys=1)
    busy = _shard_of_key(state, "k0")
    (idle,) = [d for d in state.joinpath("shards").iterdir() if d.is_dir() and d != busy]
    for name in (DB_NAME + "-wal", DB_NAME + "-shm"):
        (idle / name).unlink(missing_ok=True)
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    ids = [json.loads(line)["id"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 400


def test_the_wal_merged_by_another_sqlite_client_resumes(tmp_path: Path) -> None:
    # The sqlite3 shell (or Python's module) opening the killed state merges the WAL into
    # ratchet.db and removes it as it closes: nothing is lost, and the job resumes.
    argv, state = _killed_after_outputs(tmp_path, 30)
    conn = sqlite3.connect(state / DB_NAME)
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    conn.close()
    assert not (state / (DB_NAME + "-wal")).exists()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    ids = [json.loads(line)["id"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 400


def test_a_removed_log_of_a_job_killed_before_its_first_checkpoint_starts_over(
    tmp_path: Path,
) -> None:
    # Nothing was committed, no output released: starting over loses nothing.
    argv, state = _killed_after_outputs(tmp_path, 0)
    for name in (DB_NAME + "-wal", DB_NAME + "-shm"):
        (state / name).unlink(missing_ok=True)
    again = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 400
