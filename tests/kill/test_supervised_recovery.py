"""End-to-end: a supervised job's worker is SIGKILLed while a tool call is parked; the
replacement restores memory (a raw `bytes` value) and the tool-call context.

The flow follows the Flink Agents recovery e2e (see shared/reference): the agent publishes a
verdict; the test passes only on `"verdict": "pass"`. Two controls show the harness can fail:
creating `release` before the kill fails at checkpoint containment; skipping the kill fails
at restore. Every REST read is bounded and validated: an empty body, bad JSON, a missing
field or a wrong type is an error, never a false condition.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic import BaseModel, ValidationError

from ratchet.runtime._rest import CheckpointStatistics, JobConfig, JobInfo

pytestmark = pytest.mark.kill

AGENT = f"{Path(__file__).with_name('recovery_agent.py')}:RecoveryAgent"
M = TypeVar("M", bound=BaseModel)


class FlowFailure(AssertionError):
    """The flow stopped at a named stage; controls assert on the stage."""

    def __init__(self, stage: str, detail: str) -> None:
        super().__init__(f"[{stage}] {detail}")
        self.stage = stage


def read(url: str, model: type[M], timeout: float = 2.0) -> M:
    """GET and validate; anything malformed raises (it never reads as a false condition)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise ValueError(f"GET {url}: HTTP {resp.status}")
    if not body:
        raise ValueError(f"GET {url}: empty body")
    return model.model_validate_json(body)


def poll(what: str, stage: str, deadline: float, fn: Callable[[], Any]) -> Any:
    """Call fn until it returns a truthy value; REST errors are retried, not taken as False."""
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = fn()
        except (OSError, ValueError, ValidationError, urllib.error.URLError) as exc:
            last = exc
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise FlowFailure(stage, f"timed out waiting for {what} (last read error: {last!r})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_file(path: Path, stage: str, deadline: float) -> None:
    poll(f"{path.name}", stage, deadline, path.exists)


def recovery_flow(
    tmp: Path, *, release_before_kill: bool = False, skip_kill: bool = False
) -> dict[str, Any]:
    hand = tmp / "handshake"
    hand.mkdir()
    (tmp / "in.jsonl").write_text(json.dumps({"key": "ticket-1", "text": "hello"}) + "\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", AGENT,
        "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl"),
        "--state", str(tmp / "state"), "--follow", "--checkpoint-interval", "100",
        "--supervise", "--rest-port", str(port), "--restart-delay", "0.2",
    ]  # fmt: skip
    env = dict(os.environ, E2E_DIR=str(hand))
    with open(tmp / "supervisor.log", "wb") as log:
        sup = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
    try:
        return _flow(tmp, hand, base, sup, release_before_kill, skip_kill)
    finally:
        if sup.poll() is None:
            sup.send_signal(signal.SIGTERM)
            try:
                sup.wait(timeout=20)
            except subprocess.TimeoutExpired:
                sup.kill()
                sup.wait()


