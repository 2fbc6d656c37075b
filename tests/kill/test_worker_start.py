"""How `ratchet run --workers N` starts its shard workers: forked from the coordinator after
its imports (the default, where safe) or as new interpreters (`RATCHET_WORKER_START=exec`,
and whenever the coordinator runs another thread). Real processes, read through /proc.

Claims checked, for both start methods:
- a worker is a child of the coordinator in a session of its own;
- it holds its own end of the pair (and its own loop's), none of the coordinator's files or
  socket ends, nor another worker's (a held end would keep a peer from seeing EOF);
- it dies when the coordinator is SIGKILLed, and the job then resumes with every output
  exactly once;
and that a thread in the coordinator, or a file its loading of the agent left open, makes it
execute new interpreters; that an agent file is loaded once (its `register_type` calls run
once) when workers are forked; and that an unknown start method is refused without a
traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ratchet.runtime._multiproc import PIDS_FILE
from support.shard_state import workers_gone

pytestmark = [
    pytest.mark.kill,
    pytest.mark.skipif(sys.platform != "linux", reason="reads /proc; fork start is Linux only"),
]

AGENT = f"{Path(__file__).with_name('kill_agent.py')}:KillAgent"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
N_INPUTS = 200
KEYS = 16

ECHO = """
import dataclasses

from ratchet import Agent, InputEvent, OutputEvent, action, register_type


@dataclasses.dataclass
class Seen:
    value: int


register_type(Seen, name="worker_start.Seen")  # once: a forked worker does not load it again


class Echo(Agent):
    @action(InputEvent)
    def echo(self, event, ctx):
        ctx.short_term_memory.set("seen", Seen(event.input["value"]))
        ctx.send_event(OutputEvent(output={"value": event.input["value"]}))
"""

AT_IMPORT = {
    "thread": (
        "import threading\n"
        "_idle = threading.Event()\n"
        "threading.Thread(target=_idle.wait, name='agent-import-thread', daemon=True).start()\n",
        "the coordinator runs other threads (agent-import-thread)",
    ),
    "file": (
        "import os\n_log = open(os.path.join(os.path.dirname(__file__), 'agent.log'), 'a')\n",
        "loading the agent opened ",
    ),
}


def write_inputs(path: Path, n: int) -> None:
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"key": f"k{i % KEYS}", "id": i, "value": i % 101}) + "\n")


def run_cmd(agent: str, tmp: Path, *extra: str) -> list[str]:
    return [
        *RATCHET, "-v", "run", agent, "--input", str(tmp / "in.jsonl"),
        "--output", str(tmp / "out.jsonl"), "--state", str(tmp / "state"),
        "--checkpoint-interval", "20", "--workers", "2", *extra,
    ]  # fmt: skip


def start(cmd: list[str], tmp: Path, method: str | None) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.pop("RATCHET_TEST_EXEC_LOG", None)
    env.pop("RATCHET_WORKER_START", None)
    if method is not None:
        env["RATCHET_WORKER_START"] = method
    with open(tmp / "stderr.log", "ab") as err:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)


def outputs(tmp: Path) -> list[dict[str, object]]:
    out = tmp / "out.jsonl"
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]


def wait_for_outputs(
    proc: subprocess.Popen[bytes], tmp: Path, n: int, coordinator: int | None = None
) -> dict[str, int]:
    """The workers' pids, once all `n` outputs are written (the workers are up and idle);
    their coordinator is `proc` unless the job is supervised."""
    deadline = time.monotonic() + 60
    while len(outputs(tmp)) < n:
        assert proc.poll() is None, (tmp / "stderr.log").read_text()
        assert time.monotonic() < deadline, "no outputs within 60 s"
        time.sleep(0.02)
    pids = json.loads((tmp / "state" / "shards" / PIDS_FILE).read_text())
    if coordinator is None:
        assert pids["coordinator"] == proc.pid
    else:
        assert pids["coordinator"] != proc.pid
    return {"coordinator": int(pids["coordinator"])} | {
        shard: int(pid) for shard, pid in pids["workers"].items()
    }


def check_workers(tmp: Path, pids: dict[str, int], forked: bool) -> set[str]:
    """Each worker: the coordinator's child, in a session of its own, started as `forked`
    says, holding its own socket ends and shard files and nothing of the coordinator's (nor
    another worker's). What the coordinator holds (beyond stdin, stdout and stderr)."""
    pids = dict(pids)
    coordinator = pids.pop("coordinator")
    # Sockets and pipes by inode, files by path (an event loop's epoll is no one's to share).
    held_there = {
        link
        for fd, link in fds(coordinator).items()
        if fd > 2 and link.startswith(("socket:", "pipe:", "/"))
    } - {os.devnull}
    seen: set[str] = set()
    for shard, pid in pids.items():
        assert parent_of(pid) == coordinator
        assert os.getsid(pid) == pid, f"worker {shard} is not in a session of its own"
        if forked:  # the coordinator's command line, not `-m ratchet.agents._sharded`
            assert cmdline(pid) == cmdline(coordinator)
        else:
            assert "ratchet.agents._sharded" in cmdline(pid)
        held = {link for fd, link in fds(pid).items() if fd > 2} - {os.devnull}
        # Its end of the pair and its own event loop's self-pipe (a pair of sockets).
        ends = {link for link in held if link.startswith("socket:")}
        assert len(ends) == 3, f"worker {shard} holds sockets {ends}"
        assert not held & held_there, f"worker {shard} holds {held & held_there}"
        assert not held & seen, f"worker {shard} holds another worker's {held & seen}"
        seen |= held - {"anon_inode:[eventpoll]"}
        own = str(tmp / "state" / "shards")
        files = {link for link in held if link.startswith("/")}
        assert all(f.startswith(own) for f in files), files
    return held_there


