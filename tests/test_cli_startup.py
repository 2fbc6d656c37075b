"""The start-up of `ratchet run` (issue 19): what it imports, and its garbage collector.

`ratchet run` turns the collector off while it imports and loads the agent, then freezes what
that made and turns it back on before the job runs (`ratchet.cli.end_startup`). Pinned here, in
fresh processes: the job never runs with the collector off (one process, a coordinator before
it forks its workers, a forked worker, a supervisor and its worker), what start-up made is
frozen, a caller of `main(argv)` keeps its own collector settings, and modules the run path has
no use for stay unimported.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.cli import main

# Modules a plain `ratchet run` has no use for: the supervisor (a worker of a supervised job
# reads its environment's names from `ratchet.runtime._supervisor_env`).
NOT_ON_RUN_PATH = ("ratchet.runtime._supervisor",)

PROBE = f"""
import gc, sys

from ratchet import Agent, InputEvent, OutputEvent, action

NOT_ON_RUN_PATH = {NOT_ON_RUN_PATH!r}


class Probe(Agent):
    @action(InputEvent)
    def probe(self, event, ctx):
        ctx.send_event(OutputEvent(output={{
            "id": event.input["id"],
            "gc_enabled": gc.isenabled(),
            "frozen": gc.get_freeze_count(),
            "loaded": sorted(m for m in NOT_ON_RUN_PATH if m in sys.modules),
        }}))
"""

# Runs `ratchet run` as the program, with the function that starts the job (one process, the
# coordinator of --workers N, the supervisor) replaced by one that prints the collector's state
# and what is imported at that moment, then leaves.
AT_START = """
import gc, json, os, sys
import {module} as target

def report(*args, **kwargs):
    print(json.dumps({{"gc_enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                       "loaded": sorted(m for m in {modules!r} if m in sys.modules)}}), flush=True)
    os._exit(0)

setattr(target, {name!r}, report)
from ratchet.cli import main
sys.argv = ["ratchet", *sys.argv[1:]]
sys.exit(main())
"""


def _job(tmp: Path, n: int = 6) -> tuple[str, list[str]]:
    (tmp / "probe.py").write_text(PROBE)
    with (tmp / "in.jsonl").open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"key": f"k{i % 3}", "id": f"i{i}"}) + "\n")
    args = [
        "run", f"{tmp / 'probe.py'}:Probe", "--input", str(tmp / "in.jsonl"),
        "--output", str(tmp / "out.jsonl"), "--state", str(tmp / "state"),
    ]  # fmt: skip
    return f"{tmp / 'probe.py'}:Probe", args


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RATCHET_WORKER_START"}
    return env | extra


@pytest.mark.parametrize(
    ("module", "name", "extra"),
    [
        ("ratchet.agents._run", "run_owned", []),
        ("ratchet.agents._sharded", "run_sharded", ["--workers", "2"]),
        ("ratchet.runtime._supervisor", "Supervisor.run", ["--supervise"]),
    ],
    ids=["one-process", "coordinator", "supervisor"],
)
def test_a_job_starts_with_the_collector_on_and_start_up_frozen(
    tmp_path: Path, module: str, name: str, extra: list[str]
) -> None:
    _, args = _job(tmp_path)
    owner, _, attr = name.rpartition(".")
    script = AT_START.format(module=module, name=attr, modules=NOT_ON_RUN_PATH)
    if owner:  # a method: patch it on its class
        script = script.replace("setattr(target, ", f"setattr(target.{owner}, ")
    proc = subprocess.run(
        [sys.executable, "-c", script, *args, *extra],
        capture_output=True, text=True, timeout=120, env=_env(), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["gc_enabled"] is True
    assert seen["frozen"] > 10_000  # modules, classes, functions: start-up's objects
    if module != "ratchet.runtime._supervisor":
        assert seen["loaded"] == []


@pytest.mark.parametrize(
    ("workers", "start"),
    [("1", None), ("2", "fork"), ("2", "exec")],
    ids=["one-process", "forked-workers", "executed-workers"],
)
def test_actions_run_with_the_collector_on(tmp_path: Path, workers: str, start: str | None) -> None:
    _, args = _job(tmp_path)
    env = _env(**({"RATCHET_WORKER_START": start} if start else {}))
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", *args, "--workers", workers],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [
        json.loads(line)["output"] for line in (tmp_path / "out.jsonl").read_text().splitlines()
    ]
    assert sorted(r["id"] for r in rows) == [f"i{i}" for i in range(6)]
    assert all(r["gc_enabled"] is True for r in rows), rows
    assert all(r["loaded"] == [] for r in rows), rows
    if start != "exec":  # an executed worker is not `ratchet run`: it freezes nothing
        assert all(r["frozen"] > 10_000 for r in rows), rows


def test_a_supervised_worker_runs_with_the_collector_on(tmp_path: Path) -> None:
    _, args = _job(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", *args, "--supervise"],
        capture_output=True, text=True, timeout=120, env=_env(), check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [
        json.loads(line)["output"] for line in (tmp_path / "out.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 6
    assert all(r["gc_enabled"] is True and r["frozen"] > 10_000 for r in rows), rows


def test_main_with_argv_leaves_the_callers_collector_alone(tmp_path: Path) -> None:
    """Called as a function (tests, embedding programs), `main` neither pauses nor freezes."""
    _, args = _job(tmp_path, n=2)
    frozen = gc.get_freeze_count()
    gc.disable()
    try:
        assert main(args) == 0
        assert not gc.isenabled()  # as the caller left it
    finally:
        gc.enable()
    again = [str(tmp_path / "again") if a.startswith(str(tmp_path / "state")) else a for a in args]
    again[again.index("--output") + 1] = str(tmp_path / "again.jsonl")
    assert main(again) == 0
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen


CALLER_WITH_A_THREAD = """
import sys, threading
from ratchet.cli import main

release = threading.Event()
threading.Thread(target=release.wait, daemon=True).start()  # the caller's own thread
code = main(sys.argv[1:])
print("returned", code, flush=True)
release.set()
sys.exit(3)
"""


def test_main_with_argv_returns_to_a_caller_that_has_threads(tmp_path: Path) -> None:
    """As the program, `ratchet run` leaves with `os._exit` when a thread is still alive (a
    user's call may block the interpreter's exit); called as a function it returns. It ended
    pytest's own process once (exit 0, the rest of the suite unrun): so in a subprocess."""
    _, args = _job(tmp_path, n=2)
    (tmp_path / "caller.py").write_text(CALLER_WITH_A_THREAD)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "caller.py"), *args],
        capture_output=True, text=True, timeout=120, env=_env(), check=False,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.strip() == "returned 0", proc.stdout
