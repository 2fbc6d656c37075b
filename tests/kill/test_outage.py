"""A provider outage is a pause, not data loss (docs/runtime.md, "Pause, don't burn"): a real
`ratchet run` over 500 inputs calls a local HTTP service that returns 503 for a few seconds in
the middle; the job is SIGKILLed during the outage. Afterwards: no error output, every input
answered exactly once, and `ratchet status` showed the pause while it lasted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.kill

AGENT = f"{Path(__file__).with_name('outage_agent.py')}:Scorer"
RATCHET = [sys.executable, "-m", "ratchet.cli"]


class Service:
    """A scoring service on 127.0.0.1 that can be taken down (503) and brought back."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.served = 0
        self.refused = 0
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                if service.down.is_set():
                    service.refused += 1
                    self.send_response(503)
                    self.end_headers()
                    return
                service.served += 1
                n = int(self.path.rsplit("/", 1)[1])
                body = json.dumps({"score": n * 3}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_outage_in_the_middle_of_500_inputs_loses_nothing_across_a_kill(tmp_path: Path) -> None:
    svc = Service()
    try:
        inputs, output, state = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "state"
        inputs.write_text(
            "".join(json.dumps({"key": f"k{i % 20}", "n": i}) + "\n" for i in range(500))
        )
        env = dict(os.environ, SERVICE_URL=svc.url)
        cmd = [*RATCHET, "run", AGENT, "--input", str(inputs), "--output", str(output),
               "--state", str(state), "--checkpoint-interval", "50"]  # fmt: skip

        def outputs() -> list[dict[str, Any]]:
            if not output.exists():
                return []
            return [json.loads(x) for x in output.read_text().splitlines() if x.endswith("}")]

        def status() -> dict[str, Any]:
            done = subprocess.run(
                [*RATCHET, "status", "--state", str(state), "--json"],
                capture_output=True, text=True, env=env, timeout=60,
            )  # fmt: skip
            return dict(json.loads(done.stdout)) if done.returncode == 0 else {}

        def wait(what: str, check: Any, limit: float = 60) -> None:
            deadline = time.monotonic() + limit
            while not check():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.02)

        job = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        wait("the first 150 outputs", lambda: len(outputs()) >= 150)
        svc.down.set()  # the outage begins
        wait("the pause to show in status", lambda: status().get("paused"))
        paused = status()["paused"][0]
        assert paused["resource"] == "scoring-service" and paused["next_probe"] >= paused["since"]
        assert "503" in paused["error"]
        before = len(outputs())
        time.sleep(0.5)  # the job keeps probing; nothing becomes an error meanwhile
        assert all("error" not in o for o in outputs())
        job.send_signal(signal.SIGKILL)  # killed during the outage
        job.communicate(timeout=30)
        job = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        wait("the restarted job to pause", lambda: svc.refused > 0 and status().get("paused"))
        time.sleep(1.0)
        assert len(outputs()) <= before + 64  # runs in flight at most; no new input admitted
        svc.down.clear()  # the provider is back
        _, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
        got = outputs()
        assert [o for o in got if "error" in o] == []
        assert sorted(o["output"]["n"] for o in got) == list(range(500))  # each exactly once
        assert all(o["output"]["score"] == o["output"]["n"] * 3 for o in got)
        assert status()["paused"] == []
    finally:
        svc.close()
