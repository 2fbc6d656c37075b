"""`ratchet migrate`, `runs restart` and `runs abandon` need the job stopped: they refuse a
supervised job also while its supervisor is between two workers, and a supervisor restarts a
worker that was refused the state's lock only because another process held it for a moment.
Each refusal is one line and exit 2, and none of them writes a state where there was none."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ratchet._errors import StateError
from ratchet.store._sqlite import StateLock
from support.acc_agent import AGENT_SRC
from support.rest import free_port, get

pytestmark = [pytest.mark.kill, pytest.mark.slow]  # about 17 s: make test-slow

STOPPED_COMMANDS = [
    ["migrate", "--agent", "{agent}"],
    ["runs", "abandon", "--key", "k1"],
    ["runs", "restart", "--key", "k1"],
]


def ratchet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ratchet.cli", *args], capture_output=True, text=True, timeout=60
    )


def command(tmp: Path, words: list[str], state: Path) -> list[str]:
    agent = f"{tmp / 'agent.py'}:Acc"
    return [w.replace("{agent}", agent) for w in words] + ["--state", str(state)]


def one_line_refusal(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ratchet: error: "), proc.stderr
    return lines[0]


def start_supervised(tmp: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    (tmp / "agent.py").write_text(AGENT_SRC)
    (tmp / "in.jsonl").write_text("".join(json.dumps({"key": f"k{i}"}) + "\n" for i in range(50)))
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", f"{tmp / 'agent.py'}:Acc",
        "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl"),
        "--state", str(tmp / "state"), "--follow", "--supervise", "--rest-port", str(port),
        "--checkpoint-interval", "50", *extra,
    ]  # fmt: skip
    with open(tmp / "sup.log", "wb") as log:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)


def wait_job(
    tmp: Path, sup: subprocess.Popen[bytes], port: int, ok: Any, what: str
) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if sup.poll() is not None:
            log = (tmp / "sup.log").read_text()
            raise AssertionError(f"the supervisor exited {sup.returncode} before {what}:\n{log}")
        try:
            job = get(port, "/v1/job")
            if ok(job):
                return job
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"the supervised job never got {what}; last /v1/job: {job}")


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def with_its_worker_killed(
    tmp: Path, workers: str, restart_delay: str
) -> tuple[subprocess.Popen[bytes], int]:
    """A supervised job whose first worker ran and was SIGKILLed: (its supervisor, REST port).
    The caller stops the supervisor (stopped here if the worker never ran)."""
    port = free_port()
    sup = start_supervised(tmp, port, "--workers", workers, "--restart-delay", restart_delay)
    try:
        job = wait_job(tmp, sup, port, lambda j: j["state"] == "running", "running")
        os.kill(job["worker_pid"], signal.SIGKILL)
    except BaseException:
        stop(sup)
        raise
    return sup, port


@pytest.mark.parametrize("workers", ["1", "2"])
def test_commands_that_need_the_job_stopped_refuse_a_supervisor_between_workers(
    tmp_path: Path, workers: str
) -> None:
    sup, port = with_its_worker_killed(tmp_path, workers, "60")
    try:
        # The worker is dead, its lock free; the supervisor waits 60 s before the next one.
        wait_job(tmp_path, sup, port, lambda j: j["state"] == "restarting", "restarting")
        for words in STOPPED_COMMANDS:
            proc = ratchet(*command(tmp_path, words, tmp_path / "state"))
            line = one_line_refusal(proc)
            assert f"its supervisor, pid {sup.pid} (supervisor.lock)" in line, line
            assert f"kill -TERM {sup.pid}" in line, line
        assert sup.poll() is None
    finally:
        assert stop(sup) == 0, (tmp_path / "sup.log").read_text()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_worker_refused_a_lock_held_for_a_moment_is_restarted(
    tmp_path: Path, workers: str
) -> None:
    # A second between a worker's death and the next: the test takes the lock well before it.
    sup, port = with_its_worker_killed(tmp_path, workers, "1")
    try:
        # Another process takes the state's lock while the worker is down (what a `migrate`
        # of a ratchet before this fix did), and holds it over two restarts.
        held = StateLock(tmp_path / "state")
        deadline = time.monotonic() + 10
        while True:
            try:
                held.acquire()
                break
            except StateError:
                assert time.monotonic() < deadline, "the lock was never free for the test"
                time.sleep(0.005)
        try:
            wait_job(tmp_path, sup, port, lambda j: j["restarts"] >= 3, "two refused restarts")
            assert sup.poll() is None, (tmp_path / "sup.log").read_text()
        finally:
            held.release()
        wait_job(tmp_path, sup, port, lambda j: j["state"] == "running", "running again")
        log = (tmp_path / "sup.log").read_text()
        assert (
            f"(exit code 2: the state directory was in use by pid {os.getpid()}); restart 2/10"
            in log
        ), log
        assert "not restarting" not in log, log
    finally:
        assert stop(sup) == 0, (tmp_path / "sup.log").read_text()


def test_a_refusal_for_a_real_reason_still_ends_the_supervisor(tmp_path: Path) -> None:
    """The control: a worker refused for a state that is wrong is not restarted, as before."""
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "ratchet.db").write_bytes(b"not a database at all" * 100)
    sup = start_supervised(tmp_path, free_port())
    assert sup.wait(timeout=60) == 2
    log = (tmp_path / "sup.log").read_text()
    assert "not restarting" in log and "restart 1/" not in log, log


@pytest.fixture
def stopped_state(tmp_path: Path) -> Path:
    (tmp_path / "agent.py").write_text(AGENT_SRC)
    (tmp_path / "in.jsonl").write_text('{"key": "k1"}\n')
    made = ratchet(
        "run", f"{tmp_path / 'agent.py'}:Acc", "--input", str(tmp_path / "in.jsonl"),
        "--output", str(tmp_path / "out.jsonl"), "--state", str(tmp_path / "state"),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return tmp_path / "state"


@pytest.mark.parametrize("words", STOPPED_COMMANDS, ids=lambda w: " ".join(w[:2]))
def test_a_lock_file_that_cannot_be_opened_is_one_line(
    stopped_state: Path, tmp_path: Path, words: list[str]
) -> None:
    (stopped_state / "ratchet.lock").unlink()
    (stopped_state / "ratchet.lock").mkdir()
    line = one_line_refusal(ratchet(*command(tmp_path, words, stopped_state)))
    assert f"--state {stopped_state} cannot be used as a state directory" in line, line
    assert f"Is a directory: '{stopped_state / 'ratchet.lock'}'" in line, line
    assert "its lock files, ratchet.lock and supervisor.lock, plain files" in line, line


@pytest.mark.parametrize("words", STOPPED_COMMANDS, ids=lambda w: " ".join(w[:2]))
def test_an_empty_or_missing_database_is_refused_and_left_untouched(
    tmp_path: Path, words: list[str]
) -> None:
    (tmp_path / "agent.py").write_text(AGENT_SRC)
    empty = tmp_path / "z"
    empty.mkdir()
    (empty / "ratchet.db").write_bytes(b"")
    line = one_line_refusal(ratchet(*command(tmp_path, words, empty)))
    assert f"{empty / 'ratchet.db'} is not a ratchet state database" in line, line
    assert "left untouched" in line, line
    assert sorted(p.name for p in empty.iterdir()) == ["ratchet.db"]
    assert (empty / "ratchet.db").stat().st_size == 0
    missing = tmp_path / "missing"
    line = one_line_refusal(ratchet(*command(tmp_path, words, missing)))
    assert "no ratchet state in" in line, line
    assert not missing.exists()