def _flow(
    tmp: Path,
    hand: Path,
    base: str,
    sup: subprocess.Popen[bytes],
    release_before_kill: bool,
    skip_kill: bool,
) -> dict[str, Any]:
    start = time.monotonic()
    # 1. The interval comes from the running job, not from this test's command line.
    config = poll(
        "job config", "config", start + 20, lambda: read(f"{base}/v1/job/config", JobConfig)
    )
    interval = config.checkpoint_interval_ms / 1000.0
    if interval <= 0:
        raise FlowFailure(
            "config", f"checkpointing is off (interval {config.checkpoint_interval_ms} ms)"
        )
    # Budgets in checkpoint intervals, clamped: the tool must be released well within them.
    wait = max(10.0, 50 * interval)

    # 2. The tool is entered and parks.
    wait_file(hand / "tool-entered", "tool-entered", start + 20)
    if release_before_kill:
        (hand / "release").write_text("early")
        wait_file(tmp / "out.jsonl", "early-output", time.monotonic() + wait)

    # 3. Two more completed checkpoints after a baseline read now, with the run in them.
    baseline = read(f"{base}/v1/job/checkpoints", CheckpointStatistics).counts.completed
    poll(
        "two checkpoints past the baseline",
        "checkpoints",
        time.monotonic() + wait,
        lambda: (
            read(f"{base}/v1/job/checkpoints", CheckpointStatistics).counts.completed
            >= baseline + 2
        ),
    )
    job = read(f"{base}/v1/job", JobInfo)
    if not job.in_flight_runs:
        raise FlowFailure(
            "checkpoint-containment",
            f"the latest checkpoints hold no in-flight run (in_flight_runs={job.in_flight_runs})",
        )
    stats = read(f"{base}/v1/job/checkpoints", CheckpointStatistics)
    before = {"pid": job.worker_pid, "resource": job.resource_id, "restored": stats.counts.restored}

    # 4. SIGKILL the worker; wait for a replacement and for a restore.
    if not skip_kill:
        assert job.worker_pid is not None
        os.kill(job.worker_pid, signal.SIGKILL)

    def replaced() -> JobInfo | None:
        j = read(f"{base}/v1/job", JobInfo)
        ok = j.state == "running" and j.worker_pid not in (None, before["pid"])
        return j if ok and j.resource_id != before["resource"] else None

    budget = time.monotonic() + (3.0 if skip_kill else wait)
    after_job = poll("a replacement worker", "restore", budget, replaced)

    def restored() -> CheckpointStatistics | None:
        s = read(f"{base}/v1/job/checkpoints", CheckpointStatistics)
        rose = s.counts.restored > before["restored"]
        present = s.latest.restored is not None
        if rose != present and not (present and not rose):
            raise FlowFailure(
                "restore", f"counts.restored rose but latest.restored is {s.latest.restored}"
            )
        if present and not rose:
            return None  # an older restore: keep waiting for this one
        return s if rose and present else None

    after = poll("a restore", "restore", budget, restored)
    if after.counts.restored <= before["restored"] or after.latest.restored is None:
        raise FlowFailure("restore", "counts.restored and latest.restored disagree")

    # 5. Release the tool; the agent publishes its verdict.
    (hand / "release").write_text("go")
    wait_file(hand / "verdict.json", "verdict", time.monotonic() + wait)
    verdict = json.loads((hand / "verdict.json").read_text())
    outputs = poll(
        "the output", "output", time.monotonic() + wait, lambda: _lines(tmp / "out.jsonl")
    )
    return {
        "verdict": verdict,
        "before": before,
        "after_pid": after_job.worker_pid,
        "after_resource": after_job.resource_id,
        "restored": after.counts.restored,
        "outputs": outputs,
        "interval": interval,
    }


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_killed_worker_is_replaced_and_memory_and_tool_context_survive(tmp_path: Path) -> None:
    result = recovery_flow(tmp_path)
    assert result["verdict"]["verdict"] == "pass", result["verdict"]
    assert result["verdict"]["blob_type"] == "bytes"
    assert result["after_pid"] != result["before"]["pid"]
    assert result["after_resource"] != result["before"]["resource"]
    assert result["restored"] > result["before"]["restored"]
    (out,) = result["outputs"]  # exactly one output
    assert out["output"]["verdict"] == "pass"


def test_negative_control_release_before_kill_fails_at_checkpoint_containment(
    tmp_path: Path,
) -> None:
    with pytest.raises(FlowFailure) as info:
        recovery_flow(tmp_path, release_before_kill=True)
    assert info.value.stage == "checkpoint-containment"


def test_provenance_control_without_a_kill_fails_at_restore(tmp_path: Path) -> None:
    with pytest.raises(FlowFailure) as info:
        recovery_flow(tmp_path, skip_kill=True)
    assert info.value.stage == "restore"


# -- the REST reader itself: malformed answers are errors -----------------------------------


@pytest.fixture
def bad_server() -> Iterator[tuple[str, dict[str, bytes]]]:
    bodies: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = bodies[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()


GOOD_COUNTS = {"completed": 3, "failed": 0, "in_progress": 0, "restored": 1, "total": 3}


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{not json",
        json.dumps({"latest": {"completed": None, "failed": None, "restored": None}}).encode(),
        json.dumps(
            {
                "counts": dict(GOOD_COUNTS, restored="one"),
                "latest": {"completed": None, "failed": None, "restored": None},
            }
        ).encode(),
    ],
    ids=["empty", "bad-json", "missing-field", "wrong-type"],
)
def test_rest_reads_fail_on_malformed_answers(
    bad_server: tuple[str, dict[str, bytes]], body: bytes
) -> None:
    base, bodies = bad_server
    bodies["/v1/job/checkpoints"] = body
    with pytest.raises((ValueError, ValidationError)):
        read(f"{base}/v1/job/checkpoints", CheckpointStatistics)
    with pytest.raises(FlowFailure, match="timed out"):
        poll(
            "restored",
            "restore",
            time.monotonic() + 0.3,
            lambda: read(f"{base}/v1/job/checkpoints", CheckpointStatistics).counts.restored > 0,
        )


def test_rest_reader_accepts_a_well_formed_answer(bad_server: tuple[str, dict[str, bytes]]) -> None:
    base, bodies = bad_server
    bodies["/v1/job/checkpoints"] = json.dumps(
        {"counts": GOOD_COUNTS, "latest": {"completed": None, "failed": None, "restored": None}}
    ).encode()
    assert read(f"{base}/v1/job/checkpoints", CheckpointStatistics).counts.restored == 1
