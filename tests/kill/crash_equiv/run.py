"""Running a case in real `ratchet run` processes: a crash-free reference and a killed chain.

The reference runs first; the kill points are relative to it. The chain starts the same
command again after every SIGKILL until it exits 0; each process consumes one `Kill` of the
schedule (once the execution log grew by a share of the work left, counted in log lines or in
durable calls, or after a share of the reference's wall time), and once the schedule is used
up the last process runs to the end. After every kill the harness reads what the dead process
left committed (completed inputs, journaled tasks, recorded durable calls) and later holds
every line of the execution log written after it to that.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from crash_equiv.agentlib import LOG_ENV
from crash_equiv.oracle import compare, read_outputs
from crash_equiv.render import AGENT_CLASS, render_agent, render_inputs
from crash_equiv.spec import Case, Kill
from ratchet._errors import RatchetError
from ratchet.runtime._memops import from_wire
from ratchet.runtime._multiproc import wait_for_lock
from ratchet.runtime._shards import read_layout, shard_of, state_dirs
from ratchet.store import codec
from ratchet.store._sqlite import SqliteStore

HARNESS_PATH = str(Path(__file__).resolve().parent.parent)  # tests/kill: `import crash_equiv`
_SITE = re.compile(r"^(c\d+)\b")
_POLL = 0.002


@dataclasses.dataclass
class Committed:
    """What one killed process left committed, and how far the execution log was then."""

    kill: int
    log_lines: int
    done: set[int] = dataclasses.field(default_factory=set)
    journaled: set[tuple[int, str]] = dataclasses.field(default_factory=set)
    recorded: set[tuple[int, str, str]] = dataclasses.field(default_factory=set)
    unreadable: str = ""


@dataclasses.dataclass
class CaseRun:
    """The result of one case: its differences (empty: equivalent) and what it took."""

    case: Case
    source: str
    differences: list[str] = dataclasses.field(default_factory=list)
    kills: int = 0
    starts: int = 0
    seconds: float = 0.0
    ref_outputs: int = 0
    stderr_tail: str = ""
    # kills after which the state could not be read (nothing committed yet, e.g. at start-up)
    unreadable: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def report(self, with_source: bool = True) -> str:
        parts = [
            f"{len(self.differences)} difference(s) after {self.kills} SIGKILL(s) "
            f"({self.starts} starts, {self.seconds:.1f}s):",
            *(f"  - {d}" for d in self.differences[:25]),
        ]
        if len(self.differences) > 25:
            parts.append(f"  ... and {len(self.differences) - 25} more")
        if self.unreadable:
            parts += ["state unreadable after: " + "; ".join(self.unreadable)]
        parts += ["", "case:", self.case.describe()]
        if self.stderr_tail:
            parts += ["", "stderr of the killed chain (tail):", self.stderr_tail]
        if with_source:
            parts += ["", "agent source:", self.source]
        return "\n".join(parts)


TASK_BUDGET = 400


def _env(log: Path) -> dict[str, str]:
    env = dict(os.environ)
    env[LOG_ENV] = str(log)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HARNESS_PATH, env.get("PYTHONPATH")) if p)
    return env


def _command(workdir: Path, chain: Path, case: Case, workers: int = 1) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ratchet.cli",
        "run",
        f"{workdir / 'agent.py'}:{AGENT_CLASS}",
        "--input",
        str(workdir / "in.jsonl"),
        "--output",
        str(chain / "out.jsonl"),
        "--state",
        str(chain / "state"),
        "--checkpoint-interval",
        str(case.interval_ms),
        "--max-concurrent-runs",
        str(case.max_runs),
        # Error handlers that fail on each other's errors loop until the run's task budget
        # ends them; a small budget ends such runs in a moment (both runs alike).
        "--max-tasks-per-run",
        str(TASK_BUDGET),
        # Generated actions raise on purpose: runs that end in error are part of the case.
        "--allow-errors",
        # The killed chain may run sharded over worker processes (`ratchet run --workers`).
        *(["--workers", str(workers)] if workers != 1 else []),
    ]


def _start(workdir: Path, chain: Path, case: Case, workers: int = 1) -> subprocess.Popen[bytes]:
    with open(chain / "stderr.log", "ab") as err:
        return subprocess.Popen(
            _command(workdir, chain, case, workers),
            env=_env(chain / "exec.log"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def log_lines(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [line.split() for line in log.read_text().splitlines() if line]


def _count_lines(log: Path) -> int:
    try:
        return log.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _tail(path: Path, n: int = 15) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def _error_line(stderr: Path) -> str:
    """The line of a process's stderr that says why it stopped."""
    lines = _tail(stderr, 40).splitlines()
    for line in reversed(lines):
        if line.startswith("ratchet: error") or (line and not line[0].isspace() and ":" in line):
            if "WARNING" not in line:
                return line
    return lines[-1] if lines else "(no stderr)"


