"""A supervised job's `GET /metrics` (Prometheus) and its REST bearer token, end to end.

Real `ratchet run --supervise --rest-port P` processes on free loopback ports; every wait is a
poll with a deadline, never a timed assertion.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="prometheus-client is not installed (the server extra)"
)

AGENT_SRC = """
import os
from pathlib import Path
from ratchet import Agent, InputEvent, OutputEvent, action
from ratchet.agents.chat import (
    ChatAgent, ChatMessage, ChatModelSetup, ChatRequestEvent, ChatResponseEvent,
    ScriptedChatModel, chat_model_setup,
)

class Echo(Agent):
    @action(InputEvent, inline=True)
    def echo(self, event, ctx):
        ctx.metrics.inc("echo.seen")
        marker = event.input.get("die_once")
        if marker and not Path(marker).exists():
            Path(marker).write_text("died")
            os._exit(9)  # the worker dies on this input, the first time only
        if event.input.get("fail"):
            raise ValueError("this run ends in error")
        ctx.send_event(OutputEvent(output=event.input))

class Chat(ChatAgent):
    @chat_model_setup
    @staticmethod
    def small():
        return ChatModelSetup(ScriptedChatModel(respond=lambda msgs: "a fairly short answer"))

    @chat_model_setup
    @staticmethod
    def large():
        return ChatModelSetup(ScriptedChatModel(respond=lambda msgs: "short"))

    @action(InputEvent)
    @staticmethod
    def ask(event, ctx):
        ctx.send_event(
            ChatRequestEvent(model=event.input["model"], messages=[ChatMessage.user("one two")])
        )

    @action(ChatResponseEvent)
    @staticmethod
    def answer(event, ctx):
        ctx.send_event(OutputEvent(output=event.messages[-1].content))
"""

TOKEN = "s3cret-t0ken-for-tests"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request(
    port: int,
    method: str,
    path: str,
    token: str | None = None,
    body: Any = None,
) -> tuple[int, bytes, dict[str, str]]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def get_json(port: int, path: str, token: str | None = None) -> Any:
    status, body, _ = request(port, "GET", path, token)
    if status != 200:
        raise ValueError(f"GET {path}: HTTP {status}: {body[:200]!r}")
    return json.loads(body)


def scrape(port: int, token: str | None = None) -> dict[str, float]:
    """GET /metrics, parsed by prometheus_client: sample name{labels} -> value."""
    status, body, headers = request(port, "GET", "/metrics", token)
    if status != 200:
        raise ValueError(f"GET /metrics: HTTP {status}")
    assert headers["content-type"].startswith("text/plain")
    samples: dict[str, float] = {}
    for family in prometheus_parser.text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def poll(what: str, fn: Callable[[], Any], timeout: float = 30) -> Any:
    """Call fn until it returns a truthy value; connection and HTTP errors are retried."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = fn()
        except (OSError, ValueError, KeyError) as exc:
            last, value = exc, None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")


def write_job(tmp: Path, lines: list[dict[str, Any]]) -> None:
    (tmp / "agent.py").write_text(AGENT_SRC)
    (tmp / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def start(
    tmp: Path, agent: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", f"{tmp / 'agent.py'}:{agent}",
        "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl"),
        "--state", str(tmp / "state"), "--supervise", "--follow", *extra,
    ]  # fmt: skip
    child_env = {k: v for k, v in os.environ.items() if k != "RATCHET_REST_TOKEN"}
    child_env.update(env or {})
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env)


