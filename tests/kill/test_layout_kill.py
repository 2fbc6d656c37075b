"""SIGKILL of jobs on the schema-8 layout, and on a schema-7 database (the previous layout)
that the restarted job migrates (issue 19, workload 5).

Memories cross the store's inline limit both ways (a large one lives in `spilled`, a small one
in its key's row), so a kill can land between any of the writes that move one. The claims,
checked after a restart that runs the input to its end: every input's output exactly once,
and every run saw the memory its key's previous run committed (its count and pad size), so
no memory was lost, doubled or taken from the wrong table. For the schema-7 case the first
kill's state is rewritten in the previous layout (`support.schema7.downgrade`) and the second
process, which migrates it, is SIGKILLed too, at a moment hypothesis picks (during the
migration or after). A failing case prints its seed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ratchet.store._sqlite import DB_NAME, SCHEMA_VERSION
from support import schema7
from support.jsonl import whole_lines

pytestmark = pytest.mark.kill

AGENT = f"{Path(__file__).with_name('layout_agent.py')}:Padded"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
INPUTS = 400


def outputs(path: Path) -> list[dict[str, Any]]:
    return [r["output"] for r in whole_lines(path)]


def start(tmp: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*RATCHET, "run", AGENT, "--input", str(tmp / "in.jsonl"), "--output",
         str(tmp / "out.jsonl"), "--state", str(tmp / "state"), "--checkpoint-interval", "20"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def kill_after(proc: subprocess.Popen[str], out: Path, lines: int, hint: str) -> None:
    """SIGKILL `proc` once `out` holds `lines` outputs (or at once if it has ended)."""
    deadline = time.monotonic() + 60
    while len(outputs(out)) < lines and proc.poll() is None:
        assert time.monotonic() < deadline, f"no progress {hint}"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["schema 8", "schema 7 migrated"])
@settings(
    max_examples=int(os.environ.get("LAYOUT_KILL_EXAMPLES", "3")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(seed=st.integers(0, 2**32 - 1))
def test_memories_and_outputs_survive_sigkill(
    tmp_path_factory: Any, layout: str, seed: int
) -> None:
    tmp = tmp_path_factory.mktemp("layout")
    hint = f"({layout}, seed {seed}; state in {tmp / 'state'})"
    rng = random.Random(seed)
    inputs = [
        {"key": f"k{rng.randrange(12)}", "id": f"i{i}",
         "size": rng.choice([0, 5, 100, 150, 200, 600, 3000])}
        for i in range(INPUTS)
    ]  # fmt: skip
    (tmp / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in inputs))
    out = tmp / "out.jsonl"

    kill_after(start(tmp), out, rng.randrange(10, INPUTS // 2), hint)
    if layout == "schema 7 migrated":
        schema7.downgrade(tmp / "state")
        assert schema7.layout(tmp / "state" / DB_NAME)["schema_version"] == 7
        proc = start(tmp)
        if rng.random() < 0.5:  # somewhere from start-up (imports, the migration) on
            time.sleep(rng.uniform(0.2, 3.0))
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=30)
        else:  # once the migrated state has taken new checkpoints
            done = len(outputs(out))  # the first job may have written them all before its kill
            kill_after(
                proc, out, rng.randrange(done + 1, INPUTS) if done + 1 < INPUTS else INPUTS, hint
            )
    else:
        kill_after(start(tmp), out, rng.randrange(INPUTS // 2, INPUTS), hint)
    last = start(tmp)
    _, err = last.communicate(timeout=300)
    assert last.returncode == 0, f"restart {hint}: exit {last.returncode}: {err[-3000:]}"

    got = outputs(out)
    assert sorted(o["id"] for o in got) == sorted(r["id"] for r in inputs), (
        f"each input's output exactly once {hint}"
    )
    by_id = {o["id"]: o for o in got}
    count: dict[str, int] = {}
    pad: dict[str, int] = {}
    for r in inputs:  # each run saw what its key's previous run committed
        count[r["key"]] = count.get(r["key"], 0) + 1
        o = by_id[r["id"]]
        assert (o["n"], o["seen"]) == (count[r["key"]], pad.get(r["key"], -1)), f"{o} {hint}"
        pad[r["key"]] = r["size"]
    assert schema7.layout(tmp / "state" / DB_NAME)["schema_version"] == SCHEMA_VERSION
