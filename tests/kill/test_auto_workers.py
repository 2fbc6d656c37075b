"""`--workers auto`: the rules it picks a number by, and a SIGKILLed auto job that resumes with
the workers its state was written with, every output exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ratchet
from ratchet.runtime import _auto_workers as aw
from ratchet.runtime._auto_workers import (
    MAX_AUTO_WORKERS,
    SMALL_INPUT_BYTES,
    auto_workers,
    input_bytes,
    usable_cores,
)
from ratchet.runtime._shards import is_sharded, read_layout
from support.jsonl import whole_lines
from support.shard_state import workers_gone

AGENT = f"{Path(__file__).with_name('kill_agent.py')}:KillAgent"
RATCHET = [sys.executable, "-m", "ratchet.cli"]


def _lines(path: Path, n: int, keys: int = 16) -> None:
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"key": f"k{i % keys}", "id": i, "value": i % 101}) + "\n")


# -- the rules ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(cores=st.integers(1, 64), size=st.integers(0, 4 * SMALL_INPUT_BYTES), follow=st.booleans())
def test_a_new_job_gets_one_worker_per_core_up_to_the_cap_unless_its_input_is_small(
    cores: int, size: int, follow: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("auto")
    data = tmp / "in.jsonl"
    data.write_bytes(b"x" * size)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aw, "usable_cores", lambda: cores)
        n, why = auto_workers(tmp / "state", str(data), follow)
    if cores == 1:
        assert (n, why) == (1, "one usable core")
    elif size < SMALL_INPUT_BYTES and not follow:
        assert n == 1 and "small bounded input" in why
    else:
        # A followed input grows: its size now says nothing of the job's.
        assert n == min(cores, MAX_AUTO_WORKERS), why
        assert f"{cores} usable cores" in why


@pytest.mark.slow
def test_an_existing_state_keeps_its_number_of_workers(tmp_path: Path) -> None:
    """Auto never moves keys: one process's state stays one process, a sharded one keeps N."""
    big = tmp_path / "big.jsonl"
    _lines(big, 3000)
    assert big.stat().st_size > SMALL_INPUT_BYTES
    out = tmp_path / "out.jsonl"
    ratchet.run(AGENT, inputs=str(big), output=str(out), state_dir=tmp_path / "one", workers=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aw, "usable_cores", lambda: 8)
        assert auto_workers(tmp_path / "one", str(big), False) == (
            1,
            "the state was written by one process",
        )
        ratchet.run(
            AGENT,
            inputs=str(big),
            output=str(tmp_path / "out3.jsonl"),
            state_dir=tmp_path / "three",
            workers=3,
        )
        assert auto_workers(tmp_path / "three", str(big), False) == (
            3,
            "the state was written with 3 workers",
        )