def stop(proc: subprocess.Popen[bytes]) -> str:
    """SIGTERM, then the supervisor's stderr (a clean stop exits 0)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err.decode()


def output_lines(tmp: Path) -> int:
    out = tmp / "out.jsonl"
    return len(out.read_text().splitlines()) if out.exists() else 0


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[Path, int, subprocess.Popen[bytes]]]:
    """Six inputs: five echoed, one ends in error (an error output and a dead letter)."""
    lines = [{"key": f"k{i}", "n": i} for i in range(5)] + [{"key": "bad", "fail": True}]
    write_job(tmp_path, lines)
    port = free_port()
    proc = start(tmp_path, "Echo", "--rest-port", str(port))
    yield tmp_path, port, proc
    stop(proc)


def test_metrics_agree_with_the_job_api_and_the_output_file(
    job: tuple[Path, int, subprocess.Popen[bytes]],
) -> None:
    tmp, port, _ = job
    m = poll(
        "all six runs in /metrics",
        lambda: (s := scrape(port)).get("ratchet_runs_completed_total") == 6 and s,
    )
    assert m["ratchet_inputs_total"] == 6
    assert m['ratchet_agent_counter_total{name="echo.seen"}'] == 6
    assert m["ratchet_worker_restarts_total"] == 0
    assert m["ratchet_worker_restarts_counted"] == 0
    assert m["ratchet_worker_up"] == 1
    assert m["ratchet_restore_duration_seconds"] >= 0  # a new state: the start itself
    assert m['ratchet_job_state{state="running"}'] == 1
    # A run that ended in error writes an error output: six lines, one of them an error.
    assert poll("six output lines", lambda: output_lines(tmp) == 6)
    errors = [x for x in (tmp / "out.jsonl").read_text().splitlines() if '"error"' in x]
    assert len(errors) == 1
    if "ratchet_outputs_total" in m:  # reported once Engine.status() carries the result counts
        assert m["ratchet_outputs_total"] == 6
        assert m["ratchet_runs_failed_total"] == 1
        assert m["ratchet_dead_letters_total"] == 1

    def consistent() -> Any:
        """/metrics between two equal reads of /v1/job and its checkpoints (no report between)."""
        before = (get_json(port, "/v1/job"), get_json(port, "/v1/job/checkpoints"))
        s = scrape(port)
        after = (get_json(port, "/v1/job"), get_json(port, "/v1/job/checkpoints"))
        strip = [dict(j, uptime_seconds=0, worker_uptime_seconds=0) for j, _ in (before, after)]
        return strip[0] == strip[1] and before[1] == after[1] and (before, s)

    (job_info, checkpoints), s = poll("a scrape between two equal reports", consistent)
    assert s["ratchet_in_flight_runs"] == job_info["in_flight_runs"]
    assert s["ratchet_buffered_inputs"] == job_info["queued_inputs"]
    assert s["ratchet_waiting_runs"] == len(job_info["waiting"])
    assert s["ratchet_paused_resources"] == len(job_info["paused"])
    counts = checkpoints["counts"]
    assert s["ratchet_checkpoints_completed_total"] == counts["completed"] >= 1
    assert s["ratchet_checkpoints_failed_total"] == counts["failed"]
    assert s["ratchet_checkpoint_restores_total"] == counts["restored"] == 0
    latest = checkpoints["latest"]["completed"]
    assert s["ratchet_checkpoint_last_id"] == latest["id"]
    assert s["ratchet_checkpoint_last_size_bytes"] == latest["size_bytes"]
    # Each completed checkpoint a worker reported is observed once.
    assert 1 <= s["ratchet_checkpoint_duration_seconds_count"] <= counts["completed"]
    assert s["ratchet_checkpoint_duration_seconds_sum"] >= 0
    spec = get_json(port, "/openapi.json")
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_counters_stay_monotonic_across_a_worker_restart(tmp_path: Path) -> None:
    marker = tmp_path / "died-once"
    lines = [{"key": "a"}, {"key": "b"}, {"key": "c", "die_once": str(marker)}, {"key": "d"}]
    write_job(tmp_path, lines)
    port = free_port()
    proc = start(tmp_path, "Echo", "--rest-port", str(port), "--restart-delay", "0")
    try:
        seen: list[dict[str, float]] = []

        def restarted_and_done() -> bool:
            s = scrape(port)
            seen.append(s)
            return (
                s.get("ratchet_worker_restarts_total") == 1
                and s.get("ratchet_runs_completed_total", 0) >= 4
                and get_json(port, "/v1/job")["state"] == "running"
                and output_lines(tmp_path) == 4
            )

        poll("a restart and all four runs", restarted_and_done)
        assert marker.exists()
        for name in (
            "ratchet_inputs_total",
            "ratchet_runs_completed_total",
            'ratchet_agent_counter_total{name="echo.seen"}',
            "ratchet_checkpoints_completed_total",
            "ratchet_checkpoint_duration_seconds_count",
            "ratchet_worker_restarts_total",
        ):
            values = [s[name] for s in seen if name in s]
            assert values == sorted(values), (name, values)  # never decreases
        last = seen[-1]
        # The first worker's counts are kept: at least the four inputs, c's twice or not.
        assert last["ratchet_inputs_total"] >= 4
        assert last['ratchet_agent_counter_total{name="echo.seen"}'] >= 4
        assert get_json(port, "/v1/job")["restarts"] == 1
        # Counted against --restart-attempts until a worker has run 600 s (the default).
        assert last["ratchet_worker_restarts_counted"] == 1
        assert get_json(port, "/v1/job")["restarts_counted"] == 1
        # The replacement worker's start (a restore, or a new state if the first worker died
        # before its first checkpoint): a measured duration.
        assert 0 < last["ratchet_restore_duration_seconds"] < 60
    finally:
        stop(proc)
    out = [json.loads(x)["output"]["key"] for x in (tmp_path / "out.jsonl").read_text().split()]
    assert sorted(out) == ["a", "b", "c", "d"]  # exactly once, across the restart


def test_model_calls_and_tokens_by_model(tmp_path: Path) -> None:
    lines = [{"key": "a", "model": "small"}, {"key": "b", "model": "small"}]
    lines.append({"key": "c", "model": "large"})
    write_job(tmp_path, lines)
    port = free_port()
    proc = start(tmp_path, "Chat", "--rest-port", str(port))
    try:
        s = poll(
            "three chat runs",
            lambda: (m := scrape(port)).get("ratchet_runs_completed_total") == 3 and m,
        )
    finally:
        stop(proc)
    assert s['ratchet_model_calls_total{model="small"}'] == 2
    assert s['ratchet_model_calls_total{model="large"}'] == 1
    assert s['ratchet_model_tokens_total{direction="input",model="small"}'] == 6
    assert s['ratchet_model_tokens_total{direction="input",model="large"}'] == 3
    small_out = s['ratchet_model_tokens_total{direction="output",model="small"}']
    large_out = s['ratchet_model_tokens_total{direction="output",model="large"}']
    assert small_out > 0 and large_out > 0
    # The unlabelled totals agree with the per-model ones.
    assert s['ratchet_agent_counter_total{name="chat.model_calls"}'] == 3
    assert s['ratchet_agent_counter_total{name="chat.tokens.output"}'] == small_out + large_out
    assert output_lines(tmp_path) == 3


ENDPOINTS: list[tuple[str, str, Any, int]] = [
    ("GET", "/v1/job", None, 200),
    ("GET", "/v1/job/checkpoints", None, 200),
    ("GET", "/v1/job/config", None, 200),
    ("GET", "/v1/job/metrics", None, 200),
    ("GET", "/metrics", None, 200),
    ("POST", "/v1/keys/a/signals/go", {"value": 1}, 202),
    ("POST", "/v1/dead-letters/redrive", {"all": True}, 202),
    ("GET", "/v1/job/history", None, 200),
    ("GET", "/v1/keys", None, 200),
    ("GET", "/v1/keys/nobody/memory", None, 404),
    ("GET", "/v1/keys/a/runs", None, 200),
    ("GET", "/v1/keys/a/runs/99/trace", None, 404),
    ("GET", "/v1/runs", None, 200),
    ("GET", "/v1/dead-letters", None, 200),
    ("GET", "/v1/approvals", None, 200),
]


def _check_token_is_required(port: int, token: str) -> None:
    poll(
        "a first worker report",
        lambda: request(port, "GET", "/v1/job/checkpoints", token)[0] == 200,
    )
    for method, path, body, ok in ENDPOINTS:
        status, _, headers = request(port, method, path, None, body)
        assert status == 401, (method, path, status)
        assert headers.get("www-authenticate") == "Bearer"
        assert request(port, method, path, token + "x", body)[0] == 401, (method, path)
        assert request(port, method, path, token[:-1], body)[0] == 401, (method, path)
        assert request(port, method, path, token, body)[0] == ok, (method, path)
    # Only the description of the API stays open; it declares the scheme on every endpoint.
    status, spec_body, _ = request(port, "GET", "/openapi.json")
    assert status == 200
    spec = json.loads(spec_body)
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert len(spec["paths"]) == len(ENDPOINTS)
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            assert operation["security"] == [{"HTTPBearer": []}], path
            assert "401" in operation["responses"], path


def _worker_never_sees(port: int, token: str) -> None:
    pid = get_json(port, "/v1/job", token)["worker_pid"]
    assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert token.encode() not in Path(f"/proc/{pid}/environ").read_bytes()


def _check_guarded_job(proc: subprocess.Popen[bytes], port: int) -> None:
    """A job started with TOKEN: every endpoint needs it, the worker never has it, `status
    --url` needs it too, and the supervisor stops cleanly without printing it."""
    try:
        _check_token_is_required(port, TOKEN)
        _worker_never_sees(port, TOKEN)
        url = f"http://127.0.0.1:{port}"
        cli = [sys.executable, "-m", "ratchet.cli", "status", "--url", url, "--json"]
        refused = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "RATCHET_REST_TOKEN" in refused.stderr
        shown = subprocess.run(
            [*cli, "--rest-token", TOKEN], capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0 and json.loads(shown.stdout)["job"]["state"], shown.stderr
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    assert TOKEN not in err


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_a_token_from_the_environment_guards_every_endpoint(tmp_path: Path) -> None:
    write_job(tmp_path, [{"key": "a"}])
    port = free_port()
    proc = start(tmp_path, "Echo", "--rest-port", str(port), env={"RATCHET_REST_TOKEN": TOKEN})
    _check_guarded_job(proc, port)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_rest_token_flag_guards_every_endpoint_and_stays_out_of_the_worker(
    tmp_path: Path,
) -> None:
    write_job(tmp_path, [{"key": "a"}])
    port = free_port()
    proc = start(
        tmp_path, "Echo", "--rest-port", str(port), "--rest-host", "0.0.0.0", "--rest-token", TOKEN
    )
    _check_guarded_job(proc, port)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_a_non_loopback_host_without_a_token_is_refused_at_start(tmp_path: Path, host: str) -> None:
    write_job(tmp_path, [{"key": "a"}])
    proc = start(tmp_path, "Echo", "--rest-port", str(free_port()), "--rest-host", host)
    _, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode == 2, text
    assert "--rest-token" in text and "RATCHET_REST_TOKEN" in text and host in text
    assert not (tmp_path / "state").exists()  # refused before anything was created


def test_an_empty_token_is_refused(tmp_path: Path) -> None:
    write_job(tmp_path, [{"key": "a"}])
    proc = start(
        tmp_path, "Echo", "--rest-port", str(free_port()), env={"RATCHET_REST_TOKEN": "  "}
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err.decode()
    assert "must not be empty" in err.decode()


def test_a_token_a_header_cannot_carry_is_refused_at_start_and_by_status(tmp_path: Path) -> None:
    # A non-ASCII token could never authenticate (headers are Latin-1; the server compared
    # UTF-8), and `status --url` called it "not a URL".
    write_job(tmp_path, [{"key": "a"}])
    proc = start(
        tmp_path, "Echo", "--rest-port", str(free_port()), "--rest-token", "s\u00e9cret\u20ac"
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err.decode()
    assert "--rest-token" in err.decode() and "printable ASCII" in err.decode(), err.decode()
    assert not (tmp_path / "state").exists()
    status = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "status", "--url", "http://127.0.0.1:9",
         "--rest-token", "caf\u00e9 au lait"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 2, status.stderr
    assert "printable ASCII" in status.stderr and "not a URL" not in status.stderr
    assert "Traceback" not in status.stderr


def test_loopback_needs_no_token(tmp_path: Path) -> None:
    write_job(tmp_path, [{"key": "a"}])
    port = free_port()
    proc = start(tmp_path, "Echo", "--rest-port", str(port), "--rest-host", "localhost")
    try:
        assert poll("a first report", lambda: get_json(port, "/v1/job/checkpoints"))
        assert "ratchet_worker_up 1.0" in request(port, "GET", "/metrics")[1].decode()
    finally:
        stop(proc)


def test_an_unknown_query_parameter_is_refused_not_ignored(tmp_path: Path) -> None:
    write_job(tmp_path, [{"key": "a"}, {"key": "b"}])
    port = free_port()
    proc = start(tmp_path, "Echo", "--rest-port", str(port))
    try:
        assert poll("a first report", lambda: get_json(port, "/v1/job/checkpoints"))
        assert get_json(port, "/v1/keys?limit=1")["keys"] == ["a"]
        status, body, _ = request(port, "GET", "/v1/keys?limt=1&contains=a")  # misspelt
        assert status == 422, body
        assert json.loads(body)["detail"] == [
            {"loc": ["query", "limt"], "msg": "unknown query parameter", "type": "extra_forbidden"}
        ]
        assert request(port, "GET", "/v1/job?verbose=1")[0] == 422  # an endpoint with none
        assert request(port, "GET", "/openapi.json?x=1")[0] == 200  # not an API endpoint
    finally:
        stop(proc)
