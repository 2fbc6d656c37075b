"""Pause, don't burn, for chat models (docs/chat.md): a real `ratchet run` over 500 inputs asks
a local OpenAI-compatible server through the real `openai` SDK. The server answers 503 for
a few seconds in the middle (the job is SIGKILLed during that outage), later answers 429 with
a Retry-After (the job is SIGKILLed during that backoff). Afterwards: no error output, every
input answered exactly once, and `ratchet status` showed the pause while it lasted. A 400
still fails its run at once: exit 4."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from chat._chat_wire import OpenAIServer
from ratchet.agents.chat import ScriptedChatModel

pytestmark = pytest.mark.kill

AGENT = f"{Path(__file__).with_name('chat_outage_agent.py')}:Answerer"
RATCHET = [sys.executable, "-m", "ratchet.cli"]


class FailingServer(OpenAIServer):
    """The test's OpenAI server, which can be taken down (every request 503), throttled (the
    next requests 429 with Retry-After: 1), or made to refuse every request (400)."""

    def __init__(self) -> None:
        super().__init__(ScriptedChatModel(respond=lambda msgs: f"A: {msgs[-1].content}"))
        self.down = threading.Event()
        self.reject = threading.Event()
        self.throttle = 0
        self.refused = 0
        self.throttled = 0

    def _handle(
        self, path: str, headers: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        json_ = {"content-type": "application/json"}
        with self._lock:
            if self.reject.is_set():
                self.refused += 1
                return 400, json_, self.error_body(400, "invalid request")
            if self.down.is_set():
                self.refused += 1
                return 503, json_, self.error_body(503, "service unavailable")
            if self.throttle > 0:
                self.throttle -= 1
                self.throttled += 1
                return 429, {**json_, "retry-after": "1"}, self.error_body(429, "slow down")
        return super()._handle(path, headers, raw)


def wait(what: str, check: Any, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def read_outputs(output: Path) -> list[dict[str, Any]]:
    if not output.exists():
        return []
    return [json.loads(x) for x in output.read_text().splitlines() if x.endswith("}")]


@pytest.mark.slow
def test_a_provider_outage_and_a_429_pause_the_stream_across_kills(tmp_path: Path) -> None:
    with FailingServer() as server:
        inputs, output, state = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "state"
        inputs.write_text(
            "".join(json.dumps({"key": f"k{i % 20}", "n": i}) + "\n" for i in range(500))
        )
        env = dict(os.environ, CHAT_SERVER=server.url)
        cmd = [*RATCHET, "run", AGENT, "--input", str(inputs), "--output", str(output),
               "--state", str(state), "--checkpoint-interval", "50"]  # fmt: skip

        def outputs() -> list[dict[str, Any]]:
            return read_outputs(output)

        def status() -> dict[str, Any]:
            done = subprocess.run(
                [*RATCHET, "status", "--state", str(state), "--json"],
                capture_output=True, text=True, env=env, timeout=60,
            )  # fmt: skip
            return dict(json.loads(done.stdout)) if done.returncode == 0 else {}

        def start() -> subprocess.Popen[str]:
            return subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )

        def kill(job: subprocess.Popen[str]) -> None:
            job.send_signal(signal.SIGKILL)
            job.communicate(timeout=30)

        # 1. An outage in the middle: 503s past the RetryPolicy -> paused, not errors.
        job = start()
        wait("the first 150 outputs", lambda: len(outputs()) >= 150)
        server.down.set()
        began = time.monotonic()
        wait("the pause to show in status", lambda: status().get("paused"))
        paused = status()["paused"][0]
        assert paused["resource"] == f"chat:openai:{server.url}/v1", paused
        assert paused["next_probe"] >= paused["since"]
        assert "503" in paused["error"], paused
        assert [o for o in outputs() if "error" in o] == []
        kill(job)  # killed during the outage
        refused = server.refused
        job = start()
        wait(
            "the restarted job to probe and pause",
            lambda: server.refused > refused and status().get("paused"),
        )
        assert [o for o in outputs() if "error" in o] == []
        # The scenario: an outage of at least 3 s (not an assertion on time).
        time.sleep(max(0.0, 3.0 - (time.monotonic() - began)))
        assert [o for o in outputs() if "error" in o] == []
        server.down.clear()  # the provider is back

        # 2. A 429 with Retry-After: kill the job while it waits it out.
        wait("300 outputs", lambda: len(outputs()) >= 300)
        server.throttle = 40
        wait("a 429", lambda: server.throttled > 0)
        kill(job)  # killed during the backoff
        job = start()
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, err

        got = outputs()
        assert [o for o in got if "error" in o] == []
        answered = sorted(int(o["output"]["answer"].rsplit(" ", 1)[1]) for o in got)
        assert answered == list(range(500))  # each exactly once
        assert server.throttled > 0 and server.refused > 0
        assert status()["paused"] == []


def test_a_400_still_fails_the_run_at_once(tmp_path: Path) -> None:
    with FailingServer() as server:
        server.reject.set()
        inputs, output, state = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "state"
        inputs.write_text("".join(json.dumps({"key": f"k{i}", "n": i}) + "\n" for i in range(3)))
        done = subprocess.run(
            [*RATCHET, "run", AGENT, "--input", str(inputs), "--output", str(output),
             "--state", str(state)],
            capture_output=True, text=True, env=dict(os.environ, CHAT_SERVER=server.url),
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 4, done.stderr
        got = read_outputs(output)
        assert len(got) == 3 and all("HTTP 400" in json.dumps(o["error"]) for o in got), got
        assert server.refused == 3  # one request per input: not retried, not paused
