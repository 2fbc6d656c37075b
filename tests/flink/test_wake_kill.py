"""Keys that start work right before a checkpoint survive a Python-worker SIGKILL.

In process mode PyFlink registers a bundle's timers after the bundle, through the task's
mailbox, so a checkpoint barrier that finishes a bundle snapshots that bundle's state writes
without its timers: a key whose work began in that bundle was restored with work and no timer,
and never ran again (docs/flink.md, "Wake registries"). Here inputs arrive as new files while
the job runs, each file the only inputs of two new keys (a key stranded by a restore gets no
later input to wake it), and the Python worker is killed at seeded moments; every input's
output must still be committed exactly once, in order.
Replay a failure with RATCHET_FLINK_SEED=<seed printed in the failure>."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet.flink import read_output_dir  # noqa: E402

from .cluster import descendants, end_tree, wait_for  # noqa: E402
from .support import exec_log, flink_env, kill_test_cmd, kills_a_python_worker  # noqa: E402

pytestmark = [pytest.mark.flink, pytest.mark.kill]

BATCHES, KEYS_PER_BATCH, PER_KEY, KILLS = 40, 2, 3, 3


@kills_a_python_worker
def test_keys_starting_work_at_a_checkpoint_survive_worker_kills(tmp_path: Path) -> None:
    seed = int(os.environ.get("RATCHET_FLINK_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    batches = [
        [
            {"key": f"w{b}-{k}", "v": b * 100 + k * 10 + i}
            for i in range(PER_KEY)
            for k in range(KEYS_PER_BATCH)
        ]
        for b in range(BATCHES)
    ]
    rows = [r for batch in batches for r in batch]
    inbox = tmp_path / "in"
    inbox.mkdir()
    staging = tmp_path / "staging"
    staging.mkdir()

    def drop(b: int) -> None:  # a new file appears whole (renamed into the watched folder)
        tmp = staging / f"b{b:03d}.jsonl"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in batches[b]))
        tmp.rename(inbox / tmp.name)

    drop(0)
    cmd = kill_test_cmd(tmp_path, "Slow", inbox, "--follow", "100")
    with (tmp_path / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(
            cmd, env=flink_env(tmp_path), stdout=subprocess.DEVNULL, stderr=err, text=True
        )
    stop = threading.Event()

    def feeder() -> None:
        for b in range(1, BATCHES):
            if stop.wait(rng.uniform(0.05, 0.4)):
                return
            drop(b)

    def runs_done() -> int:
        return len({(ln[2], ln[3]) for ln in exec_log(tmp_path) if ln[1] == "exec"})

    killed: list[str] = []
    feed = threading.Thread(target=feeder, daemon=True)
    try:
        wait_for("the first runs", lambda: runs_done() >= 5, 240, every=0.05)
        feed.start()
        for _ in range(KILLS):
            goal = runs_done() + rng.randrange(5, 40)
            wait_for(f"{goal} runs to execute", lambda g=goal: runs_done() >= g, 240, every=0.02)
            pid = next(ln[0] for ln in reversed(exec_log(tmp_path)) if ln[1] == "exec")
            if int(pid) in descendants(proc.pid):
                os.kill(int(pid), signal.SIGKILL)
                killed.append(pid)
        feed.join()
        wait_for(
            f"every output to be committed (seed {seed})",
            lambda: len(read_output_dir(tmp_path / "out")) >= len(rows),
            240,
            every=0.5,
        )
    finally:
        stop.set()
        end_tree(proc)
    assert len(killed) >= 2, f"seed {seed}: only {len(killed)} kills landed"
    outputs = read_output_dir(tmp_path / "out")
    ids = Counter(r["id"] for r in outputs)
    assert all(n == 1 for n in ids.values()), f"seed {seed}: duplicated {ids.most_common(3)}"
    assert sorted(r["output"]["v"] for r in outputs) == sorted(r["v"] for r in rows), seed
    counts = Counter(r["key"] for r in rows)
    for key, count in counts.items():
        mine = sorted((r for r in outputs if r["key"] == key), key=lambda r: r["seq"])
        assert [r["output"]["n"] for r in mine] == list(range(1, count + 1)), (seed, key)
