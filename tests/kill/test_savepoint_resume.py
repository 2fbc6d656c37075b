"""`ratchet run --from-savepoint` run again after a SIGKILL, or after a refusal: it resumes.

Claims checked, with real `ratchet run` processes:
- a job restored from a savepoint and SIGKILLed is continued by the same command (the state
  it restored is resumed, not restored again: one stderr line says so), and no durable call
  whose result was recorded before the kill is made again, nor any task journaled then;
- the continued job ends with every input's output exactly once in its output file and the
  memory of a crash-free run;
- a `--from-savepoint` run refused after its restore (another input, another job's output,
  another agent) is continued by the corrected command the same way;
- `--from-savepoint` into a directory holding anything else is refused (exit 2, one line)
  without advice to empty a directory that holds a job's state.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ratchet._errors import EXIT_OK, EXIT_USAGE
from support.shard_state import committed

pytestmark = [pytest.mark.kill, pytest.mark.slow]  # about 14 s: make test-slow

AGENT = f"{Path(__file__).with_name('kill_agent.py')}:KillAgent"
OTHER_AGENT = f"{Path(__file__).parents[1] / 'runtime/savepoint_support/counter_agent.py'}:Counter"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
N_INPUTS, KEYS, HOLD_AT, SLACK = 600, 8, 300, 16
RESUMING = "already holds savepoint"


def write_inputs(path: Path) -> None:
    with path.open("w") as fh:
        for i in range(N_INPUTS):
            fh.write(json.dumps({"key": f"k{i % KEYS}", "id": i, "value": (i * 7) % 101}) + "\n")


def run_argv(
    inp: Path, out: Path, state: Path, *extra: str | Path, agent: str = AGENT
) -> list[str]:
    return [*RATCHET, "run", agent, "--input", str(inp), "--output", str(out), "--state",
            str(state), "--checkpoint-interval", "20", *map(str, extra)]  # fmt: skip


def log_lines(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [line.split() for line in log.read_text().splitlines() if line]


def latest_checkpoint(state: Path) -> int:
    db = state / "ratchet.db"
    if not db.exists():
        return -1
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT MAX(id) FROM checkpoints").fetchone()
    except sqlite3.Error:
        return -1
    finally:
        conn.close()
    return -1 if row[0] is None else int(row[0])


def run_held_then_kill(argv: list[str], log: Path, state: Path, err: Path) -> None:
    """Run `argv` with every execution past HOLD_AT log lines held, wait until its checkpoints
    stop coming, SIGKILL it."""
    env = dict(os.environ, RATCHET_TEST_EXEC_LOG=str(log), RATCHET_TEST_HOLD_AT=str(HOLD_AT))
    with err.open("ab") as errfh:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=errfh)
    try:
        deadline = time.monotonic() + 90
        while len(log_lines(log)) < HOLD_AT:
            assert proc.poll() is None, f"the job ended before the hold: {err.read_text()}"
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.01)
        # Calls that returned before the hold reach the state at a checkpoint (on a loaded
        # machine that can take a while); there may be none for runs still in flight (a run
        # that completed drops its records), so this waits a while, not for ever.
        recorded_by = min(deadline, time.monotonic() + 10)
        while not committed(state, KEYS)[2] and time.monotonic() < recorded_by:
            assert proc.poll() is None, f"the job ended while held: {err.read_text()}"
            time.sleep(0.05)
        # Held, the job commits nothing more: once no checkpoint has come for 50 intervals,
        # the last one holds all it will commit (the claims read the state, not this wait).
        seen, since = latest_checkpoint(state), time.monotonic()
        while time.monotonic() - since < 1.0:
            assert proc.poll() is None, f"the job ended while held: {err.read_text()}"
            if (now := latest_checkpoint(state)) != seen:
                seen, since = now, time.monotonic()
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def ratchet(argv: list[str], log: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if log is not None:
        env["RATCHET_TEST_EXEC_LOG"] = str(log)
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=240, check=False)


def inspect(state: Path) -> dict[str, Any]:
    proc = ratchet([*RATCHET, "inspect", "--state", str(state), "--json"])
    assert proc.returncode == EXIT_OK, proc.stderr
    memory: dict[str, Any] = json.loads(proc.stdout)
    return memory


def assert_exactly_once(out: Path) -> None:
    outputs = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [o["id"] for o in outputs]
    assert len(ids) == len(set(ids)), "an output was written twice"
    assert sorted(o["seq"] for o in outputs) == list(range(N_INPUTS)), "an output is missing"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A job SIGKILLed with runs in flight, its savepoint, and a crash-free run's memory."""
    tmp = tmp_path_factory.mktemp("base")
    inp, out, state = tmp / "in.jsonl", tmp / "out.jsonl", tmp / "state"
    write_inputs(inp)
    run_held_then_kill(run_argv(inp, out, state), tmp / "base.log", state, tmp / "base.err")
    sp = tmp / "sp.db"
    taken = ratchet([*RATCHET, "savepoint", "--state", str(state), str(sp), "--json"])
    assert taken.returncode == EXIT_OK, taken.stderr
    assert json.loads(taken.stdout)["in_flight_runs"] >= 1, "no run was in flight in the savepoint"
    ref = ratchet(run_argv(inp, tmp / "ref.jsonl", tmp / "ref"))
    assert ref.returncode == EXIT_OK, ref.stderr
    return {"tmp": tmp, "input": inp, "output": out, "state": state, "sp": sp,
            "reference": inspect(tmp / "ref")}  # fmt: skip


