"""`from_datastream(...).apply(agent).to_datastream()` on a local mini-cluster, natively and
through `ratchet.compat.flink_agents` (an Apache Flink Agents agent, imports changed only):
both give every key's counts in order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from .support import flink_env  # noqa: E402

pytestmark = pytest.mark.flink

JOB = Path(__file__).with_name("datastream_job.py")


@pytest.mark.parametrize("mode", ["native", "compat"])
def test_an_agent_on_a_datastream(tmp_path: Path, mode: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(JOB), mode],
        env=flink_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    outputs = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    by_user: dict[str, list[int]] = {}
    for o in outputs:
        by_user.setdefault(o["user"], []).append(o["n"])
    assert by_user == {"u0": [1, 2, 3], "u1": [1, 2, 3], "u2": [1, 2, 3]}
