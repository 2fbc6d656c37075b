"""`ratchet run --supervise`: clean stops, bounded restarts, errors that a restart cannot fix."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ratchet.store._sqlite import SqliteStore
from support.rest import free_port, get

AGENT_SRC = """
import os
from ratchet import Agent, InputEvent, OutputEvent, action

class Echo(Agent):
    @action(InputEvent, inline=True)
    def echo(self, event, ctx):
        if event.input.get("die"):
            os._exit(9)  # the worker dies on this input, every time
        ctx.send_event(OutputEvent(output=event.input))
"""


def supervised(tmp: Path, lines: list[dict[str, Any]], *extra: str) -> subprocess.Popen[bytes]:
    (tmp / "agent.py").write_text(AGENT_SRC)
    (tmp / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", f"{tmp / 'agent.py'}:Echo",
        "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl"),
        "--state", str(tmp / "state"), "--supervise", *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_running(port: int, timeout: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            job = get(port, "/v1/job")
            if job["state"] == "running":
                return job  # type: ignore[no-any-return]
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("the supervised job never reported running")


def test_sigterm_stops_cleanly_with_a_final_checkpoint(tmp_path: Path) -> None:
    port = free_port()
    proc = supervised(tmp_path, [{"key": "a"}, {"key": "b"}], "--follow", "--rest-port", str(port))
    try:
        job = wait_running(port)
        assert job["restarts"] == 0 and job["restarts_counted"] == 0
        assert job["worker_pid"] and job["resource_id"]
        spec = get(port, "/openapi.json")
        assert {"/v1/job", "/v1/job/checkpoints", "/v1/job/config"} <= set(spec["paths"])
        config = get(port, "/v1/job/config")
        # What it does: the delay doubles while a server cannot be reached, and the count
        # starts again after 600 s of running (it said "fixed-delay", which it is not).
        assert config["restart_strategy"] == {
            "type": "fixed-delay-with-reset",
            "attempts": 10,
            "delay_seconds": 1.0,
            "reset_after_seconds": 600.0,
            "unreachable_delay_factor": 2.0,
            "unreachable_max_delay_seconds": 30.0,
        }
        assert config["checkpoint_interval_ms"] == 200.0
        assert "/v1/job/metrics" in spec["paths"]
        assert isinstance(get(port, "/v1/job/metrics")["counters"], dict)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    store = SqliteStore.open_readonly(tmp_path / "state")
    try:
        assert store.summary()["checkpoints"]["counts"]["completed"] >= 1
    finally:
        store.close()


def test_restarts_are_bounded_by_the_strategy(tmp_path: Path) -> None:
    proc = supervised(
        tmp_path, [{"key": "a", "die": True}], "--restart-attempts", "2", "--restart-delay", "0"
    )
    _, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode == 1, text
    assert text.count("worker died (exit code 9)") == 3
    assert "ratchet: worker died (exit code 9); restart 1/2 in 0 s\n" in text  # text: as before
    assert "restart 1/2" in text and "restart 2/2" in text
    assert "the 2 restart attempts are used up" in text


def test_json_logs_carry_the_supervisor_s_own_lines(tmp_path: Path) -> None:
    """With --log-format json the REST address, each death and restart and the give-up are
    JSON records like the worker's (they were plain `ratchet: ...` lines among them)."""
    pytest.importorskip("uvicorn", reason="--rest-port needs the server extra")
    proc = supervised(
        tmp_path, [{"key": "a", "die": True}], "--restart-attempts", "1", "--restart-delay",
        "0", "--rest-port", "0", "--log-format", "json",
    )  # fmt: skip
    _, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode == 1, text
    records = [json.loads(line) for line in text.splitlines()]  # every line is JSON
    mine = [(r["level"], r["message"]) for r in records if r["logger"].startswith("ratchet.sup")]
    assert mine[0][0] == "info" and mine[0][1].startswith("REST API on http://127.0.0.1:")
    assert mine[1:] == [
        ("warning", "worker died (exit code 9); restart 1/1 in 0 s"),
        ("error", "worker died (exit code 9) and the 1 restart attempts are used up; the state "
         "directory keeps the last checkpoint"),
    ], mine  # fmt: skip
    assert all(r["pid"] == proc.pid for r in records if r["logger"].startswith("ratchet.sup"))


def test_an_error_a_restart_cannot_fix_is_not_restarted(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "ratchet.db").write_bytes(b"not a database at all" * 100)
    proc = supervised(tmp_path, [{"key": "a"}])
    _, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode == 2, text
    assert "is corrupted or not a ratchet state database" in text
    assert "not restarting" in text and "restart 1/" not in text