def test_the_same_command_resumes_a_killed_restore_and_repeats_no_recorded_call(
    base: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(base["output"].read_bytes())  # the job's output file: the restore dedupes
    state, log = tmp_path / "restored", tmp_path / "exec.log"
    argv = run_argv(base["input"], out, state, "--from-savepoint", base["sp"])
    run_held_then_kill(argv, log, state, tmp_path / "err.log")
    upto = len(log_lines(log))
    _done, journaled, recorded = committed(state, KEYS)  # (recorded may be empty: see above)

    again = ratchet(argv, log)  # the same command

    assert again.returncode == EXIT_OK, again.stderr
    assert "Traceback" not in again.stderr
    said = [line for line in again.stderr.splitlines() if RESUMING in line]
    assert said == [
        f"ratchet: {state} already holds savepoint {base['sp']}, restored by an earlier run: "
        "resuming it (not restored again; a new --state restores anew)"
    ], again.stderr
    lines = log_lines(log)
    # A call logged before the log reached HOLD_AT lines returned (the hold blocks only the
    # executions that find HOLD_AT lines; SLACK covers lines written concurrently meanwhile).
    returned = {(int(p[2]), p[3]) for p in lines[: HOLD_AT - SLACK] if p[1] == "call"}
    started = {(int(p[2]), p[3]) for p in lines[:upto] if p[1] == "call"}
    calls_after = [(int(p[2]), p[3]) for p in lines[upto:] if p[1] == "call"]
    ran_again = [(int(p[2]), p[3]) for p in lines[upto:] if p[1] == "exec"]
    print(
        f"before the kill: {len(started)} durable calls started, {len(returned)} surely "
        f"returned, {len(recorded)} recorded for runs in flight; after: {len(calls_after)} "
        f"calls, {len([c for c in calls_after if c in started])} of those started before"
    )
    assert [c for c in calls_after if c in returned] == [], "a returned call was made again"
    assert [c for c in calls_after if c in recorded] == [], "a recorded call was made again"
    assert [t for t in ran_again if t in journaled] == [], "a journaled task ran again"
    assert_exactly_once(out)
    assert inspect(state) == base["reference"]


@pytest.mark.parametrize("mistake", ["input", "output", "agent"])
def test_a_refused_restore_is_continued_by_the_corrected_command(
    base: dict[str, Any], tmp_path: Path, mistake: str
) -> None:
    state, out = tmp_path / "restored", tmp_path / "out.jsonl"
    out.write_bytes(base["output"].read_bytes())
    inp: Path = base["input"]
    wrong_in, wrong_out, agent = inp, out, AGENT
    if mistake == "input":
        wrong_in = tmp_path / "other.jsonl"
        wrong_in.write_text(inp.read_text().splitlines()[0] + "\n")
    elif mistake == "output":
        wrong_out = tmp_path / "other-job.jsonl"
        wrong_out.write_text(
            json.dumps({"id": "x", "job": "another", "seq": 0, "output": {}}) + "\n"
        )
    else:
        agent = OTHER_AGENT
    sp = base["sp"]
    refused = ratchet(run_argv(wrong_in, wrong_out, state, "--from-savepoint", sp, agent=agent))
    assert refused.returncode == EXIT_USAGE, refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr
    assert (state / "ratchet.db").exists(), "the refused run left no restore: adapt this test"

    again = ratchet(run_argv(inp, out, state, "--from-savepoint", sp))

    assert again.returncode == EXIT_OK, again.stderr
    assert RESUMING in again.stderr, again.stderr
    assert_exactly_once(out)
    assert inspect(state) == base["reference"]


def test_the_same_command_resumes_a_restore_sharded_since(
    base: dict[str, Any], tmp_path: Path
) -> None:
    """--workers 2 re-shards the restored state (its top database goes): still recognised."""
    out, state = tmp_path / "out.jsonl", tmp_path / "restored"
    out.write_bytes(base["output"].read_bytes())
    argv = run_argv(base["input"], out, state, "--from-savepoint", base["sp"], "--workers", "2")
    first = ratchet(argv)
    assert first.returncode == EXIT_OK, first.stderr
    assert (state / "shards" / "layout.json").exists() and not (state / "ratchet.db").exists()
    written = out.read_bytes()

    again = ratchet(argv)

    assert again.returncode == EXIT_OK, again.stderr
    assert RESUMING in again.stderr, again.stderr
    assert out.read_bytes() == written, "the resumed job wrote outputs again"
    assert_exactly_once(out)


def refusal(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == EXIT_USAGE, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ratchet: error: "), proc.stderr
    return lines[0]


def test_from_savepoint_into_anything_else_is_refused_without_advice_to_empty_it(
    base: dict[str, Any], tmp_path: Path
) -> None:
    sp, inp = base["sp"], base["input"]
    out = tmp_path / "out.jsonl"

    def attempt(state: Path, savepoint: Path = sp) -> str:
        return refusal(ratchet(run_argv(inp, out, state, "--from-savepoint", savepoint)))

    # The state the savepoint was taken of: never restored, it holds the job's committed work.
    line = attempt(base["state"])
    assert "never restored from a savepoint" in line, line
    assert "without --from-savepoint" in line and "a new --state directory" in line, line
    assert f"empty {base['state']}" not in line, line

    # A state restored from another savepoint of the same job.
    other_sp = tmp_path / "sp2.db"
    taken = ratchet([*RATCHET, "savepoint", "--state", str(base["state"]), str(other_sp)])
    assert taken.returncode == EXIT_OK, taken.stderr
    restored = tmp_path / "restored"
    first = ratchet(run_argv(inp, out, restored, "--from-savepoint", other_sp))
    assert first.returncode == EXIT_OK, first.stderr
    line = attempt(restored)
    assert f"restored from another savepoint (of {base['state']}" in line, line
    assert f"not from {sp}" in line and "without --from-savepoint" in line, line
    assert f"empty {restored}" not in line, line

    # A directory holding no ratchet state may be emptied; it is left as it is.
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    line = attempt(junk)
    assert f"or empty {junk} first (it holds no ratchet state)" in line, line
    assert [p.name for p in junk.iterdir()] == ["notes.txt"]
