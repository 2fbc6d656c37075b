"""`ratchet run --workers N`: real coordinator and worker processes, real SQLite shards, SIGKILL.

Claims checked (each against a single-process run of the same input without kills):
- every input's output is in the sink exactly once, with the same ids a single process gives;
- the committed memory of every key is the same;
- nothing a killed process had committed (a completed input, a journaled task, a recorded
  durable call) runs again;
- a killed worker is restarted while the other keeps running (same pid throughout);
- the number of workers can change between runs (1 -> 2 -> 3 -> 1), also after a kill.

Kill moments come from a seeded RNG; the seed is printed, and RATCHET_SHARD_SEED replays it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ratchet.runtime._multiproc import PIDS_FILE
from ratchet.runtime._shards import read_layout, shard_of
from support.shard_state import committed, workers_gone

pytestmark = pytest.mark.kill

AGENT = f"{Path(__file__).with_name('kill_agent.py')}:KillAgent"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
N_INPUTS = 400
KEYS = 32


def _seed(default: int) -> int:
    seed = int(os.environ.get("RATCHET_SHARD_SEED") or default)
    print(f"seed {seed} (replay: RATCHET_SHARD_SEED={seed})")
    return seed


def write_inputs(path: Path, lo: int, hi: int) -> None:
    with path.open("a") as fh:
        for i in range(lo, hi):
            fh.write(json.dumps({"key": f"k{i % KEYS}", "id": i, "value": (i * 7) % 101}) + "\n")


def start(
    tmp: Path,
    inp: Path,
    state: Path,
    out: Path,
    workers: int,
    niced: bool = False,
    summary: Path | None = None,
    hold_at: int = 0,
) -> subprocess.Popen[bytes]:
    """`niced`: the job runs at a lower priority than this test, whose loop watching the
    executions to kill at a chosen one must not be starved on a busy 2-core machine (CI once
    saw a whole run end before the loop noticed 10 executions). `hold_at`: every execution
    after the log holds that many lines blocks until the kill (kill_agent.py)."""
    env = dict(os.environ, RATCHET_TEST_EXEC_LOG=str(tmp / "exec.log"))
    if hold_at:
        env["RATCHET_TEST_HOLD_AT"] = str(hold_at)
    with open(tmp / "stderr.log", "ab") as err, open(summary or os.devnull, "wb") as stdout:
        return subprocess.Popen(
            [
                *(["nice", "-n", "10"] if niced else []),
                *RATCHET, "run", AGENT, "--input", str(inp), "--output", str(out),
                "--state", str(state), "--checkpoint-interval", "20",
                "--max-concurrent-runs", "16", "--workers", str(workers),
                *(["--json"] if summary is not None else []),
            ],
            env=env, stdout=stdout, stderr=err,
        )  # fmt: skip


def log_lines(tmp: Path) -> list[list[str]]:
    log = tmp / "exec.log"
    if not log.exists():
        return []
    return [line.split() for line in log.read_text().splitlines() if line]


def inspect(state: Path) -> dict[str, Any]:
    out = subprocess.run(
        [*RATCHET, "inspect", "--state", str(state), "--json"], check=True, capture_output=True
    )
    return dict(json.loads(out.stdout))


def check_outputs(out: Path, n: int, seed: int) -> None:
    outputs = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [o["id"] for o in outputs]
    assert len(ids) == len(set(ids)), f"seed {seed}: duplicated outputs"
    assert sorted(o["seq"] for o in outputs) == list(range(n)), f"seed {seed}: lost outputs"
    for o in outputs:
        assert o["output"]["price"] == o["output"]["value"] * 3 + 1
        assert o["id"].startswith(f"k{o['seq'] % KEYS}:{o['seq']}:")  # single-process ids


def check_not_rerun(tmp: Path, checks: list[Any], seed: int) -> None:
    lines = log_lines(tmp)
    for upto, done, journaled, recorded in checks:
        for parts in lines[upto:]:
            kind, seq, task = parts[1], int(parts[2]), parts[3]
            assert seq not in done, f"seed {seed}: input {seq} re-ran {task} after its commit"
            if kind == "exec":
                assert (seq, task) not in journaled, f"seed {seed}: {seq}/{task} ran again"
            else:
                assert (seq, task) not in recorded, f"seed {seed}: call {seq}/{task} again"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A single-process run without kills: the memory every sharded run must end with."""
    ref = tmp_path_factory.mktemp("ref")
    write_inputs(ref / "in.jsonl", 0, N_INPUTS)
    proc = start(ref, ref / "in.jsonl", ref / "state", ref / "out.jsonl", 1)
    assert proc.wait(timeout=120) == 0, (ref / "stderr.log").read_text()
    return inspect(ref / "state")


