"""SIGKILL of `ratchet run` while it changes the number of workers: never a layout missing a shard.

A state whose `shards/layout.json` names a shard that is not there is refused (its keys' work
would be redone, every durable call repeated). That is safe only if a re-sharding never leaves
one: it builds every new shard, database and all, before the layout that names them is
written, and removes the old shards only after. Here the process is SIGKILLed at each step of
the change (a child that patches the step to kill itself there); the state must then read
(`ratchet status`) and run on with the new number of workers to every output once, without
repeating a durable call.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.runtime._shards import read_layout
from ratchet.store._sqlite import DB_NAME

pytestmark = [pytest.mark.kill, pytest.mark.slow]  # six kill points, each a real job

AGENT = f"{Path(__file__).with_name('kill_agent.py')}:KillAgent"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
N_INPUTS = 40

# Runs `ratchet ARGV...` with one step of `ratchet.runtime._shards` made to SIGKILL the process
# before or after its Nth call.
_KILLED_AT = """
import os, signal, sys, types
import ratchet.runtime._shards as shards
step, nth, when = sys.argv[1], int(sys.argv[2]), sys.argv[3]
real = shards.shutil.rmtree if step == "rmtree" else getattr(shards, step)
calls = [0]
def hooked(*args, **kwargs):
    calls[0] += 1
    if calls[0] == nth and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    out = real(*args, **kwargs)
    if calls[0] == nth and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return out
if step == "rmtree":
    shards.shutil = types.SimpleNamespace(rmtree=hooked)
else:
    setattr(shards, step, hooked)
from ratchet.cli import main
sys.exit(main(sys.argv[4:]))
"""


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job run to its end with --workers 2; each test changes a copy of it."""
    base = tmp_path_factory.mktemp("reshard")
    (base / "in.jsonl").write_text(
        "".join(json.dumps({"key": f"k{i % 10}", "value": i}) + "\n" for i in range(N_INPUTS))
    )
    proc = subprocess.run(
        [*argv(base, base), "--workers", "2"],
        env=dict(os.environ, RATCHET_TEST_EXEC_LOG=str(base / "exec.log")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return base


def argv(base: Path, tmp: Path) -> list[str]:
    return [*RATCHET, "run", AGENT, "--input", str(base / "in.jsonl"), "--output",
            str(tmp / "o.jsonl"), "--state", str(tmp / "st")]  # fmt: skip


# (new number of workers, the step killed, its call, before or after it)
KILLS = {
    "a new shard built, not all": (3, "_copy_per_key_text", 1, "after"),
    "every new shard built, no layout yet": (3, "atomic_json", 1, "before"),
    "the new layout written, old shards kept": (3, "atomic_json", 1, "after"),
    "old shards being removed": (3, "rmtree", 1, "after"),
    "back to one: its database built, the layout kept": (1, "_copy_per_key_text", 1, "after"),
    "back to one: the layout gone, old shards being removed": (1, "rmtree", 1, "after"),
}


@pytest.mark.parametrize("kill", list(KILLS), ids=lambda s: s.replace(" ", "-"))
def test_a_change_of_workers_killed_at_any_step_reads_and_runs_on(
    finished: Path, tmp_path: Path, kill: str
) -> None:
    workers, step, nth, when = KILLS[kill]
    shutil.copytree(finished / "st", tmp_path / "st")
    shutil.copy(finished / "o.jsonl", tmp_path / "o.jsonl")
    shutil.copy(finished / "exec.log", tmp_path / "exec.log")
    calls = (tmp_path / "exec.log").read_bytes()
    env = dict(os.environ, RATCHET_TEST_EXEC_LOG=str(tmp_path / "exec.log"))
    run = [*argv(finished, tmp_path), "--workers", str(workers)]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_AT, step, str(nth), when, *run[3:]],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    status = subprocess.run(
        [*RATCHET, "status", "--state", str(tmp_path / "st"), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["keys"] == 10, status.stdout

    again = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    ids = [json.loads(line)["id"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == N_INPUTS
    assert (tmp_path / "exec.log").read_bytes() == calls  # no durable call made again
    layout = read_layout(tmp_path / "st")  # (a killed change may leave old shards beside it)
    assert layout.workers == workers and all((d / DB_NAME).exists() for d in layout.dirs)
