"""Savepoints, the checkpoint listing and forks, on real SQLite files with real processes.

Claims checked:
- a SIGKILL at any moment of `ratchet savepoint` leaves no file at PATH or a whole, valid
  savepoint, and the next `ratchet savepoint` to that PATH succeeds (a killed attempt's
  leftovers never block it);
- a savepoint taken while a job processes a growing stream holds a consistent state (each
  key's memory counts exactly the inputs below the checkpointed source position that are not
  still queued or in flight in it) and, restored into a new state directory, continues the
  same job to the memory of a clean single run, with every input's output exactly once in
  the job's output file;
- a fork (all keys, or one, also taken while the job runs) is a new job that runs on, and
  holds no row of a key it was not asked for;
- `ratchet checkpoints` says which checkpoint is restorable and lists the savepoints;
- refusals are exit 2 with one line naming the thing and the fix, and create nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ratchet._errors import EXIT_OK, EXIT_USAGE, StateError
from ratchet.runtime._savepoints import read_savepoint, restore_savepoint
from ratchet.store import codec

AGENT = f"{Path(__file__).parent / 'savepoint_support' / 'counter_agent.py'}:Counter"
RATCHET = [sys.executable, "-m", "ratchet.cli"]


# -- helpers ---------------------------------------------------------------------------------------


def ratchet(
    *args: str | Path, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [*RATCHET, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    if check:
        assert proc.returncode == EXIT_OK, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def assert_refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ratchet: error: "), lines[0]
    for word in words:
        assert word in lines[0], lines[0]


def rows(start: int, stop: int, keys: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"key": f"k{i % keys}", "v": i, **extra} for i in range(start, stop)]


def append(path: Path, items: list[dict[str, Any]]) -> None:
    with path.open("a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in items))  # whole lines, one write


def run_job(
    inp: Path,
    out: Path,
    state: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    argv = ["run", AGENT, "--input", inp, "--output", out, "--state", state, *extra]
    return ratchet(*argv, env=env, check=check)


def inspect(state: Path) -> dict[str, Any]:
    memory: dict[str, Any] = json.loads(ratchet("inspect", "--state", state, "--json").stdout)
    return memory


def read_outputs(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def job_of(state: Path) -> str:
    job: str = json.loads((state / "job.json").read_text())["job"]
    return job


def db_state(db: Path) -> dict[str, Any]:
    """What a ratchet database holds, read directly: source position, input keys by seq, run
    seqs, memory keys, meta records."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        meta = {n: codec.decode(v) for n, v in conn.execute("SELECT name, value FROM meta")}
        return {
            "meta": meta,
            "next_seq": int(meta["source"].get("next_seq", 0)),
            "inputs": {s: codec.decode(k) for s, k in conn.execute("SELECT seq, key FROM inputs")},
            "runs": {s for (s,) in conn.execute("SELECT seq FROM runs")},
            "keys": sorted(codec.decode(k) for (k,) in conn.execute("SELECT key FROM keys")),
            "integrity": conn.execute("PRAGMA integrity_check").fetchone()[0],
        }
    finally:
        conn.close()


def expected_counts(
    all_rows: list[dict[str, Any]], next_seq: int, pending: set[int]
) -> dict[str, int]:
    """Per key, the inputs a consistent state has counted: read (seq below the checkpointed
    position) and not still queued or in flight."""
    counts: dict[str, int] = {}
    for seq in range(next_seq):
        if seq not in pending:
            key = all_rows[seq]["key"]
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A job that ran to the end of 30 inputs over 3 keys (several checkpoints)."""
    tmp = tmp_path_factory.mktemp("finished")
    inp, state = tmp / "in.jsonl", tmp / "state"
    append(inp, rows(0, 30, 3))
    run_job(inp, tmp / "out.jsonl", state, "--checkpoint-interval", "0")
    return {"tmp": tmp, "input": inp, "state": state, "memory": inspect(state)}


# -- SIGKILL during a savepoint --------------------------------------------------------------------


def _staging(directory: Path, target: Path) -> list[str]:
    """The staging files or directories beside `target` (`.NAME.KIND-*.tmp`)."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(f".{target.name}."))


