"""The supervisor's restart budget over a job's whole life: a worker that has run
`--restart-reset-after` seconds starts the count that `--restart-attempts` limits again (a job
that runs for months is not given up for a few crashes weeks apart), while the total of
restarts that /v1/job and /metrics report only grows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ratchet._errors import EXIT_FAILED, EXIT_OK, ConfigError
from ratchet.runtime._supervisor import Supervisor
from ratchet.testing import FakeClock
from support.acc_agent import AGENT_SRC
from support.rest import free_port, get

# A stand-in worker: one report on the supervisor's pipe (it is then running), then it waits
# to be killed. Its start takes no virtual time; the test moves the clock while it runs.
FAKE_WORKER = """
import os, time
with os.fdopen(int(os.environ["RATCHET_STATUS_FD"]), "w") as pipe:
    pipe.write('{"status": {}}\\n')
    pipe.flush()
    time.sleep(600)
"""


def supervise_with_fake_clock(
    tmp: Path, reset_after: float, ran: list[float]
) -> tuple[int, Supervisor, list[tuple[int, int]]]:
    """Run a supervisor (restart attempts 1, no delay) on the fake worker in this thread. A
    helper thread, for each of `ran`: waits for a new worker's report, moves the clock that
    many seconds, reads /v1/job's (restarts, restarts_counted), SIGKILLs the worker. Then it
    stops the supervisor once a next worker reports, if the supervisor still restarts.
    Returns (its exit code, the supervisor, what /v1/job said before each kill)."""
    clock = FakeClock()
    sup = Supervisor(
        [sys.executable, "-c", FAKE_WORKER],
        tmp / "state",
        restart_attempts=1,
        restart_delay=0,
        restart_reset_after=reset_after,
        clock=clock,
    )
    seen: list[tuple[int, int]] = []
    problems: list[BaseException] = []

    def next_worker(known: set[int]) -> int | None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with sup._lock:
                w, state = sup.s.worker, sup.s.state
            if state in ("failed", "finished"):
                return None
            if w is not None and w.proc.pid not in known and state == "running":
                return w.proc.pid
            time.sleep(0.01)
        raise AssertionError("no new worker reported")

    def drive() -> None:
        known: set[int] = set()
        try:
            for seconds in ran:
                pid = next_worker(known)
                if pid is None:
                    return
                known.add(pid)
                clock.advance(seconds)
                info = sup.job_info()
                seen.append((info.restarts, info.restarts_counted))
                os.kill(pid, signal.SIGKILL)
            if next_worker(known) is not None:
                sup.request_stop()
        except BaseException as exc:
            problems.append(exc)
            sup.request_stop()

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        rc = sup.run()
    finally:
        sup.request_stop()  # the worker of a failed drive
        driver.join(timeout=30)
    assert not problems, problems
    return rc, sup, seen


def test_a_worker_that_ran_past_the_threshold_starts_the_count_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Restart attempts 1: three deaths, each after its worker ran the 10 s threshold, are
    each `restart 1/1`; the supervisor gave up at the second before (it never reset)."""
    rc, sup, seen = supervise_with_fake_clock(tmp_path, 10.0, [10.0, 10.0, 10.0])
    err = capsys.readouterr().err
    assert rc == EXIT_OK, err
    # (total, counted) before each kill: the count is 0 again once the worker ran 10 s.
    assert seen == [(0, 0), (1, 0), (2, 0)]
    assert sup.s.restarts == 3 and sup.job_info().restarts_counted == 1  # the 4th, stopped
    assert err.count("ratchet: worker died (killed by SIGKILL); restart 1/1 in 0 s") == 3, err
    assert err.count("(the count started again: the worker had run 10.0 s, ") == 2, err
    assert "used up" not in err


@pytest.mark.parametrize(
    ("reset_after", "ran"),
    [(10.0, 9.5), (0.0, 1e6)],
    ids=["shorter-than-the-threshold", "0-never-resets"],
)
def test_a_crash_loop_still_uses_up_the_attempts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], reset_after: float, ran: float
) -> None:
    rc, sup, seen = supervise_with_fake_clock(tmp_path, reset_after, [ran, ran])
    err = capsys.readouterr().err
    assert rc == EXIT_FAILED, err
    assert seen == [(0, 0), (1, 1)]
    assert sup.s.restarts == 1 and sup.s.state == "failed"
    assert "restart 1/1 in 0 s\n" in err
    assert "the 1 restart attempts are used up" in err and "started again" not in err


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_bad_reset_threshold_is_refused(tmp_path: Path, value: float) -> None:
    with pytest.raises(ConfigError, match=r"^--restart-reset-after must be a number of seconds"):
        Supervisor(["true"], tmp_path, restart_reset_after=value)
    assert not (tmp_path / "supervisor.lock").exists()


@pytest.mark.parametrize(
    ("flag", "value"), [("--restart-reset-after", "-5"), ("--restart-delay", "nan")]
)
def test_the_cli_refuses_a_bad_number_of_seconds_in_one_line(
    tmp_path: Path, flag: str, value: str
) -> None:
    (tmp_path / "agent.py").write_text(AGENT_SRC)
    (tmp_path / "in.jsonl").write_text('{"key": "a"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "run", f"{tmp_path / 'agent.py'}:Acc",
         "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
         "--state", str(tmp_path / "state"), "--supervise", f"{flag}={value}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"ratchet: error: {flag} must be a number of seconds >= 0"
        + (" (0: never)" if flag == "--restart-reset-after" else "")
        + f", not {value}"
    ], proc.stderr
    assert not (tmp_path / "state").exists()