def run_to_end(tmp: Path, inp: Path, state: Path, out: Path, workers: int) -> None:
    proc = start(tmp, inp, state, out, workers)
    assert proc.wait(timeout=120) == 0, (tmp / "stderr.log").read_text()


def test_two_workers_give_single_process_outputs_and_memory(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    write_inputs(tmp_path / "in.jsonl", 0, N_INPUTS)
    state, out = tmp_path / "state", tmp_path / "out.jsonl"
    run_to_end(tmp_path, tmp_path / "in.jsonl", state, out, 2)
    check_outputs(out, N_INPUTS, 0)
    assert inspect(state) == reference
    assert sorted(p.name for p in (state / "shards").iterdir()) == [
        "0-of-2", "1-of-2", "layout.json", PIDS_FILE,
    ]  # fmt: skip
    status = subprocess.run(
        [*RATCHET, "status", "--state", str(state), "--json"], check=True, capture_output=True
    )
    summary = json.loads(status.stdout)
    assert summary["workers"] == 2
    assert summary["keys"] == KEYS
    assert summary["source"] == {"0-of-2": N_INPUTS, "1-of-2": N_INPUTS}
    letters = subprocess.run(
        [*RATCHET, "dead-letters", "--state", str(state), "--json"], capture_output=True, text=True
    )
    assert letters.returncode == 0 and json.loads(letters.stdout) == [], letters.stderr


def test_coordinator_sigkilled_at_random_moments(tmp_path: Path, reference: dict[str, Any]) -> None:
    seed = _seed(20261202)
    rng = random.Random(seed)
    write_inputs(tmp_path / "in.jsonl", 0, N_INPUTS)
    state, out = tmp_path / "state", tmp_path / "out.jsonl"
    kills = 0
    checks: list[Any] = []
    for _cycle in range(60):
        before = len(log_lines(tmp_path))
        proc = start(tmp_path, tmp_path / "in.jsonl", state, out, 2)
        target = before + rng.randint(5, 400)
        # Or a moment from the start, whichever comes first: a fast run (a quiet machine, a
        # cheaper coordinator) must not finish before the kills land.
        kill_by = time.monotonic() + rng.uniform(0.3, 1.5)
        deadline = time.monotonic() + 60
        while (
            proc.poll() is None and len(log_lines(tmp_path)) < target and time.monotonic() < kill_by
        ):
            assert time.monotonic() < deadline, f"seed {seed}: no progress"
            time.sleep(0.005)
        if proc.poll() is None:
            time.sleep(rng.uniform(0, 0.05))
        if proc.poll() is None and kills < 6:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            workers_gone(state)
            checks.append((len(log_lines(tmp_path)), *committed(state, KEYS)))
            continue
        assert proc.wait(timeout=120) == 0, f"seed {seed}: {(tmp_path / 'stderr.log').read_text()}"
        break
    assert kills >= 3, f"seed {seed}: only {kills} kills before the job finished"
    check_outputs(out, N_INPUTS, seed)
    check_not_rerun(tmp_path, checks, seed)
    assert inspect(state) == reference, f"seed {seed}: memory differs from a run without kills"
    print(f"seed {seed}: {kills} coordinator SIGKILLs survived")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_worker_restarts_while_the_other_keeps_running(
    tmp_path: Path, reference: dict[str, Any], sig: signal.Signals
) -> None:
    """SIGTERM too: a worker stopped by a signal sent to it alone takes its final
    checkpoint and is restarted (it reported itself done, and its shard's remaining inputs
    were dropped: a bounded job exited 0 with a third of its outputs missing)."""
    seed = _seed(5)
    rng = random.Random(seed)
    write_inputs(tmp_path / "in.jsonl", 0, N_INPUTS)
    state, out = tmp_path / "state", tmp_path / "out.jsonl"
    proc = start(tmp_path, tmp_path / "in.jsonl", state, out, 2, summary=tmp_path / "sum.json")
    target = rng.randint(100, 700)
    deadline = time.monotonic() + 60
    while len(log_lines(tmp_path)) < target:
        assert proc.poll() is None and time.monotonic() < deadline, "finished before the kill"
        time.sleep(0.005)
    pids = json.loads((state / "shards" / PIDS_FILE).read_text())["workers"]
    # Both first workers were forked from the coordinator (its command line, not a new
    # interpreter's); the restart below is a new interpreter.
    own = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    for pid in pids.values():
        assert Path(f"/proc/{pid}/cmdline").read_bytes() == own, "not a forked worker"
    os.kill(int(pids["0"]), sig)
    # The other worker commits on meanwhile: what is done is read before the lines are
    # counted, so a line after the count that repeats it is a real re-run.
    snapshot = committed(state, KEYS)
    checks = [(len(log_lines(tmp_path)), *snapshot)]
    assert proc.wait(timeout=120) == 0, (tmp_path / "stderr.log").read_text()
    check_outputs(out, N_INPUTS, seed)
    check_not_rerun(tmp_path, checks, seed)
    assert inspect(state) == reference
    by_shard: dict[int, set[str]] = {0: set(), 1: set()}
    for parts in log_lines(tmp_path):
        by_shard[shard_of(f"k{int(parts[2]) % KEYS}", 2)].add(parts[0])
    assert by_shard[1] == {str(pids["1"])}, "the worker that was not killed was restarted"
    assert len(by_shard[0]) == 2, f"shard 0 ran in {by_shard[0]}: not killed and restarted once"
    after = json.loads((state / "shards" / PIDS_FILE).read_text())["workers"]
    assert after["1"] == pids["1"] and after["0"] != pids["0"]
    if sig == signal.SIGTERM:  # what the stopped worker did counts (its result was lost)
        assert json.loads((tmp_path / "sum.json").read_text())["outputs"] == N_INPUTS


def test_workers_change_between_runs_1_2_3_1(tmp_path: Path, reference: dict[str, Any]) -> None:
    seed = _seed(11)
    rng = random.Random(seed)
    inp, state, out = tmp_path / "in.jsonl", tmp_path / "state", tmp_path / "out.jsonl"
    write_inputs(inp, 0, 150)
    run_to_end(tmp_path, inp, state, out, 1)  # a single-process state, as before --workers
    write_inputs(inp, 150, 250)
    run_to_end(tmp_path, inp, state, out, 2)
    assert read_layout(state).workers == 2 and not (state / "ratchet.db").exists()
    write_inputs(inp, 250, 380)
    # Killed part-way with 2 workers: the shards stand at different inputs, with runs in
    # flight; the change to 3 first brings both to one position, then moves the keys. (The
    # kill comes within the first 10-60 executions of 130 inputs: with up to 200, a fast run
    # sometimes ended first.)
    # The count to kill at is taken before the start: counted after it, a run that was quick
    # to begin had its executions in the base, and ended before the target (CI, seed 11).
    target = len(log_lines(tmp_path)) + rng.randint(10, 60)
    proc = start(tmp_path, inp, state, out, 2, niced=True, hold_at=target)
    while proc.poll() is None and len(log_lines(tmp_path)) < target:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, f"seed {seed}: finished before the kill"
    workers_gone(state)
    # Killed again during the change itself (the old shards catching up, the keys moving, or
    # the first inputs on 3 workers): the layout in force stays whole, and the next run ends it.
    proc = start(tmp_path, inp, state, out, 3)
    time.sleep(rng.uniform(0.2, 2.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    workers_gone(state)
    run_to_end(tmp_path, inp, state, out, 3)
    assert read_layout(state).workers == 3
    assert not (state / "shards" / "0-of-2").exists()
    write_inputs(inp, 380, N_INPUTS)
    run_to_end(tmp_path, inp, state, out, 1)
    assert read_layout(state).workers == 1
    assert (state / "ratchet.db").exists() and not (state / "shards").exists()
    check_outputs(out, N_INPUTS, seed)
    assert inspect(state) == reference


def test_python_api_runs_workers_over_an_iterable(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    import ratchet
    from ratchet.agents._run import load_agent

    items = [{"key": f"k{i % KEYS}", "id": i, "value": (i * 7) % 101} for i in range(N_INPUTS)]
    state, out = tmp_path / "state", tmp_path / "out.jsonl"
    result = ratchet.run(load_agent(AGENT), inputs=items, output=out, state_dir=state, workers=2)
    assert (result.inputs, result.outputs, result.runs_completed) == (N_INPUTS,) * 3
    check_outputs(out, N_INPUTS, 0)
    assert inspect(state) == reference
    with pytest.raises(ratchet.ConfigError, match="agent_config"):
        ratchet.run(
            load_agent(AGENT), inputs=items, output=out, state_dir=state, workers=2,
            agent_config={"x": 1},
        )  # fmt: skip


def test_a_worker_that_fails_stops_the_job_naming_its_shard(tmp_path: Path) -> None:
    write_inputs(tmp_path / "in.jsonl", 0, 100)
    state, out = tmp_path / "state", tmp_path / "out.jsonl"
    run_to_end(tmp_path, tmp_path / "in.jsonl", state, out, 2)
    broken = state / "shards" / "1-of-2"
    (broken / "ratchet.db").write_bytes(b"not a database at all")
    for name in ("ratchet.db-wal", "ratchet.db-shm"):
        (broken / name).unlink(missing_ok=True)
    write_inputs(tmp_path / "in.jsonl", 100, 150)
    done = subprocess.run(
        [*RATCHET, "run", AGENT, "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
         "--state", str(state), "--workers", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"worker of shard 1 ({broken}) failed" in done.stderr
    assert "not a ratchet state database" in done.stderr
    assert "Traceback" not in done.stderr and "never retrieved" not in done.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--workers", "0"], "--workers must be >= 1 or auto, not 0"),
        (["--rest-port", "1"], "--rest-port is an option of a supervised job"),
    ],
)
def test_what_a_sharded_run_cannot_do_is_refused(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    write_inputs(tmp_path / "in.jsonl", 0, 10)
    done = subprocess.run(
        [*RATCHET, "run", AGENT, "--input", str(tmp_path / "in.jsonl"), "--output",
         str(tmp_path / "out.jsonl"), "--state", str(tmp_path / "state"), "--workers", "2",
         *extra],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert not (tmp_path / "state" / "shards").exists()


def test_single_database_commands_refuse_a_sharded_job_naming_the_fix(tmp_path: Path) -> None:
    write_inputs(tmp_path / "in.jsonl", 0, 20)
    state = tmp_path / "state"
    run_to_end(tmp_path, tmp_path / "in.jsonl", state, tmp_path / "out.jsonl", 2)
    for command, why in (
        (["savepoint", str(tmp_path / "sp")], "a savepoint is one SQLite file"),
        (["checkpoints"], "checkpoint ids and history are per database"),
        (["fork", "--to", str(tmp_path / "new")], "a fork is made from one consistent copy"),
    ):
        done = subprocess.run(
            [*RATCHET, *command, "--state", str(state)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, done.stderr
        assert why in done.stderr and "Run the job once with --workers 1" in done.stderr
        assert "Traceback" not in done.stderr


FAILING_AGENT = """
import time
from ratchet import Agent, InputEvent, action

class Failing(Agent):
    @action(InputEvent)
    def go(self, event, ctx):
        time.sleep(0.02)
        raise ValueError(f"input {event.input['i']} fails")
"""


def _killed_failing_job(
    tmp_path: Path, inputs: int, keys: int, workers: int
) -> tuple[list[str], Path]:
    """A job of FAILING_AGENT SIGKILLed once 5 runs have failed (runs in flight, inputs
    queued); the command line to run it again (without its --allow-errors and --workers),
    and its output file."""
    agent = tmp_path / "failing.py"
    agent.write_text(FAILING_AGENT)
    inp = tmp_path / "in.jsonl"
    lines = (json.dumps({"key": f"k{i % keys}", "i": i}) + "\n" for i in range(inputs))
    inp.write_text("".join(lines))
    state, out = tmp_path / "state", tmp_path / "out.jsonl"
    base = [*RATCHET, "run", f"{agent}:Failing", "--input", str(inp), "--output", str(out)]
    base += ["--state", str(state)]
    first = subprocess.Popen(
        [*base, "--allow-errors", "--workers", str(workers), "--checkpoint-interval", "50"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (out.exists() and len(out.read_text().splitlines()) >= 5):
        assert first.poll() is None and time.monotonic() < deadline, "ended before the kill"
        time.sleep(0.01)
    first.kill()
    first.wait()
    return base, out


def test_changing_the_number_of_workers_counts_what_finishing_the_old_state_did(
    tmp_path: Path,
) -> None:
    """A single-process job SIGKILLed with runs in flight and inputs queued, then run with
    --workers 2: the old state is finished first (every run fails here). Those runs were left
    out of the result, so the job exited 0 with nothing counted; now exit 4, all counted."""
    base, out = _killed_failing_job(tmp_path, 60, 4, 1)
    failed_before = len(out.read_text().splitlines())
    assert failed_before < 60
    second = subprocess.run(
        [*base, "--workers", "2", "--json"], capture_output=True, text=True, timeout=120
    )
    assert second.returncode == 4, second.stderr[-2000:]
    summary = json.loads(second.stdout)
    assert summary["runs_failed"] == 60 - failed_before, summary
    assert len(out.read_text().splitlines()) == 60  # each input's error output, once


@pytest.mark.parametrize("before", [1, 2])
def test_max_errors_while_finishing_the_old_state_stops_the_job_there(
    tmp_path: Path, before: int
) -> None:
    """From 2 workers the finishing coordinator's reason reads 'shard 0: more than ...': the
    stop was missed and the re-shard was refused (exit 2, runs in flight)."""
    base, _out = _killed_failing_job(tmp_path, 80, 6, before)
    second = subprocess.run(
        [*base, "--workers", "3", "--max-errors", "0"], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert second.returncode == 4, second.stderr[-2000:]
    assert "more than 0 run(s) ended in error" in second.stderr
    # The same end line as one worker's, with where the failed inputs are (it lacked it).
    assert "their inputs are dead letters (`ratchet dead-letters --state" in second.stderr