def _killed_after(argv: list[str], target: Path, delay: float | None) -> tuple[bool, float]:
    """Start `argv`; once its staging file or directory beside `target` exists, wait `delay`
    seconds and SIGKILL it (None: let it finish). Whether it was killed, and how long the
    staging phase lasted when it was not (the window kills aim at; a measure, never asserted)."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and not _staging(target.parent, target):
            assert time.monotonic() < deadline, f"{argv[2:4]} never started its copy"
            time.sleep(0.0005)
        seen = time.monotonic()
        if delay is None:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err.decode()
            return False, time.monotonic() - seen
        time.sleep(delay)
        killed = proc.poll() is None
        if killed:
            proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        return killed, 0.0
    finally:
        if proc.poll() is None:  # a failed assertion above: leave no process behind
            proc.kill()
            proc.communicate()


def _savepoint_argv(state: Path, target: Path) -> list[str]:
    return [*RATCHET, "savepoint", "--state", str(state), str(target)]


def _assert_whole(path: Path, job: str, keys: int, why: str) -> None:
    """`path` is a complete savepoint of the job: intact, one file, every key, its record."""
    got = db_state(path)
    assert got["integrity"] == "ok", why
    assert len(got["keys"]) == keys, why
    record = got["meta"]["savepoint"]
    assert record["format"] == 1 and record["job"] == job, why
    assert record["checkpoint_id"] is not None, why
    for sidecar in ("-journal", "-wal", "-shm"):
        assert not Path(f"{path}{sidecar}").exists(), f"{why}: {sidecar} beside the savepoint"
    assert read_savepoint(path)["counts"]["keys"] == keys, why


def _assert_whole_state(state: Path, keys: int, job: str | None, why: str) -> None:
    """`state` is a complete state directory: intact database, every key, a job file."""
    got = db_state(state / "ratchet.db")
    assert got["integrity"] == "ok", why
    assert len(got["keys"]) == keys, why
    ident = job_of(state)
    assert ident == job if job is not None else len(ident) == 16, why


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A finished job whose state is big enough (~50 MB) for a copy to take a while."""
    tmp = tmp_path_factory.mktemp("big")
    keys = 4000
    inp, state = tmp / "big.jsonl", tmp / "state"
    append(inp, [{"key": f"b{i}", "v": i, "pad": 12_000} for i in range(keys)])
    run_job(inp, tmp / "out.jsonl", state)
    return {"state": state, "keys": keys, "job": job_of(state)}


@pytest.mark.kill
@pytest.mark.slow
def test_a_sigkill_during_a_savepoint_leaves_no_file_or_a_whole_one(
    big: dict[str, Any], tmp_path: Path
) -> None:
    seed = 20261207
    rng = random.Random(seed)
    state, keys, job = big["state"], big["keys"], big["job"]
    where = tmp_path / "savepoints"
    where.mkdir()
    target = where / "sp.db"

    # The copy phase of an uninterrupted savepoint, measured once: the kills aim inside it.
    _, window = _killed_after(_savepoint_argv(state, target), target, None)
    _assert_whole(target, job, keys, f"seed {seed}: the uninterrupted savepoint")
    target.unlink()

    outcomes = []
    for attempt in range(8):
        delay = rng.uniform(0, window)
        why = f"seed {seed}, attempt {attempt}, kill {delay * 1000:.1f} ms into the copy"
        killed, _ = _killed_after(_savepoint_argv(state, target), target, delay)
        leftovers = _staging(where, target)
        if target.exists():
            _assert_whole(target, job, keys, why)  # complete before the kill, or not killed
            refused = ratchet("savepoint", "--state", state, target, check=False)
            assert_refused(refused, f"{target} exists", "sp-2.db")
            target.unlink()
        outcomes.append((killed, bool(leftovers)))
        # A new savepoint to the same path succeeds; it clears what the killed one left.
        again = ratchet("savepoint", "--state", state, target, check=False)
        assert again.returncode == 0, f"{why}: {again.stderr}"
        _assert_whole(target, job, keys, f"{why}, then again")
        assert _staging(where, target) == [], f"{why}: leftovers stayed: {leftovers}"
        target.unlink()
    print(f"seed {seed}: (killed, left a staging file) per attempt: {outcomes}")


