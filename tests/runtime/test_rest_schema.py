"""Schemathesis against the live /openapi.json of a supervised job on 127.0.0.1: generated
requests to every endpoint get no 5xx, and every answer conforms to the document (status
code, content type, headers, body schema)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed")
hypothesis = pytest.importorskip("hypothesis")

AGENT_SRC = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Echo(Agent):
    @action(InputEvent, inline=True)
    def echo(self, event, ctx):
        if event.input.get("fail"):
            raise ValueError("a dead letter for the redrive endpoint")
        ctx.send_event(OutputEvent(output=event.input))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TOKEN = "schema-test-token"


@pytest.fixture(scope="module", params=[None, TOKEN], ids=["open", "token"])
def live_job(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A supervised job on 127.0.0.1, without and with a bearer token."""
    token: str | None = request.param
    tmp = tmp_path_factory.mktemp("schema")
    (tmp / "agent.py").write_text(AGENT_SRC)
    (tmp / "in.jsonl").write_text('{"key": "a"}\n{"key": "b", "fail": true}\n')
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RATCHET_REST_TOKEN"}
    auth = {}
    if token is not None:
        env["RATCHET_REST_TOKEN"] = token
        auth = {"Authorization": f"Bearer {token}"}
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", f"{tmp / 'agent.py'}:Echo",
        "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl"),
        "--state", str(tmp / "state"), "--supervise", "--follow", "--rest-port", str(port),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:  # until a worker has reported: the 503 answers are covered by the spec too
            try:
                ask = urllib.request.Request(f"{base}/v1/job", headers=auth)
                with urllib.request.urlopen(ask, timeout=2) as resp:
                    if json.loads(resp.read())["state"] == "running":
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the supervised job never reported running"
            assert proc.poll() is None, "the supervised job exited"
            time.sleep(0.05)
        yield base, token
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        assert b"Traceback" not in err, err.decode()  # no server error was logged either


@pytest.fixture(scope="module")
def api_schema(live_job: tuple[str, str | None]) -> Any:
    return schemathesis.openapi.from_url(f"{live_job[0]}/openapi.json")


# schemathesis.pytest.from_fixture() does not work with pytest 9 (it sets Node._nodeid): the
# schema's Hypothesis strategy over all operations is driven directly instead.
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_every_endpoint_conforms_to_its_openapi_document(
    api_schema: Any, live_job: tuple[str, str | None], mode: str
) -> None:
    from schemathesis import GenerationMode

    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 15

    @hypothesis.settings(
        max_examples=60,
        deadline=None,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        derandomize=True,
    )
    @hypothesis.given(case=api_schema.as_strategy(generation_mode=generation))
    def check(case: Any) -> None:
        # All default checks: not_a_server_error, status_code_conformance,
        # content_type_conformance, response_schema_conformance, negative data rejected, ...
        case.call_and_validate(headers=headers)

    token = live_job[1]
    headers = {"Authorization": f"Bearer {token}"} if token is not None else None
    check()


def test_the_document_describes_every_endpoint(live_job: tuple[str, str | None]) -> None:
    with urllib.request.urlopen(f"{live_job[0]}/openapi.json", timeout=5) as resp:
        spec = json.loads(resp.read())
    assert set(spec["paths"]) == {
        "/v1/job",
        "/v1/job/checkpoints",
        "/v1/job/config",
        "/v1/job/metrics",
        "/metrics",
        "/v1/keys/{key}/signals/{name}",
        "/v1/dead-letters/redrive",
        "/v1/job/history",
        "/v1/keys",
        "/v1/keys/{key}/memory",
        "/v1/keys/{key}/runs",
        "/v1/keys/{key}/runs/{seq}/trace",
        "/v1/runs",
        "/v1/dead-letters",
        "/v1/approvals",
    }
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            assert operation.get("summary"), (method, path)
            assert any(code.startswith("2") for code in operation["responses"]), (method, path)
            for answer in operation["responses"].values():
                assert answer.get("content"), (method, path)  # every answer has a body schema
            if method == "post":
                assert operation["requestBody"]["required"] is True, path


def test_a_newer_client_reads_an_older_supervisors_job_and_config() -> None:
    """`ratchet status --url` of this version against a supervisor started before
    restarts_counted and the restart strategy's reset and doubling fields existed (a job
    left running across an upgrade): read, not refused as an unexpected body."""
    from ratchet.runtime._rest import JobConfig, JobInfo

    info = JobInfo.model_validate(
        {"state": "running", "worker_pid": 12, "resource_id": "r", "restarts": 3,
         "uptime_seconds": 5.0, "worker_uptime_seconds": 1.0, "last_exit": None,
         "in_flight_runs": 0, "queued_inputs": 0}
    )  # fmt: skip
    assert info.restarts == 3 and info.restarts_counted is None
    config = JobConfig.model_validate(
        {"checkpoint_interval_ms": 200.0, "tolerable_checkpoint_failures": 0,
         "max_concurrent_runs": 64, "max_buffered_inputs": 1024, "state_dir": "/s",
         "engine": {}, "restart_strategy": {"type": "fixed-delay", "attempts": 10,
                                            "delay_seconds": 1.0}}
    )  # fmt: skip
    assert config.restart_strategy.type == "fixed-delay"
    assert config.restart_strategy.reset_after_seconds is None
