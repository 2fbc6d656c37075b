"""Record the golden journals: real `ratchet run` processes SIGKILLed with a run in flight.

    PYTHONPATH=tests .venv/bin/python tests/golden/make_golden.py

For each scenario: write the inputs, start `ratchet run golden.golden_agent:GoldenAgent` with
the gate closed, wait until the blocking input's call is waiting and a checkpoint holds its
run, SIGKILL the process, and dump the state database's rows with the codec (no schema in the
dump, so it outlives SQLite schema changes). Also records the outputs the killed process had
already delivered and, from a crash-free run, the outputs and memory a replay must reach.
Re-run only when the journal layout changes on purpose; the tests say why a dump no longer fits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ratchet.store import codec
from ratchet.store._sqlite import SqliteStore

HERE = Path(__file__).parent
ROOT = HERE.parent.parent

SCENARIOS: dict[str, dict[str, Any]] = {
    # one key, a run in flight after two journaled tasks, two inputs queued behind it
    "one_key_in_flight": {
        "inputs": [{"key": "a", "v": v} for v in (1, 2, 3, 5, 6, 7)],
        "block_v": 5,
    },
    # three keys: one in flight, the others' runs completed or queued, outputs in the outbox
    "three_keys": {
        "inputs": [{"key": k, "v": v} for v in range(1, 9) for k in ("x", "y", "z")],
        "block_v": 4,
    },
}


def _run(tmp: Path, inputs: Path, state: Path, out: Path, env: dict[str, str]) -> Any:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ratchet.cli",
            "run",
            "golden.golden_agent:GoldenAgent",
            "--input",
            str(inputs),
            "--output",
            str(out),
            "--state",
            str(state),
            "--checkpoint-interval",
            "20",
            "--json",
        ],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
    )


def record(name: str, scenario: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        inputs = tmp / "in.jsonl"
        text = "".join(json.dumps(r) + "\n" for r in scenario["inputs"])
        inputs.write_text(text)
        env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
        # The crash-free reference.
        ref = _run(tmp, inputs, tmp / "ref-state", tmp / "ref.jsonl", env)
        ref.communicate(timeout=60)
        assert ref.returncode == 0, ref.returncode
        ref_outputs = [json.loads(x) for x in (tmp / "ref.jsonl").read_text().splitlines()]
        store = SqliteStore.open_readonly(tmp / "ref-state")
        ref_memory = {codec.decode(k): m for k, m in store.memories()}
        store.close()
        # The killed run.
        gate = tmp / "gate"
        env.update(GOLDEN_GATE=str(gate), GOLDEN_BLOCK_V=str(scenario["block_v"]))
        proc = _run(tmp, inputs, tmp / "state", tmp / "out.jsonl", env)
        deadline = time.monotonic() + 30
        while not Path(str(gate) + ".waiting").exists():
            assert time.monotonic() < deadline, "the blocking call never started"
            time.sleep(0.02)
        time.sleep(0.5)  # checkpoints every 20 ms: several complete with the run in flight
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        store = SqliteStore.open_readonly(tmp / "state")
        loaded = store.load()
        store.close()
        assert loaded.runs, "no run was in flight at the kill"
        delivered = (
            [json.loads(x) for x in (tmp / "out.jsonl").read_text().splitlines()]
            if (tmp / "out.jsonl").exists()
            else []
        )
        return {
            "format": 1,
            "name": name,
            "agent": "golden.golden_agent:GoldenAgent",
            "input_text": text,
            "rows": {
                "keys": loaded.keys,
                "inputs": loaded.inputs,
                "runs": loaded.runs,
                "outbox": loaded.outbox,
                "calls": [
                    (c.seq, c.task_id, c.idx, c.fn, c.digest, c.status, c.payload)
                    for c in loaded.calls
                ],
                "source": loaded.source,
            },
            "delivered": delivered,
            "expected_outputs": ref_outputs,
            "expected_memory": ref_memory,
        }


def main() -> None:
    for name, scenario in SCENARIOS.items():
        dump = record(name, scenario)
        path = HERE / f"{name}.golden"
        path.write_bytes(codec.encode(dump))
        rows = dump["rows"]
        print(
            f"{path.name}: {len(rows['keys'])} keys, {len(rows['runs'])} runs in flight, "
            f"{len(rows['inputs'])} inputs, {len(rows['calls'])} call records, "
            f"{len(rows['outbox'])} unreleased outputs, {len(dump['delivered'])} delivered"
        )


if __name__ == "__main__":
    main()