KEYS = [f"k{i}" for i in range(5)]


def _outputs(tmp: Path) -> list[dict[str, Any]]:
    out = tmp / "out.jsonl"
    if not out.exists():
        return []
    return [json.loads(line)["output"] for line in out.read_text().splitlines()]


@pytest.mark.kill
@pytest.mark.slow
def test_a_supervised_job_survives_sigkills_spread_over_its_life(tmp_path: Path) -> None:
    """`--restart-attempts 1 --restart-reset-after 1`: the worker is SIGKILLed three times,
    each after the new one ran past 1 s. The job keeps running (each death is `restart 1/1`)
    and every input's output is written exactly once; before the reset it gave up at the
    second kill."""
    pytest.importorskip("uvicorn", reason="--rest-port needs the server extra")
    (tmp_path / "agent.py").write_text(AGENT_SRC)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"key": k}) + "\n" for k in KEYS))
    port = free_port()
    log = open(tmp_path / "sup.log", "wb")  # noqa: SIM115
    sup = subprocess.Popen(
        [sys.executable, "-m", "ratchet.cli", "run", f"{tmp_path / 'agent.py'}:Acc",
         "--input", str(inp), "--output", str(tmp_path / "out.jsonl"),
         "--state", str(tmp_path / "state"), "--follow", "--checkpoint-interval", "50",
         "--supervise", "--rest-port", str(port), "--restart-attempts", "1",
         "--restart-delay", "0", "--restart-reset-after", "1"],
        stdout=subprocess.DEVNULL, stderr=log,
    )  # fmt: skip

    def until(what: str, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + 60
        job: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if sup.poll() is not None:
                text = (tmp_path / "sup.log").read_text()
                raise AssertionError(
                    f"the supervisor exited {sup.returncode} before {what}:\n{text}"
                )
            try:
                job = get(port, "/v1/job")
                if ok(job):
                    return job
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"never {what}; last /v1/job: {job}")

    try:
        pid = until("running", lambda j: j["state"] == "running")["worker_pid"]
        for kills in range(1, 4):
            # every input so far has its output: this worker did some work
            until(f"{5 * kills} outputs", lambda _, n=5 * kills: len(_outputs(tmp_path)) == n)
            # it ran 1 s since its first report: nothing counted against the one attempt
            until("the count started again", lambda j: j["restarts_counted"] == 0)
            os.kill(pid, signal.SIGKILL)
            job = until(
                f"restart {kills}",
                lambda j, old=pid: j["state"] == "running" and j["worker_pid"] != old,
            )
            assert (job["restarts"], job["restarts_counted"]) == (kills, 1), job
            pid = job["worker_pid"]
            with inp.open("a") as f:
                f.write("".join(json.dumps({"key": k}) + "\n" for k in KEYS))
        until("20 outputs", lambda _: len(_outputs(tmp_path)) == 20)
        config = get(port, "/v1/job/config")
        assert config["restart_strategy"] == {
            "type": "fixed-delay-with-reset",
            "attempts": 1,
            "delay_seconds": 0.0,
            "reset_after_seconds": 1.0,
            "unreachable_delay_factor": 2.0,
            "unreachable_max_delay_seconds": 30.0,
        }
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=30) == 0
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        log.close()
    text = (tmp_path / "sup.log").read_text()
    assert text.count("worker died (killed by SIGKILL); restart 1/1 in 0 s") == 3, text
    assert text.count("the count started again") == 2 and "used up" not in text, text
    # Exactly once across the three kills: each key's four inputs counted 1, 2, 3, 4.
    by_key: dict[str, list[int]] = {}
    for output in _outputs(tmp_path):
        by_key.setdefault(output["key"], []).append(output["n"])
    assert by_key == {k: [1, 2, 3, 4] for k in KEYS}


# Workers 1 and 2 cannot reach their server at start; worker 3 runs (it reports) and then
# loses it; worker 4 ends the job. Each counts itself in a file beside the state.
OUTAGE_WORKER = """
import os, sys
from pathlib import Path
count = Path(sys.argv[1])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
with os.fdopen(int(os.environ["RATCHET_STATUS_FD"]), "w") as pipe:
    if n == 3:
        pipe.write('{"status": {}}\\n')
        pipe.flush()
    if n <= 3:
        pipe.write('{"unreachable": "NATS at 127.0.0.1:4222"}\\n')
        pipe.flush()
        sys.exit(2)
"""


def test_a_worker_that_ran_and_then_lost_its_server_starts_a_new_streak_of_waits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The delay doubles for each worker in a row that cannot reach a server: two refused at
    start wait 0.1 s, then 0.2 s; one that ran and lost its server mid-run waits 0.1 s again
    (it continued the streak: 0.4 s, and after a few more, 30 s for a short blip)."""
    sup = Supervisor(
        [sys.executable, "-c", OUTAGE_WORKER, str(tmp_path / "count")],
        tmp_path / "state",
        restart_attempts=5,
        restart_delay=0.1,
    )
    assert sup.run() == EXIT_OK
    err = capsys.readouterr().err
    delays = [
        line.split(" in ")[1].split(" s ")[0]
        for line in err.splitlines()
        if "waiting for it, retrying" in line
    ]
    assert delays == ["0.1", "0.2", "0.1"], err