def _site(payload: bytes | None) -> str | None:
    """The call site named by a recorded result ([site, value]) or failure ("site refused x")."""
    try:
        value = codec.decode(payload or b"")
    except Exception:  # noqa: BLE001 - an unreadable record names no site
        return None
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            m = _SITE.match(v)
            if m:
                return m.group(1)
        elif isinstance(v, list | tuple):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
    return None


def _keys_of(state: Path) -> list[Any]:
    """The key of each input, by its number (every generated input line is valid)."""
    lines = (state.parent.parent / "in.jsonl").read_text().splitlines()
    return [json.loads(line)["key"] for line in lines if line.strip()]


def _admitted(state: Path, sdir: Path, loaded: Any) -> set[int]:
    """Inputs a state (or one shard of it) had admitted, by number."""
    if sdir == state:
        return set(range(int(loaded.source.get("next_seq", 0))))
    index, n = (int(x) for x in sdir.name.split("-of-"))
    below = int((loaded.source.get("position") or {}).get("next", 0))
    keys = _keys_of(state)
    return {s for s in range(below) if shard_of(keys[s], n) == index}


def wait_workers_gone(state: Path) -> None:
    """A killed coordinator's workers die with it; their shard locks are free once they did."""
    if (state / "shards" / "layout.json").exists():
        for d in read_layout(state).dirs:
            if d.exists():
                wait_for_lock(d)


def read_committed(state: Path, kill: int, log_lines_now: int) -> Committed:
    snap = Committed(kill, log_lines_now)
    dirs = state_dirs(state) if state.exists() else []
    if not dirs or not all((d / "ratchet.db").exists() for d in dirs):
        snap.unreadable = "no database yet"
        return snap
    for sdir in dirs:
        try:
            store = SqliteStore.open_readonly(sdir)
            try:
                loaded = store.load()
            finally:
                store.close()
        except (RatchetError, sqlite3.Error) as exc:  # killed before the database was set up
            snap.unreadable = str(exc)
            return snap
        pending = {seq for seq, _, _ in loaded.inputs}
        snap.done |= _admitted(state, sdir, loaded) - pending
        for seq, _key, _base, journal in loaded.runs:
            for entry in codec.decode(journal):
                snap.journaled.add((seq, entry[0]))
        for r in loaded.calls:
            if r.status in ("ok", "error"):
                site = _site(r.payload)
                if site is not None:
                    snap.recorded.add((r.seq, r.task_id, site))
    return snap


def leftovers(state: Path, n_inputs: int) -> list[str]:
    """What a job that exited 0 must not leave behind: work in flight, unreleased outputs."""
    found = []
    for sdir in state_dirs(state):
        store = SqliteStore.open_readonly(sdir)
        try:
            loaded = store.load()
        finally:
            store.close()
        where = "" if sdir == state else f" (shard {sdir.name})"
        if sdir == state:
            next_seq = int(loaded.source.get("next_seq", 0))
        else:
            next_seq = int((loaded.source.get("position") or {}).get("next", 0))
        if next_seq != n_inputs:
            found.append(
                f"the finished job's source position is input {next_seq} of {n_inputs}{where}"
            )
        for what, rows in (
            ("runs in flight", loaded.runs),
            ("queued inputs", loaded.inputs),
            ("unreleased outputs", loaded.outbox),
            ("durable-call records", loaded.calls),
        ):
            if rows:
                found.append(f"the finished job left {len(rows)} {what} in its state{where}")
    return found


def read_memory(state: Path) -> dict[Any, dict[str, Any]]:
    """The committed short-term memory per key, decoded (exact types), over every shard."""
    memory: dict[Any, dict[str, Any]] = {}
    for sdir in state_dirs(state):
        store = SqliteStore.open_readonly(sdir)
        try:
            rows = store.memories()
        finally:
            store.close()
        memory.update({codec.decode(k): from_wire(codec.decode(m)) for k, m in rows})
    return memory


def reexecutions(lines: list[list[str]], snaps: list[Committed]) -> list[str]:
    """Lines of the execution log that ran something a killed process had committed."""
    found: list[str] = []
    for snap in snaps:
        for parts in lines[snap.log_lines :]:
            pid, kind, seq, task = parts[0], parts[1], int(parts[2]), parts[3]
            what = f"{kind} {task}" + (f" site {parts[4]}" if kind == "call" else "")
            if seq in snap.done:
                why = "its input's run had completed"
            elif kind == "exec" and (seq, task) in snap.journaled:
                why = "the task was journaled"
            elif kind == "call" and (seq, task, parts[4]) in snap.recorded:
                why = "the call's result was recorded"
            else:
                continue
            found.append(
                f"input {seq}: {what} ran again in pid {pid} after kill #{snap.kill}: {why}"
            )
    return list(dict.fromkeys(found))


@dataclasses.dataclass
class Reference:
    """The crash-free run: its directory, how long it took, what it wrote to the log."""

    path: Path
    seconds: float
    lines: int
    calls: int