@pytest.mark.kill
@pytest.mark.slow
def test_a_sigkill_during_a_restore_or_a_fork_leaves_no_state_or_a_whole_one(
    big: dict[str, Any], tmp_path: Path
) -> None:
    seed = 20261208
    rng = random.Random(seed)
    state, keys, job = big["state"], big["keys"], big["job"]
    sp = tmp_path / "sp.db"
    ratchet("savepoint", "--state", state, sp)
    restore = [sys.executable, "-c", RESTORE, str(sp)]
    cases = [
        ("restore", lambda t: [*restore, str(t)], keys, job),
        ("fork", lambda t: [*RATCHET, "fork", "--state", str(state), "--to", str(t)], keys, None),
        (
            "fork --key",
            lambda t: [*RATCHET, "fork", "--state", str(state), "--to", str(t), "--key", "b7"],
            1,
            None,
        ),
    ]
    outcomes = []
    for name, argv, want_keys, want_job in cases:
        target = tmp_path / name.replace(" ", "") / "state"
        _, window = _killed_after(argv(target), target, None)
        _assert_whole_state(target, want_keys, want_job, f"seed {seed}: {name}, uninterrupted")
        shutil.rmtree(target)
        for attempt in range(3):
            delay = rng.uniform(0, window)
            why = f"seed {seed}: {name}, attempt {attempt}, kill {delay * 1000:.1f} ms in"
            killed, _ = _killed_after(argv(target), target, delay)
            leftovers = _staging(target.parent, target)
            if target.exists():
                _assert_whole_state(target, want_keys, want_job, why)
                shutil.rmtree(target)
            outcomes.append((name, killed, bool(leftovers)))
            again = subprocess.run(argv(target), capture_output=True, text=True, timeout=120)
            assert again.returncode == 0, f"{why}: {again.stderr}"
            _assert_whole_state(target, want_keys, want_job, f"{why}, then again")
            assert _staging(target.parent, target) == [], f"{why}: leftovers stayed"
            shutil.rmtree(target)
    print(f"seed {seed}: (what, killed, left a staging directory): {outcomes}")


RESTORE = (
    "import sys\n"
    "from ratchet.runtime._savepoints import restore_savepoint\n"
    "restore_savepoint(sys.argv[1], sys.argv[2])\n"
)