def test_input_bytes_counts_the_files_an_input_names(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_bytes(b"1" * 10)
    (tmp_path / "d" / "b.jsonl").write_bytes(b"2" * 5)
    (tmp_path / "d" / "sub").mkdir()  # not a file: not counted
    assert input_bytes(str(tmp_path / "d" / "a.jsonl")) == 10
    assert input_bytes(str(tmp_path / "d")) == 15
    assert input_bytes(str(tmp_path / "d" / "*.jsonl")) == 15
    assert input_bytes(str(tmp_path / "none*.jsonl")) is None
    assert input_bytes("postgresql://u@127.0.0.1/db?table=t") is None


@pytest.mark.parametrize(
    ("own", "parent", "affinity", "want"),
    [("max 100000", None, 8, 8), ("200000 100000", None, 8, 2), ("150000 100000", None, 8, 2),
     ("50000 100000", None, 8, 1), ("400000 100000", None, 2, 2), ("garbage", None, 3, 3),
     ("max 100000", "300000 100000", 8, 3), ("100000 100000", "300000 100000", 8, 1)],
)  # fmt: skip
def test_usable_cores_take_cgroup_quotas_into_account(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    own: str,
    parent: str | None,
    affinity: int,
    want: int,
) -> None:
    """The process's own cgroup and those above it (a container's limit is often set on a
    parent): the tightest quota, in whole cores rounded up."""
    root = tmp_path / "cgroup"
    (root / "outer" / "job").mkdir(parents=True)
    (root / "outer" / "job" / "cpu.max").write_text(own + "\n")
    if parent is not None:
        (root / "outer" / "cpu.max").write_text(parent + "\n")
    (tmp_path / "self").write_text("0::/outer/job\n")
    monkeypatch.setattr(aw, "_CGROUP_ROOT", root)
    monkeypatch.setattr(aw, "_SELF_CGROUP", tmp_path / "self")
    monkeypatch.setattr(aw.os, "sched_getaffinity", lambda _pid: set(range(affinity)))
    assert usable_cores() == want


@pytest.mark.parametrize(
    ("root", "own", "quotas", "affinity", "want"),
    [("/", "/outer/job", {"outer/job": "200000"}, 8, 2),
     ("/", "/outer/job", {"outer/job": "-1"}, 8, 8),
     ("/", "/outer/job", {"outer/job": "-1", "outer": "300000"}, 8, 3),
     ("/", "/outer/job", {"outer/job": "100000", "outer": "300000"}, 8, 1),
     ("/", "/outer/job", {"outer/job": "150000", "": "50000"}, 8, 1),
     ("/docker/abc", "/docker/abc", {"": "150000"}, 8, 2),  # a container sees its own cgroup
     ("/docker/abc", "/docker/abcd", {"": "150000"}, 8, 8),  # the mount shows another cgroup
     ("/", "/outer/job", {"outer/job": "400000"}, 2, 2),
     ("/", "/outer/job", {"outer/job": "garbage"}, 3, 3)],
)  # fmt: skip
def test_usable_cores_take_cgroup_v1_quotas_into_account(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    root: str,
    own: str,
    quotas: dict[str, str],
    affinity: int,
    want: int,
) -> None:
    """cgroup v1 (this CI machine's kind: a `cpu` hierarchy of its own): the quota over the
    period of the `cpu` controller's cgroup and those above it up to the mount, -1 for none;
    the mount's own root comes from mountinfo (its path has a space, escaped there)."""
    point = tmp_path / "cg v1" / "cpu,cpuacct"
    for rel, quota in quotas.items():
        (point / rel).mkdir(parents=True, exist_ok=True)
        (point / rel / "cpu.cfs_quota_us").write_text(quota + "\n")
        (point / rel / "cpu.cfs_period_us").write_text("100000\n")
    escaped = str(point).replace(" ", "\\040")
    (tmp_path / "mountinfo").write_text(
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "33 31 0:30 / /elsewhere rw,relatime - cgroup cgroup rw,cpuacct\n"
        f"32 31 0:29 {root} {escaped} rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct\n"
    )
    (tmp_path / "self").write_text(f"4:memory:/m\n2:cpu,cpuacct:{own}\n0::/\n")
    monkeypatch.setattr(aw, "_CGROUP_ROOT", tmp_path / "no-v2")
    monkeypatch.setattr(aw, "_SELF_CGROUP", tmp_path / "self")
    monkeypatch.setattr(aw, "_MOUNTINFO", tmp_path / "mountinfo")
    monkeypatch.setattr(aw.os, "sched_getaffinity", lambda _pid: set(range(affinity)))
    assert usable_cores() == want


V1_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(
    not (V1_CPU / "cpu.cfs_quota_us").exists() or not os.access(V1_CPU, os.W_OK),
    reason="needs a writable cgroup v1 `cpu` hierarchy at /sys/fs/cgroup/cpu (root, cgroup v1)",
)
def test_a_process_in_a_real_v1_cgroup_with_a_one_core_quota_gets_one(tmp_path: Path) -> None:
    """A real cgroup of this machine's v1 `cpu` hierarchy, quota 1 core: a process moved into
    it sees one usable core whatever its affinity (what a container runtime on v1 sets)."""
    group = V1_CPU / f"ratchet-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
        probe = "from ratchet.runtime._auto_workers import usable_cores; print(usable_cores())"
        proc = subprocess.run(
            ["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$0" -c "$1"',
             sys.executable, probe],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "1", (proc.stdout, proc.stderr)
    finally:
        group.rmdir()  # empty again: its one process has exited


@pytest.mark.slow
def test_run_auto_keeps_one_process_for_what_only_one_process_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ratchet.run(workers="auto")` never picks a number the same call would refuse, and a
    short in-memory list of inputs runs in one process."""
    monkeypatch.setattr(aw, "usable_cores", lambda: 2)
    big = tmp_path / "big.jsonl"
    _lines(big, 3000)

    class Local(ratchet.Agent):
        @ratchet.action(ratchet.InputEvent, inline=True)
        def go(self, event: ratchet.InputEvent, ctx: ratchet.RunnerContext) -> None:
            ctx.send_event(ratchet.OutputEvent(output={"v": event.input["value"]}))

    cases = {
        "config": dict(agent=AGENT, inputs=str(big), agent_config={"x": 1}),
        "local": dict(agent=Local(), inputs=str(big)),
        "short-list": dict(agent=AGENT, inputs=[{"key": "a", "value": 1}] * 10),
    }
    for name, kw in cases.items():
        state = tmp_path / name
        ratchet.run(output=str(tmp_path / f"{name}.jsonl"), state_dir=state, workers="auto", **kw)
        assert not is_sharded(state), name
    long = [{"key": f"k{i % 7}", "value": i} for i in range(1500)]
    ratchet.run(AGENT, inputs=long, output=str(tmp_path / "long.jsonl"),
                state_dir=tmp_path / "long", workers="auto")  # fmt: skip
    assert read_layout(tmp_path / "long").workers == 2
    ids = Counter(json.loads(x)["id"] for x in (tmp_path / "long.jsonl").read_text().splitlines())
    assert len(ids) == 1500 and set(ids.values()) == {1}


def test_a_bad_number_of_workers_is_refused_by_name(tmp_path: Path) -> None:
    _lines(tmp_path / "in.jsonl", 3)
    for bad in ("two", "0", "-1"):
        proc = subprocess.run(
            [*RATCHET, "run", AGENT, "--input", str(tmp_path / "in.jsonl"), "--output",
             str(tmp_path / "o.jsonl"), "--state", str(tmp_path / "s"), "--workers", bad],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2, (bad, proc.stderr)
        assert "--workers" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    with pytest.raises(ratchet.ConfigError, match="auto"):
        ratchet.run(AGENT, inputs=str(tmp_path / "in.jsonl"), output=str(tmp_path / "o.jsonl"),
                    state_dir=tmp_path / "s", workers="many")  # type: ignore[arg-type]  # fmt: skip


# -- a real job --------------------------------------------------------------------------------


def _run(tmp: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RATCHET_TEST_EXEC_LOG=str(tmp / "exec.log"))
    with open(tmp / "stderr.log", "ab") as err:  # the child keeps its own copy
        return subprocess.Popen(
            [*RATCHET, "run", AGENT, "--input", str(tmp / "in.jsonl"), "--output",
             str(tmp / "out.jsonl"), "--state", str(tmp / "state"), "--checkpoint-interval",
             "20", "--workers", "auto", *extra],
            env=env, stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip


@pytest.mark.kill
@pytest.mark.skipif(sys.platform != "linux", reason="the kill is of a coordinator and its workers")
def test_a_sigkilled_auto_job_resumes_with_the_workers_it_was_written_with(
    tmp_path: Path,
) -> None:
    n_inputs = 2000
    _lines(tmp_path / "in.jsonl", n_inputs)
    assert (tmp_path / "in.jsonl").stat().st_size >= SMALL_INPUT_BYTES
    want = min(usable_cores(), MAX_AUTO_WORKERS)
    proc = _run(tmp_path)
    deadline = time.monotonic() + 120
    while len(whole_lines(tmp_path / "out.jsonl")) < n_inputs // 4:
        assert proc.poll() is None, (tmp_path / "stderr.log").read_text()
        assert time.monotonic() < deadline, "no outputs within 120 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    said = (tmp_path / "stderr.log").read_text()
    assert f"--workers auto: {want} (" in said, said
    assert is_sharded(tmp_path / "state") == (want > 1)
    if want > 1:
        assert read_layout(tmp_path / "state").workers == want
    workers_gone(tmp_path / "state")  # they die with their coordinator: wait until they have
    before = len(whole_lines(tmp_path / "out.jsonl"))
    assert before < n_inputs, "the kill came after the end: nothing left to resume"
    (tmp_path / "stderr.log").unlink()
    again = _run(tmp_path)
    assert again.wait(timeout=300) == 0, (tmp_path / "stderr.log").read_text()
    said = (tmp_path / "stderr.log").read_text()
    why = "the state was written with" if want > 1 else "the state was written by one process"
    assert f"--workers auto: {want} ({why}" in said, said
    ids = Counter(str(o["id"]) for o in whole_lines(tmp_path / "out.jsonl"))
    assert len(ids) == n_inputs and set(ids.values()) == {1}, ids.most_common(3)