def test_a_second_supervisor_on_one_state_directory_is_refused(tmp_path: Path) -> None:
    port = free_port()
    first = supervised(tmp_path, [{"key": "a"}], "--follow", "--rest-port", str(port))
    try:
        wait_running(port)
        second = supervised(tmp_path, [{"key": "a"}])
        _, err = second.communicate(timeout=30)
        assert second.returncode == 2
        assert "in use by pid" in err.decode() and "supervisor.lock" in err.decode()
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=20)
        assert first.stderr is not None
        first.stderr.close()


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status  # exited; waiting to be reaped by whoever adopted it


def test_a_worker_does_not_outlive_a_killed_supervisor(tmp_path: Path) -> None:
    port = free_port()
    proc = supervised(tmp_path, [{"key": "a"}], "--follow", "--rest-port", str(port))
    try:
        worker = wait_running(port)["worker_pid"]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 15
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker), "the worker kept running after its supervisor was killed"
    finally:
        assert proc.stderr is not None
        proc.stderr.close()
    # It stopped cleanly: its final checkpoint holds the input's output.
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 1


def _children(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().strip()
    except OSError:
        return ""


@pytest.mark.parametrize("moment", ["rest-api-starting", "worker-starting"])
def test_sigterm_early_in_the_supervisor_stops_it_cleanly(tmp_path: Path, moment: str) -> None:
    """SIGTERM while the supervisor started its worker hung it for good (its handler waited
    on a lock the interrupted code held); while the REST API started, the worker started
    anyway; while the worker imported, the supervisor exited 1."""
    port = free_port()
    proc = supervised(tmp_path, [{"key": "a"}], "--follow", "--rest-port", str(port))
    try:
        deadline = time.monotonic() + 30
        if moment == "rest-api-starting":
            while not (tmp_path / "state" / "supervisor.lock").exists():
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.002)
        else:
            while not _children(proc.pid):
                assert time.monotonic() < deadline and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"Traceback" not in err


def test_rest_port_0_prints_the_port_it_got(tmp_path: Path) -> None:
    """It printed `http://127.0.0.1:0/v1/job`."""
    import re

    proc = supervised(tmp_path, [{"key": "a"}], "--follow", "--rest-port", "0")
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline().decode()
        found = re.search(r"REST API on http://127\.0\.0\.1:(\d+)/v1/job", line)
        assert found and int(found[1]) != 0, line
        assert wait_running(int(found[1]))["state"] == "running"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_status_url_takes_the_address_the_supervisor_printed(tmp_path: Path) -> None:
    """`ratchet status --url http://127.0.0.1:PORT/v1/job` (as printed) asked
    .../v1/job/v1/job and failed with a 404."""
    import re

    proc = supervised(tmp_path, [{"key": "a"}], "--follow", "--rest-port", "0")
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline().decode()
        found = re.search(r"REST API on (http://127\.0\.0\.1:(\d+))/v1/job", line)
        assert found, line
        base = found[1]
        assert f"`ratchet status --url {base}`" in line
        wait_running(int(found[2]))
        for url in (f"{base}/v1/job", f"{base}/v1/job/", base, f"{base}/"):
            status = subprocess.run(
                [sys.executable, "-m", "ratchet.cli", "status", "--url", url, "--json"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert status.returncode == 0, (url, status.stderr)
            assert json.loads(status.stdout)["job"]["state"] == "running", url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_rest_host_is_printed_in_brackets(tmp_path: Path, host: str) -> None:
    """`--rest-host ::1` printed http://::1:PORT/..., which neither a browser nor curl takes
    (and `[::1]`, as a URL has it, could not be listened on)."""
    import re
    import socket
    import urllib.request

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    proc = supervised(tmp_path, [{"key": "a"}], "--follow", "--rest-port", "0", "--rest-host", host)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline().decode()
        found = re.search(r"REST API on (http://\[::1\]:\d+)/v1/job, dashboard on (\S+) ", line)
        assert found and found[2] == f"{found[1]}/", line
        assert f"`ratchet status --url {found[1]}`" in line
        deadline = time.monotonic() + 20
        while True:  # the address as printed is one a client takes
            try:
                with urllib.request.urlopen(f"{found[1]}/v1/job", timeout=2) as resp:
                    if json.loads(resp.read())["state"] == "running":
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, line
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_a_rest_port_in_use_is_one_line_and_nothing_is_created(tmp_path: Path) -> None:
    """It was uvicorn's `[Errno 98] ... address already in use`, a ratchet line that did not
    say why, and a state directory holding only the supervisor's lock."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = supervised(tmp_path, [{"key": "a"}], "--rest-port", str(port))
        _, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode == 2, text
    assert text.splitlines() == [
        f"ratchet: error: --rest-port {port} is already in use on 127.0.0.1: give another port "
        f"(--rest-port 0 picks a free one), or stop what listens on it (another supervised "
        f"job?)"
    ], text
    assert not (tmp_path / "state").exists()