def _counts(log: Path) -> tuple[int, int]:
    """(lines, durable-call lines) of an execution log."""
    try:
        data = log.read_bytes()
    except FileNotFoundError:
        return 0, 0
    return data.count(b"\n"), data.count(b" call ")


def _await_kill_point(
    proc: subprocess.Popen[bytes], kill: Kill, ref: Reference, log: Path, deadline: float
) -> None:
    """Wait for the kill point. Shares of lines and calls are of the work still to do, as far
    as the reference tells (what the chain already wrote is taken off), so later kills of a
    chain land too."""
    started = time.monotonic()
    if kill.on == "time":
        until = started + ref.seconds * kill.pct / 100
    else:
        which = 1 if kill.on == "calls" and ref.calls else 0  # no calls: count lines
        done = _counts(log)[which]
        remaining = max((ref.lines, ref.calls)[which] - done, 1)
        target = done + max(1, round(remaining * kill.pct / 100))
        while proc.poll() is None and _counts(log)[which] < target and time.monotonic() < deadline:
            time.sleep(_POLL)
        until = time.monotonic() + kill.delay_ms / 1000
    until = min(until, deadline)
    while proc.poll() is None and time.monotonic() < until:
        time.sleep(_POLL)


def run_reference(workdir: Path, case: Case, timeout: float, result: CaseRun) -> Reference:
    path = workdir / "ref"
    path.mkdir()
    t0 = time.monotonic()
    proc = _start(workdir, path, case)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        result.differences.append(f"the crash-free reference did not finish in {timeout:.0f}s")
    finally:
        _stop(proc)
    seconds = time.monotonic() - t0
    if not result.differences and proc.returncode != 0:
        result.differences.append(
            f"the crash-free reference exited {proc.returncode}: {_error_line(path / 'stderr.log')}"
        )
    return Reference(path, seconds, *_counts(path / "exec.log"))


def run_chain(
    workdir: Path, case: Case, ref: Reference, timeout: float, result: CaseRun, workers: int = 1
) -> Path:
    """The killed chain; returns its directory. Problems go to result.differences."""
    chain = workdir / "crash"
    chain.mkdir()
    log = chain / "exec.log"
    snaps: list[Committed] = []
    schedule = list(case.kills)
    while True:
        proc = _start(workdir, chain, case, workers)
        result.starts += 1
        try:
            deadline = time.monotonic() + timeout
            if schedule:
                _await_kill_point(proc, schedule.pop(0), ref, log, deadline)
                if proc.poll() is None and time.monotonic() < deadline:
                    proc.send_signal(signal.SIGKILL)
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                result.differences.append(
                    f"process {result.starts} of the killed chain did not finish in {timeout:.0f}s"
                )
                return chain
        finally:
            _stop(proc)
        if proc.returncode == -signal.SIGKILL:
            result.kills += 1
            wait_workers_gone(chain / "state")
            snap = read_committed(chain / "state", result.kills, _count_lines(log))
            if snap.unreadable:
                result.unreadable.append(f"kill #{result.kills}: {snap.unreadable}")
            snaps.append(snap)
            continue
        if proc.returncode != 0:
            result.differences.append(
                f"process {result.starts} of the killed chain exited {proc.returncode} "
                f"(after {result.kills} kills): {_error_line(chain / 'stderr.log')}"
            )
            return chain
        break
    result.differences += reexecutions(log_lines(log), snaps)
    return chain


def run_case(case: Case, workdir: Path, timeout: float = 20.0, workers: int = 1) -> CaseRun:
    """Render `case` into `workdir`, run the reference, then the killed chain, and compare.

    `workers`: the killed chain runs with `ratchet run --workers N` (its coordinator is what
    is killed); the reference is always one process."""
    t0 = time.monotonic()
    source = render_agent(case)
    (workdir / "agent.py").write_text(source)
    (workdir / "in.jsonl").write_text(render_inputs(case))
    result = CaseRun(case, source)
    ref = run_reference(workdir, case, timeout, result)
    if result.differences:
        result.seconds = time.monotonic() - t0
        result.stderr_tail = _tail(ref.path / "stderr.log")
        return result
    chain = run_chain(workdir, case, ref, timeout, result, workers)
    result.seconds = time.monotonic() - t0
    result.stderr_tail = _tail(chain / "stderr.log")
    if result.differences:
        return result
    for name, path in (("reference", ref.path), ("killed chain", chain)):
        result.differences += [f"{name}: {p}" for p in leftovers(path / "state", len(case.inputs))]
    ref_outputs = read_outputs(ref.path / "out.jsonl")
    result.ref_outputs = len(ref_outputs)
    result.differences += compare(
        ref_outputs,
        read_outputs(chain / "out.jsonl"),
        read_memory(ref.path / "state"),
        read_memory(chain / "state"),
        ordered=case.features.output_order,
    )
    return result