def test_a_killed_attempts_leftovers_are_removed_and_a_live_ones_are_not(
    finished: dict[str, Any], tmp_path: Path
) -> None:
    target = tmp_path / "sp.db"
    stale = tmp_path / ".sp.db.savepoint-00aa.tmp"  # nobody holds it: a killed attempt's
    stale.write_bytes(b"half a copy")
    Path(f"{stale}-journal").write_bytes(b"its journal")
    orphan = tmp_path / ".sp.db.savepoint-00bb.tmp-journal"  # a journal whose copy is gone
    orphan.write_bytes(b"journal")
    live = tmp_path / ".sp.db.savepoint-00cc.tmp"  # locked: another attempt, still running
    fd = os.open(live, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        ratchet("savepoint", "--state", finished["state"], target)
        assert _staging(tmp_path, target) == [live.name]
    finally:
        os.close(fd)
    assert read_savepoint(target)["job"] == job_of(finished["state"])


# -- a savepoint under load ------------------------------------------------------------------------


def _wait_for(what: str, cond: Any, proc: subprocess.Popen[bytes], err: Path) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        assert proc.poll() is None, f"the job died while waiting for {what}: {err.read_text()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {err.read_text()}"
        time.sleep(0.01)


@pytest.mark.kill
def test_a_savepoint_taken_under_load_restores_to_the_same_job_and_a_clean_runs_memory(
    tmp_path: Path,
) -> None:
    keys, gated = 5, 150  # input 150 (key k0) waits for the gate file
    all_rows = rows(0, 50_000, keys)  # more than the feeder gets to
    all_rows[gated]["gate"] = True
    inp, out, state, err = (tmp_path / x for x in ("in.jsonl", "out.jsonl", "state", "err.log"))
    inp.write_text("")
    gate = tmp_path / "gate"
    env = dict(os.environ, RATCHET_TEST_GATE=str(gate))
    with err.open("wb") as errfh:
        job = subprocess.Popen(
            [*RATCHET, "run", AGENT, "--input", str(inp), "--output", str(out), "--state",
             str(state), "--follow", "--checkpoint-interval", "20"],
            env=env, stdout=subprocess.DEVNULL, stderr=errfh,
        )  # fmt: skip
    written = 300
    try:
        append(inp, all_rows[:written])

        # Hold k0's run of input 150 in flight, with k0's later inputs queued behind it, in a
        # completed checkpoint: the savepoint is then sure to catch a run half done.
        def held() -> bool:
            if not (state / "ratchet.db").exists():
                return False
            got = db_state(state / "ratchet.db")
            return gated in got["runs"] and any(
                s > gated and k == "k0" for s, k in got["inputs"].items()
            )

        _wait_for("the gated run in a checkpoint", held, job, err)

        stop = threading.Event()

        def stream() -> None:  # input keeps coming while the savepoint and the fork are taken
            nonlocal written
            while not stop.is_set() and written + 5 <= len(all_rows):
                append(inp, all_rows[written : written + 5])
                written += 5
                time.sleep(0.01)

        feeder = threading.Thread(target=stream)
        feeder.start()
        try:
            sp = tmp_path / "sp.db"
            taken = json.loads(ratchet("savepoint", "--state", state, sp, "--json").stdout)
            forked = json.loads(
                ratchet("fork", "--state", state, "--to", tmp_path / "fork", "--key", "k1",
                        "--json").stdout
            )  # fmt: skip
            assert feeder.is_alive(), "the input stopped before the savepoint and fork were taken"
            assert job.poll() is None, "the job stopped while the savepoint was taken"
        finally:
            stop.set()
            feeder.join()
        live = written
        gate.touch()
        # Let the job release outputs past the savepoint, then kill it: the restored job must
        # not write those again, nor lose the ones it had not released.
        _wait_for("outputs past the savepoint", lambda: len(read_lines(out)) >= live - 20, job, err)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    n = live + 100
    append(inp, all_rows[live:n])  # and more after the job is gone
    all_rows = all_rows[:n]
    source_job = job_of(state)

    # The savepoint is consistent: memory counts exactly the inputs it no longer holds.
    saved = db_state(sp)
    assert taken["job"] == source_job and saved["meta"]["savepoint"]["job"] == source_job
    assert taken["checkpoint_id"] == saved["meta"]["next_checkpoint_id"] - 1, taken
    assert gated in saved["runs"], "the held run was not in flight in the savepoint"
    assert taken["in_flight_runs"] >= 1 and taken["queued_inputs"] >= 1, taken
    restored = tmp_path / "restored"
    restored.mkdir()  # an empty directory is accepted too
    record = restore_savepoint(sp, restored)
    assert record["job"] == source_job == job_of(restored)
    at_savepoint = inspect(restored)
    pending = set(saved["inputs"])
    want = expected_counts(all_rows, saved["next_seq"], pending)
    assert {k: m["count"] for k, m in at_savepoint.items()} == want
    for key, memory in at_savepoint.items():
        counted = [
            r["v"]
            for s, r in enumerate(all_rows[: saved["next_seq"]])
            if r["key"] == key and s not in pending
        ]
        assert memory["sum"] == sum(counted), key

    # Restored, the same job runs to the end: a clean run's memory, every output exactly once.
    run_job(inp, out, restored, env=env)
    reference = tmp_path / "ref"
    run_job(inp, tmp_path / "ref.jsonl", reference, env=env)
    clean = inspect(reference)
    assert inspect(restored) == clean
    outputs = read_outputs(out)
    ids = [o["id"] for o in outputs]
    assert len(ids) == len(set(ids)), "an output was written twice"
    assert sorted(o["seq"] for o in outputs) == list(range(n)), "an output is missing"
    assert {o["job"] for o in outputs} == {source_job}

    # The fork of k1, taken under load too: only k1's rows, a new job, and it runs on.
    fork = tmp_path / "fork"
    fork_db = db_state(fork / "ratchet.db")
    assert forked["job"] == job_of(fork) != source_job
    assert fork_db["keys"] == ["k1"]
    assert set(fork_db["inputs"].values()) <= {"k1"}
    fork_pending = set(fork_db["inputs"])
    want_k1 = expected_counts(all_rows, fork_db["next_seq"], fork_pending).get("k1", 0)
    assert inspect(fork)["k1"]["count"] == want_k1
    run_job(inp, tmp_path / "fork.jsonl", fork, env=env)  # a new job: a new output file
    ran_on = inspect(fork)
    assert ran_on["k1"] == clean["k1"], "k1 did not continue where the fork took it"
    for key in ("k0", "k2", "k3", "k4"):  # inputs read after the fork start these keys anew
        fresh = [r for r in all_rows[fork_db["next_seq"] :] if r["key"] == key]
        assert ran_on[key]["count"] == len(fresh), key
    fork_outputs = read_outputs(tmp_path / "fork.jsonl")
    assert {o["job"] for o in fork_outputs} == {forked["job"]}
    got = [o["seq"] for o in fork_outputs]
    assert len(got) == len(set(got)), "the fork wrote an output twice"
    assert set(range(fork_db["next_seq"], n)) | fork_pending <= set(got)


def read_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [x for x in path.read_text().splitlines() if x.endswith("}")]


# -- the checkpoint listing ------------------------------------------------------------------------


def test_checkpoints_lists_the_restorable_one_the_history_and_the_savepoints(
    tmp_path: Path,
) -> None:
    inp, state = tmp_path / "in.jsonl", tmp_path / "state"
    append(inp, rows(0, 40, 4))
    run_job(inp, tmp_path / "out.jsonl", state, "--checkpoint-interval", "0")

    before = json.loads(ratchet("checkpoints", "--state", state, "--json").stdout)
    ids = [c["id"] for c in before["checkpoints"]]
    assert ids and ids == sorted(ids)
    assert before["restorable_checkpoint"] == ids[-1]
    assert [c["restorable"] for c in before["checkpoints"]] == [c == ids[-1] for c in ids]
    assert all(c["time"].endswith("Z") for c in before["checkpoints"])
    assert before["job"] == job_of(state) and before["savepoints"] == []
    assert "only the latest completed checkpoint is restorable" in before["note"]
    text = ratchet("checkpoints", "--state", state).stdout
    assert f"only the latest completed checkpoint, #{ids[-1]}, is restorable" in text
    assert "the earlier rows are history" in text and "savepoints: 0" in text

    sp = tmp_path / "keep" / "before-v2.db"  # its directory is created
    taken = json.loads(ratchet("savepoint", "--state", state, sp, "--json").stdout)
    assert taken["checkpoint_id"] == ids[-1] and taken["keys"] == 4 and taken["logged"]
    after = json.loads(ratchet("checkpoints", "--state", state, "--json").stdout)
    [listed] = after["savepoints"]
    assert listed["path"] == str(sp.resolve()) and listed["exists"] is True
    assert listed["checkpoint_id"] == ids[-1] and listed["job"] == job_of(state)
    assert listed["size_bytes"] == sp.stat().st_size
    text = ratchet("checkpoints", "--state", state).stdout
    assert "savepoints: 1" in text and f"{sp.resolve()}  taken " in text and "present" in text
    plain = ratchet("savepoint", "--state", state, tmp_path / "plain.db").stdout
    assert f"savepoint written: {(tmp_path / 'plain.db').resolve()}" in plain
    assert f"checkpoint #{ids[-1]} of job {job_of(state)}" in plain and "4 key(s)" in plain

    # A line cut by a kill is skipped, and the next savepoint's line starts on its own line.
    sp.unlink()
    with (state / "savepoints.jsonl").open("a") as fh:
        fh.write('{"path": "/cut/by/a/ki')
    ratchet("savepoint", "--state", state, tmp_path / "third.db")
    last = json.loads(ratchet("checkpoints", "--state", state, "--json").stdout)
    assert [s["exists"] for s in last["savepoints"]] == [False, True, True]
    assert last["unreadable_savepoint_lines"] == 1
    text = ratchet("checkpoints", "--state", state).stdout
    assert "missing (the file is gone)" in text and "1 unreadable line(s)" in text


# -- forks -----------------------------------------------------------------------------------------


def _own_input(finished: dict[str, Any], tmp_path: Path) -> Path:
    """A copy of the finished job's input (accepted as the same bytes) to append to."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(finished["input"].read_bytes())
    return inp


def test_a_fork_of_all_keys_is_a_new_job_that_runs_on(
    finished: dict[str, Any], tmp_path: Path
) -> None:
    state, memory = finished["state"], finished["memory"]
    fork = tmp_path / "fork"
    text = ratchet("fork", "--state", state, "--to", fork).stdout
    assert f"forked {state.resolve()} into {fork.resolve()}: all keys" in text
    assert job_of(fork) != job_of(state) and f"new job {job_of(fork)}" in text
    assert inspect(fork) == memory

    inp = _own_input(finished, tmp_path)
    append(inp, rows(30, 39, 3))
    # A different job: the original's output file is refused, a new one is written.
    shared = run_job(inp, finished["tmp"] / "out.jsonl", fork, check=False)
    assert_refused(shared, "holds", "--append-output")
    run_job(inp, tmp_path / "fork.jsonl", fork)
    outputs = read_outputs(tmp_path / "fork.jsonl")
    assert sorted(o["seq"] for o in outputs) == list(range(30, 39))
    assert {o["job"] for o in outputs} == {job_of(fork)}
    ran_on = inspect(fork)
    assert {k: m["count"] for k, m in ran_on.items()} == {
        k: m["count"] + 3 for k, m in memory.items()
    }
    assert inspect(state) == memory  # the source is untouched


def test_a_fork_of_one_key_holds_no_row_of_the_others(
    finished: dict[str, Any], tmp_path: Path
) -> None:
    state, memory = finished["state"], finished["memory"]
    fork = tmp_path / "fork"
    forked = json.loads(
        ratchet("fork", "--state", state, "--to", fork, "--key", "k1", "--json").stdout
    )
    assert forked["selected_keys"] == ["k1"] and forked["keys_with_memory"] == ["k1"]
    assert forked["removed_rows"]["keys"] == 2
    assert inspect(fork) == {"k1": memory["k1"]}
    assert db_state(fork / "ratchet.db")["meta"]["forked_from"]["keys"] == ["k1"]

    inp = _own_input(finished, tmp_path)
    append(inp, rows(30, 39, 3))
    run_job(inp, tmp_path / "fork.jsonl", fork)
    ran_on = inspect(fork)
    assert ran_on["k1"]["count"] == memory["k1"]["count"] + 3
    assert ran_on["k0"]["count"] == ran_on["k2"]["count"] == 3  # new to the fork


# -- refusals --------------------------------------------------------------------------------------


def test_savepoint_and_fork_refusals_are_exit_2_naming_the_fix(
    finished: dict[str, Any], tmp_path: Path
) -> None:
    state = finished["state"]
    taken = tmp_path / "sp.db"
    taken.write_text("not mine")
    assert_refused(
        ratchet("savepoint", "--state", state, taken, check=False),
        f"{taken} exists",
        "choose a new path",
        str(tmp_path / "sp-2.db"),
    )
    assert taken.read_text() == "not mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_refused(
        ratchet("savepoint", "--state", empty, tmp_path / "x.db", check=False),
        f"no ratchet state in {empty}",
    )
    assert not (tmp_path / "x.db").exists()

    assert_refused(
        ratchet("fork", "--state", state, "--to", tmp_path / "f", "--key", "k9", check=False),
        "--key 'k9': no such key",
        "'k0', 'k1', 'k2'",
        f"ratchet inspect --state {state}",
    )
    assert not (tmp_path / "f").exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    assert_refused(
        ratchet("fork", "--state", state, "--to", full, check=False),
        f"{full} is not empty",
        "new directory",
    )
    assert sorted(p.name for p in full.iterdir()) == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_restore_refuses_what_is_not_a_whole_savepoint_and_a_used_directory(
    finished: dict[str, Any], tmp_path: Path
) -> None:
    state = finished["state"]
    target = tmp_path / "restored"
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a database\n" * 100)
    with pytest.raises(StateError, match="is not a ratchet savepoint"):
        restore_savepoint(text, target)
    with pytest.raises(StateError, match="not a savepoint .*no 'savepoint' record"):
        restore_savepoint(state / "ratchet.db", target)
    with pytest.raises(StateError, match="does not exist"):
        restore_savepoint(tmp_path / "missing.db", target)
    sp = tmp_path / "sp.db"
    ratchet("savepoint", "--state", state, sp)
    cut = tmp_path / "cut.db"
    cut.write_bytes(sp.read_bytes()[: sp.stat().st_size // 2])  # a copy cut short
    with pytest.raises(StateError, match=str(cut)):
        restore_savepoint(cut, target)
    assert not target.exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "ratchet.db").write_text("")
    with pytest.raises(StateError, match=f"{used} is not empty"):
        restore_savepoint(sp, used)
    assert [p.name for p in used.iterdir()] == ["ratchet.db"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    record = restore_savepoint(sp, target)
    assert record["job"] == job_of(state) == job_of(target)
    assert inspect(target) == finished["memory"]


def test_a_savepoint_path_that_names_a_directory_or_nothing_is_exit_2_naming_the_fix(
    finished: dict[str, Any], tmp_path: Path
) -> None:
    state = finished["state"]
    here = tmp_path / "here"
    here.mkdir()
    for path, words in (
        (".", (". is a directory", "a savepoint is one file", "e.g. savepoint.db")),
        ("/", ("/ is a directory", "e.g. /savepoint.db")),
        ("", ("the savepoint PATH is empty", "e.g. savepoint.db")),
    ):
        proc = subprocess.run(
            [*RATCHET, "savepoint", "--state", str(state), path],
            capture_output=True, text=True, timeout=120, cwd=here, check=False,
        )  # fmt: skip
        assert_refused(proc, *words)
    assert list(here.iterdir()) == []
    (state / "savepoint.db").touch()  # the example never names a file that exists
    try:
        assert_refused(
            ratchet("savepoint", "--state", state, state, check=False),
            f"{state} is a directory",
            f"e.g. {state / 'savepoint-2.db'}",
        )
    finally:
        (state / "savepoint.db").unlink()


def test_a_restore_into_its_own_earlier_restore_is_resumed_and_never_advised_away(
    finished: dict[str, Any], tmp_path: Path
) -> None:
    from ratchet.runtime._savepoints import restore_or_resume

    sp, target = tmp_path / "sp.db", tmp_path / "restored"
    ratchet("savepoint", "--state", finished["state"], sp)
    assert restore_or_resume(sp, target)["resumed"] is False
    before = (target / "ratchet.db").read_bytes()
    again = restore_or_resume(sp, target)
    assert again["resumed"] is True and again["job"] == job_of(target)
    assert (target / "ratchet.db").read_bytes() == before, "the restore was done again"
    # The library call, which never resumes, refuses without advice to empty it.
    with pytest.raises(StateError, match=f"it holds job .*, restored from {sp} before") as info:
        restore_savepoint(sp, target)
    assert f"empty {target}" not in str(info.value)
    # A savepoint taken of the restored state is another savepoint.
    sp2 = tmp_path / "sp2.db"
    ratchet("savepoint", "--state", target, sp2)
    with pytest.raises(StateError, match=f"restored from another savepoint .*, not from {sp2}"):
        restore_or_resume(sp2, target)


def test_a_restore_or_fork_into_the_current_directory_is_exit_2_and_writes_nothing(
    finished: dict[str, Any], tmp_path: Path
) -> None:
    sp = tmp_path / "sp.db"
    ratchet("savepoint", "--state", finished["state"], sp)
    here = tmp_path / "here"
    here.mkdir()
    for argv, flag in (
        (["run", AGENT, "--input", str(finished["input"]), "--output", str(tmp_path / "o.jsonl"),
          "--state", ".", "--from-savepoint", str(sp)], "--state"),
        (["fork", "--state", str(finished["state"]), "--to", "."], "--to"),
    ):  # fmt: skip
        proc = subprocess.run(
            [*RATCHET, *argv], capture_output=True, text=True, timeout=120, cwd=here, check=False
        )
        assert_refused(proc, f"{flag} . is the current directory", f"e.g. {flag} {here / 'state'}")
    assert list(here.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_missing_savepoint_names_the_resume_of_the_state_it_was_restored_into(
    finished: dict[str, Any], tmp_path: Path
) -> None:
    sp, state = tmp_path / "sp.db", tmp_path / "restored"
    ratchet("savepoint", "--state", finished["state"], sp)
    restore_savepoint(sp, state)
    sp.unlink()
    assert_refused(
        run_job(finished["input"], tmp_path / "o.jsonl", state, "--from-savepoint", sp,
                check=False),
        f"savepoint {sp} does not exist",
        f"to resume the state in {state} as it is, run without --from-savepoint",
    )  # fmt: skip
