"""Durable waits across SIGKILL, with real processes and real time (docs/runtime.md,
"Durable time and signals"):

- a run sleeping 2 s is killed and finishes once, at its recorded deadline, not 2 s after
  the restart;
- an approval flow: the job is killed while a run waits, the signal is sent with
  `ratchet signal` while the job is down, the restarted job completes the run exactly once
  (the refund is charged once); a malformed value is refused with exit 3;
- the same through REST on a supervised job whose worker is killed while waiting;
- memory with a ttl is gone for a run that starts after it expired, across a restart;
- runs killed while they wait for a second signal, after taking a first: `ratchet runs
  restart` puts the first back for the run to take again, and `runs abandon` keeps it with
  the dead letter until `ratchet redrive` admits it (one worker, redriven when the job
  starts; two, redriven while it runs, each signal staying in its key's shard);
- a run that fails after taking its first signal: its dead letter keeps the signal, and the
  redrive after the fix gives it back, first, without it being sent again (one worker; two;
  one, then two after re-sharding);
- an action with a retry policy that failed after taking a signal, killed while it waits to
  retry: the signal went back before the retry was recorded, and the retried attempt in the
  restarted job gets it, once.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from support.waits_job import WaitsJob

pytestmark = pytest.mark.kill


class Job(WaitsJob):
    def waiting(self) -> list[dict[str, Any]]:
        done = self.run_cli("status", "--state", str(self.state), "--json")
        return list(json.loads(done.stdout)["waiting"]) if done.returncode == 0 else []


def until(
    what: str, check: Any, proc: subprocess.Popen[str] | None = None, limit: float = 60
) -> Any:
    deadline = time.monotonic() + limit
    while True:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited before {what}: {proc.communicate()[1]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)


def finish(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return err


def test_a_sleeping_run_killed_finishes_once_at_its_recorded_deadline(tmp_path: Path) -> None:
    job = Job(tmp_path, "Napper")
    job.write({"key": "a", "s": 2.0})
    first = job.start("--follow")
    until("the sleep recorded", lambda: any(w["on"] == "sleep" for w in job.waiting()), first)
    kill(first)
    assert job.outputs() == []
    finish(job.start())
    (out,) = job.outputs()
    log = job.lines(job.log)
    begins = [e["t"] for e in log if e["what"] == "begin"]
    assert len(begins) == 2 and len([e for e in log if e["what"] == "woke"]) == 1
    # It slept the full 2 s from its first start, and not another 2 s from the restart.
    assert begins[0] + 2.0 <= out["woke"] < begins[1] + 2.0, (begins, out)


def test_a_timer_that_fell_due_while_the_job_was_down_ends_the_job_normally(
    tmp_path: Path,
) -> None:
    # The restarted bounded job delivered it and the run ended while the engine polled for
    # signals: it said "0 run(s) waiting for signals; they stay parked" (4 runs in 4).
    job = Job(tmp_path, "Reminds")
    job.write({"key": "a", "s": 1.0})
    first = job.start("--follow")
    try:
        # `status` lists the run as waiting for its delayed event (it showed only "in flight").
        waits = until("the timer recorded", lambda: job.waiting(), first)
        assert [(w["key"], w["on"]) for w in waits] == [("a", "delayed event Reminder")], waits
        assert waits[0]["until"] > time.time()
    finally:
        kill(first)  # a failed check must not leave the --follow job running
    time.sleep(1.2)  # past its due time, while the job is down
    second = job.start("--json")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert json.loads(out)["stopped_by"] == "end of input", out
    assert "waiting for signals" not in err, err
    assert job.outputs() == [{"reminded": 1}]
    assert [e["what"] for e in job.lines(job.log)] == ["reminded"]


def test_an_approval_sent_while_the_job_is_down_completes_the_run_once(tmp_path: Path) -> None:
    job = Job(tmp_path, "Refunds")
    job.write({"key": "t-1", "amount": 30})
    first = job.start("--follow")
    until("the approval request", lambda: job.outputs(), first)
    until("the wait recorded", lambda: any(w["on"] == "signal approve" for w in job.waiting()))
    kill(first)

    bad = job.run_cli(
        "signal", "--state", str(job.state), "--key", "t-1", "approve", "--value", "{ok"
    )
    assert bad.returncode == 3 and "is not JSON" in bad.stderr and "Traceback" not in bad.stderr
    sent = job.run_cli(
        "signal", "--state", str(job.state), "--key", "t-1", "approve", "--value", '{"ok": true}'
    )
    assert sent.returncode == 0, sent.stderr
    assert "signal 'approve' for key t-1 stored" in sent.stdout
    status = job.run_cli("status", "--state", str(job.state), "--json")
    assert [p["name"] for p in json.loads(status.stdout)["pending_signals"]] == ["approve"]

    finish(job.start())
    assert job.outputs() == [{"approval_requested": 30}, {"refunded": {"charged": 30}}]
    assert [e["amount"] for e in job.lines(job.log) if e["what"] == "charge"] == [30]
    status = json.loads(job.run_cli("status", "--state", str(job.state), "--json").stdout)
    assert status["waiting"] == [] and status["pending_signals"] == []


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_bounded_job_leaves_a_waiting_run_parked_and_says_so(
    tmp_path: Path, workers: str
) -> None:
    """With --workers 2 the parked runs of both shards are added up, and the job says so as
    one process does (it ended with "stopped_by": "end of input" and said nothing)."""
    job = Job(tmp_path, "Refunds")
    keys = ["t-0", "t-1", "t-2", "t-3"]  # both shards get some
    job.write(*({"key": k, "amount": 5} for k in keys))
    err = finish(job.start("--workers", workers))
    assert "ratchet: 4 run(s) waiting for signals; they stay parked" in err, err
    assert "ratchet signal" in err
    assert job.outputs() == [{"approval_requested": 5}] * 4
    for k in keys:
        done = job.run_cli(
            "signal", "--state", str(job.state), "--key", k, "approve", "--value", '{"ok": false}'
        )
        assert done.returncode == 0, done.stderr
    again = job.start("--workers", workers, "--json")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert json.loads(out)["stopped_by"] == "end of input" and "waiting" not in err, (out, err)
    assert job.outputs()[4:] == [{"refused": 5}] * 4


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_runs_restart_and_abandon_give_a_killed_run_back_the_signal_it_had_taken(
    tmp_path: Path, workers: int
) -> None:
    from support.shard_state import workers_gone

    job = Job(tmp_path, "TwoSignals")  # waits for "go" twice, outputs both values
    job.write({"key": "k"}, {"key": "j"})  # two shards among 2: "k" is in 1, "j" in 0
    state, sharded = str(job.state), ("--workers", str(workers))

    def cli(*args: str) -> Any:
        done = job.run_cli(*args)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout) if "--json" in args else done.stdout

    def send(key: str, value: int) -> None:
        cli("signal", "--state", state, "--key", key, "go", "--value", str(value))

    def in_flight() -> dict[str, Any]:
        return {r["key"]: r for r in cli("runs", "list", "--state", state, "--json")["in_flight"]}

    def pending() -> list[dict[str, Any]]:
        return list(cli("status", "--state", state, "--json")["pending_signals"])

    first = job.start("--follow", *sharded)
    until("both runs waiting", lambda: len(job.waiting()) == 2, first)
    send("k", 1)
    send("j", 1)
    # Each run took its first "go" (a returned record) and waits for the second (an intent).
    until(
        "the first signals taken",
        lambda: (
            all((r["call_records"], r["calls_returned"]) == (2, 1) for r in in_flight().values())
            and len(in_flight()) == 2
        ),
        first,
    )
    runs = in_flight()
    kill(first)
    if workers > 1:
        workers_gone(job.state)
    assert pending() == [] and job.outputs() == []

    restarted = cli("runs", "restart", "--state", state, "--key", "k", "--json")
    assert restarted["signals_put_back"] == 1, restarted
    said = cli("runs", "abandon", "--state", state, "--key", "j")
    assert "the 1 signal(s) the run had taken are kept with the dead letter" in said, said
    # k's signal is pending again, in k's shard; j's is with its dead letter, not pending for
    # another run of j to take.
    (back,) = pending()
    assert (back["key"], back["name"]) == ("k", "go"), back
    assert back.get("shard") == runs["k"].get("shard"), (back, runs)
    (letter,) = cli("dead-letters", "--state", state, "--json")
    assert letter["key"] == "j" and letter["kind"] == "abandoned", letter
    assert [(g["name"], g["value"]) for g in letter["detail"]["signals"]] == [("go", 1)]

    # Sent before the redrive: the redriven run must still take the first signal first.
    send("k", 2)
    send("j", 2)
    if workers == 1:  # asked while the job is stopped: admitted when it starts
        cli("redrive", "--state", state, "--key", "j")
        finish(job.start(*sharded))
    else:  # asked while it runs: admitted at a look for redrives, by j's shard's worker
        again = job.start("--follow", *sharded)
        until("k's run done", lambda: [o["key"] for o in job.outputs()] == ["k"], again)
        cli("redrive", "--state", state, "--key", "j")
        until("j's redriven run done", lambda: len(job.outputs()) == 2, again)
        again.send_signal(signal.SIGTERM)
        finish(again)
    got = {o["key"]: o["got"] for o in job.outputs() if o is not None}
    assert got == {"k": [1, 2], "j": [1, 2]}, got  # each took its first signal again, first
    status = cli("status", "--state", state, "--json")
    assert status["waiting"] == [] and status["pending_signals"] == [], status
    (letter,) = cli("dead-letters", "--state", state, "--json")
    assert [g["value"] for g in letter["detail"]["signals_put_back"]] == [1], letter
    assert letter["redriven_as"] is not None and "signals" not in letter["detail"], letter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(method: str, port: int, path: str, body: Any = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def test_an_approval_through_rest_on_a_supervised_job_whose_worker_was_killed(
    tmp_path: Path,
) -> None:
    pytest.importorskip("fastapi", reason="the REST API needs ratchet[server] (fastapi, uvicorn)")
    job = Job(tmp_path, "Refunds")
    job.write({"key": "t-3", "amount": 12})
    port = free_port()
    sup = job.start("--follow", "--supervise", "--rest-port", str(port), "--restart-delay", "0.1")
    try:

        def waiting() -> Any:
            try:
                status, info = http_json("GET", port, "/v1/job")
            except OSError:
                return None
            waits = (info or {}).get("waiting") or []
            return (
                info if status == 200 and any(w["on"] == "signal approve" for w in waits) else None
            )

        info = until("the worker to report the wait", waiting, sup)
        os.kill(info["worker_pid"], signal.SIGKILL)  # the supervisor starts a new worker
        until(
            "a new worker waiting",
            lambda: (w := waiting()) and w["worker_pid"] != info["worker_pid"],
            sup,
        )
        status, api = http_json("GET", port, "/openapi.json")
        assert "/v1/keys/{key}/signals/{name}" in api["paths"]
        status, sent = http_json(
            "POST", port, "/v1/keys/t-3/signals/approve", {"value": {"ok": True}}
        )
        assert status == 202 and sent["key"] == "t-3" and sent["name"] == "approve", sent
        until("the refund", lambda: len(job.outputs()) == 2, sup)
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.communicate(timeout=60)
    assert job.outputs() == [{"approval_requested": 12}, {"refunded": {"charged": 12}}]
    assert [e["amount"] for e in job.lines(job.log) if e["what"] == "charge"] == [12]


def test_memory_with_a_ttl_is_gone_for_runs_after_it_expired_across_a_restart(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path, "Remember")
    job.write({"key": "k", "op": "set", "ttl": 0.6}, {"key": "k", "op": "read", "n": 1})
    first = job.start("--follow")
    until("the first read", lambda: job.outputs(), first)
    set_at = time.time()  # an upper bound of when the value was set
    kill(first)
    until("the ttl to pass", lambda: time.time() > set_at + 0.6, limit=10)
    job.write({"key": "k", "op": "read", "n": 2})
    finish(job.start())
    assert job.outputs() == [{"n": 1, "v": "secret"}, {"n": 2, "v": None}]
    memory = json.loads(job.run_cli("inspect", "--state", str(job.state), "--json").stdout)
    assert memory == {"k": {}}


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2", "1 then 2"])
def test_a_failed_run_gets_back_the_signal_it_had_taken_when_it_is_redriven(
    tmp_path: Path, workers: str
) -> None:
    """A run takes its first "go" and then fails (a bug): its dead letter keeps the signal,
    and once the bug is fixed its redrive puts it back for the new run to take, first, before
    a "go" sent after the failure; it is never sent again. With two workers the dead letter
    and the redriven run are in the key's shard, and the redrive is admitted while the job
    runs. "1 then 2": the dead letter moves to the key's shard when the workers change, and
    the signal it keeps with it, given an id there in the order sent (kept with its old id,
    it was put back under the id re-sharding gave the later signal, so after it), is put back
    before the later one."""
    from ratchet.runtime._shards import shard_of

    job = Job(tmp_path, "TwoSignals")  # waits for "go" twice, outputs both values
    job.env["WAITS_BROKEN"] = "1"  # the bug: it fails after taking its first "go"
    job.write({"key": "k"})
    state = str(job.state)
    before, after = ("--workers", workers[0]), ("--workers", workers[-1])

    def cli(*args: str) -> Any:
        done = job.run_cli(*args)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout) if "--json" in args else done.stdout

    def send(value: int, key: str = "k") -> None:
        cli("signal", "--state", state, "--key", key, "go", "--value", str(value))

    def status() -> dict[str, Any]:
        return dict(cli("status", "--state", state, "--json"))

    finish(job.start(*before))  # the run waits for its first "go", parked
    assert [(w["key"], w["on"]) for w in status()["waiting"]] == [("k", "signal go")]
    send(1)
    failed = job.start(*before)
    out, err = failed.communicate(timeout=120)
    assert failed.returncode == 4, err  # EXIT_ERRORS: the run ended in error
    assert [e["first"] for e in job.lines(job.log) if e["what"] == "broken"] == [1]
    (letter,) = cli("dead-letters", "--state", state, "--json")
    assert (letter["key"], letter["kind"]) == ("k", "failed-run"), letter
    assert letter["detail"]["errors"][0]["type"].endswith("ValueError"), letter
    # The signal is with the dead letter, as an abandoned run's is, not pending.
    assert [(g["name"], g["value"]) for g in letter["detail"]["signals"]] == [("go", 1)]
    assert status()["pending_signals"] == []
    (error,) = job.lines(job.output)  # the run's error record, and no output
    assert error["output"] is None and error["error"]["type"].endswith("ValueError"), error

    send(2)  # sent after the failure: the redriven run must still take 1 first
    del job.env["WAITS_BROKEN"]  # the fix
    if workers != "1":  # asked while the job runs: admitted at a look, by k's shard's worker
        job.write({"key": "j"})  # in the other shard: its run waiting says the job runs
        again = job.start("--follow", *after)
        until("j's run waiting", lambda: [w["key"] for w in job.waiting()] == ["j"], again)
        if workers == "1 then 2":  # re-sharded: numbered here in the order sent
            (later,) = status()["pending_signals"]
            (moved,) = cli("dead-letters", "--state", state, "--json")
            assert moved["detail"]["signals"][0]["id"] < later["id"], (moved, later)
        cli("redrive", "--state", state, "--key", "k")
        until("the redriven run done", lambda: len(job.outputs()) == 2, again)
        send(5, "j")
        send(6, "j")
        until("j's run done", lambda: len(job.outputs()) == 3, again)
        again.send_signal(signal.SIGTERM)
        finish(again)
    else:  # asked while the job is stopped: admitted when it starts
        cli("redrive", "--state", state, "--key", "k")
        finish(job.start(*after))
    got = {o["key"]: o["got"] for o in job.outputs() if o is not None}
    assert got == ({"k": [1, 2]} if workers == "1" else {"k": [1, 2], "j": [5, 6]}), got
    s = status()
    assert s["waiting"] == [] and s["pending_signals"] == [], s
    (letter,) = cli("dead-letters", "--state", state, "--json")
    assert [g["value"] for g in letter["detail"]["signals_put_back"]] == [1], letter
    assert letter["redriven_as"] is not None and "signals" not in letter["detail"], letter
    if workers != "1":
        assert letter.get("shard") == f"{shard_of('k', 2)}-of-2", letter


def retry_recorded(state: Path) -> bool:
    """Whether the state holds a failed attempt's retry record (`ratchet.retry`)."""
    db = state / "ratchet.db"
    if not db.exists():
        return False
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        found = conn.execute("SELECT 1 FROM calls WHERE fn = 'ratchet.retry'").fetchone()
    finally:
        conn.close()
    return found is not None