def fds(pid: int) -> dict[int, str]:
    found = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            found[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            pass  # closed while listed
    return found


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def gone(pid: int) -> bool:
    """Ended: no such process, or a zombie not yet reaped by whoever adopted it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@pytest.mark.parametrize("method", [None, "exec"], ids=["default-fork", "exec"])
def test_worker_is_alone_in_its_session_holds_only_its_socket_and_dies_with_the_coordinator(
    tmp_path: Path, method: str | None
) -> None:
    write_inputs(tmp_path / "in.jsonl", N_INPUTS)
    proc = start(run_cmd(AGENT, tmp_path, "--follow"), tmp_path, method)
    try:
        pids = wait_for_outputs(proc, tmp_path, N_INPUTS)
        held = check_workers(tmp_path, pids, forked=method is None)
        assert str(tmp_path / "state" / "ratchet.lock") in held  # the coordinator owns the job
        assert str(tmp_path / "in.jsonl") in held and str(tmp_path / "out.jsonl") in held
        pids.pop("coordinator")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        workers_gone(tmp_path / "state")
        deadline = time.monotonic() + 30
        while not all(gone(pid) for pid in pids.values()):
            assert time.monotonic() < deadline, "a worker outlived its SIGKILLed coordinator"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The job resumes from its checkpoints: more inputs, each output exactly once.
    write_inputs(tmp_path / "in.jsonl", N_INPUTS * 2)
    again = start(run_cmd(AGENT, tmp_path), tmp_path, method)
    assert again.wait(timeout=120) == 0, (tmp_path / "stderr.log").read_text()
    ids = [o["id"] for o in outputs(tmp_path)]
    assert len(ids) == len(set(ids)) == N_INPUTS * 2


def test_workers_of_a_supervised_job_do_not_hold_the_supervisors_status_pipe(
    tmp_path: Path,
) -> None:
    """The coordinator reports to its supervisor over a pipe; a worker holding its write end
    would keep the supervisor from seeing the coordinator's end when it dies."""
    write_inputs(tmp_path / "in.jsonl", N_INPUTS)
    proc = start(run_cmd(AGENT, tmp_path, "--follow", "--supervise"), tmp_path, None)
    try:
        pids = wait_for_outputs(proc, tmp_path, N_INPUTS, coordinator=-1)
        held = check_workers(tmp_path, pids, forked=True)
        assert any(link.startswith("pipe:") for link in held), held  # the status pipe
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "stderr.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ids = [o["id"] for o in outputs(tmp_path)]
    assert len(ids) == len(set(ids)) == N_INPUTS


def run_echo(tmp: Path, head: str) -> tuple[list[list[str]], str]:
    """Run the echo agent (`head` prepended to its file) with `--follow` until every input
    is out: each worker's command line, then stop it with SIGTERM; and its stderr."""
    agent = tmp / "echo_agent.py"
    agent.write_text(head + ECHO)
    write_inputs(tmp / "in.jsonl", N_INPUTS)
    proc = start(run_cmd(f"{agent}:Echo", tmp, "--follow"), tmp, None)
    try:
        pids = wait_for_outputs(proc, tmp, N_INPUTS)
        lines = [cmdline(pid) for shard, pid in pids.items() if shard != "coordinator"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp / "stderr.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ids = [o["id"] for o in outputs(tmp)]
    assert len(ids) == len(set(ids)) == N_INPUTS
    return lines, (tmp / "stderr.log").read_text()


def test_an_agent_file_that_registers_a_type_runs_in_forked_workers(tmp_path: Path) -> None:
    lines, err = run_echo(tmp_path, "")
    assert all("ratchet.agents._sharded" not in line for line in lines)
    assert "new interpreters" not in err


@pytest.mark.parametrize("what", sorted(AT_IMPORT))
def test_a_thread_or_a_file_opened_at_the_agents_import_makes_workers_new_interpreters(
    tmp_path: Path, what: str
) -> None:
    head, why = AT_IMPORT[what]
    lines, err = run_echo(tmp_path, head)
    assert all("ratchet.agents._sharded" in line for line in lines)
    assert f"starting shard workers as new interpreters: {why}" in err


def test_an_unknown_start_method_is_refused_without_a_traceback(tmp_path: Path) -> None:
    write_inputs(tmp_path / "in.jsonl", 10)
    proc = start(run_cmd(AGENT, tmp_path), tmp_path, "spawn")
    assert proc.wait(timeout=60) != 0
    err = (tmp_path / "stderr.log").read_text()
    assert "RATCHET_WORKER_START='spawn' is not a worker start method" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists() or not outputs(tmp_path)


RUN_FROM_PYTHON = """
import logging, sys
from ratchet import run
logging.basicConfig(level=logging.INFO, format="%(message)s")
agent, workers, tmp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if agent == "object":  # the class, imported by this program, passed as an object
    sys.path.insert(0, tmp)
    from echo_agent import Echo
    agent = Echo()
inputs = [{"key": f"k{i % 7}", "value": i} for i in range(60)]
res = run(agent, inputs=inputs, output=f"{tmp}/out.jsonl", state_dir=f"{tmp}/state",
          workers=workers)
print(res.runs_completed)
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_ratchet_run_takes_an_agent_spec_and_forks_its_workers(
    tmp_path: Path, workers: int
) -> None:
    """`ratchet.run("file.py:Class", workers=N)` loads the agent itself, so its workers are
    forked (an object passed in makes them new interpreters, with the reason logged)."""
    (tmp_path / "echo_agent.py").write_text(ECHO)
    (tmp_path / "prog.py").write_text(RUN_FROM_PYTHON)
    for agent, state in ((f"{tmp_path / 'echo_agent.py'}:Echo", "spec"), ("object", "obj")):
        run_dir = tmp_path / state
        run_dir.mkdir()
        done = subprocess.run(
            [sys.executable, str(tmp_path / "prog.py"), agent, str(workers), str(run_dir)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["60"]
        lines = [json.loads(x) for x in (run_dir / "out.jsonl").read_text().splitlines()]
        assert sorted(o["output"]["value"] for o in lines) == list(range(60))
        object_reason = "the agent was passed as an object, not loaded by ratchet from its spec"
        if workers == 2 and agent == "object":
            assert f"starting shard workers as new interpreters: {object_reason}" in done.stderr
        else:
            assert "new interpreters" not in done.stderr