def test_an_action_killed_while_it_waits_to_retry_gets_its_signal_back_once(
    tmp_path: Path,
) -> None:
    """An action with a retry policy takes "go" and fails; its retry waits 2 s, and the job is
    SIGKILLed during that wait. The signal the failed attempt took went back before the retry
    was recorded: pending again after the kill, with its id, and the restarted job's retried
    attempt gets it, once, and outputs it once. Before the fix it stayed with the failed
    attempt's record, never read again: the retried attempt waited for ever."""
    job = Job(tmp_path, "RetriedWait")  # waits for "go", fails once, waits for "go" again
    job.env["WAITS_RETRY_DELAY"] = "2"
    job.write({"key": "k"})
    state = str(job.state)

    def cli(*args: str) -> Any:
        done = job.run_cli(*args)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout) if "--json" in args else done.stdout

    def status() -> dict[str, Any]:
        return dict(cli("status", "--state", state, "--json"))

    first = job.start("--follow")
    until("the run waiting", lambda: [w["on"] for w in job.waiting()] == ["signal go"], first)
    sent = cli("signal", "--state", state, "--key", "k", "go", "--value", "7", "--json")
    until("the retry recorded", lambda: retry_recorded(job.state), first)
    kill(first)  # during the 2 s backoff
    assert job.outputs() == []
    assert [(e["what"], e["value"]) for e in job.lines(job.log)] == [("got", 7)]
    (back,) = status()["pending_signals"]  # given back, as it was sent
    assert (back["id"], back["key"], back["name"]) == (sent["id"], "k", "go"), (back, sent)

    again = job.start("--follow")
    until("the output", job.outputs, again)
    again.send_signal(signal.SIGTERM)
    finish(again)
    assert job.outputs() == [{"key": "k", "got": 7}]
    got = [e for e in job.lines(job.log) if e["what"] == "got"]
    assert [e["value"] for e in got] == [7, 7], got  # once per attempt
    assert got[0]["pid"] == first.pid and got[1]["pid"] != first.pid, got
    s = status()
    assert s["waiting"] == [] and s["pending_signals"] == [], s
