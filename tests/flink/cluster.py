"""A standalone Flink cluster started from the pip package's own scripts, for the kill tests.

Everything it writes (config, logs, pid files, temp files, checkpoints) is under one folder;
every process it starts, and every Python worker under a TaskManager, is ended by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyflink

BIN = Path(pyflink.__file__).parent / "bin"
CONF = Path(pyflink.__file__).parent / "conf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float,
    every: float = 0.2,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Poll `check` until it is truthy; on a timeout, `explain` says what the cluster was doing."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (OSError, ValueError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    detail = ""
    if explain is not None:
        try:
            detail = "\n" + explain()
        except Exception as exc:  # noqa: BLE001 - the explanation must not hide the timeout
            detail = f"\n(no explanation: {exc!r})"
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r}){detail}"
    )


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, ended and not reaped yet, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def end_tree(proc: subprocess.Popen[Any]) -> None:
    """Kill a command and everything under it, whether it ended or not. The tree is read
    before the kill: a JVM whose parent died is reparented, and would outlive the test."""
    tree = descendants(proc.pid)
    if proc.poll() is None:
        proc.kill()
    kill_pids(tree)
    proc.wait()


class Cluster:
    def __init__(self, base: Path, slots: int = 2, settings: dict[str, Any] | None = None) -> None:
        """`settings`: Flink options added to (or replacing) the suite's own."""
        self.base = base
        self.conf = base / "conf"
        self.log = base / "log"
        self.pid_dir = base / "pid"
        self.tmp = base / "tmp"
        for d in (self.conf, self.log, self.pid_dir, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        for f in CONF.glob("log4j*.properties"):
            shutil.copy(f, self.conf / f.name)
        self.rest_port = free_port()
        base_opts = _java_opts()
        given = settings or {}
        settings = {
            "jobmanager.rpc.address": "localhost",
            "jobmanager.rpc.port": free_port(),
            "jobmanager.bind-host": "localhost",
            "taskmanager.bind-host": "localhost",
            "taskmanager.host": "localhost",
            "rest.address": "localhost",
            "rest.bind-address": "localhost",
            "rest.port": self.rest_port,
            "taskmanager.numberOfTaskSlots": slots,
            "jobmanager.memory.process.size": "1024m",
            "taskmanager.memory.process.size": "1600m",
            "io.tmp.dirs": str(self.tmp),
            # A JVM that crashes (a fault in native code: the embedded Python interpreter of
            # thread mode) writes its report next to the logs, where `crashes` finds it.
            "env.java.opts.all": (
                f"{base_opts} -Djava.io.tmpdir={self.tmp} -XX:ErrorFile={self.log}/hs_err_pid%p.log"
            ),
            "python.executable": sys.executable,
            "heartbeat.timeout": 8000,
            "heartbeat.interval": 1000,
            "slot.request.timeout": 120000,
            **given,
        }
        lib_env: dict[str, str] = {}
        if os.environ.get("RATCHET_FLINK_EXECUTION_MODE") == "thread":
            # Thread mode on a session cluster: Pemja loads its native library once per JVM, and
            # a second job's (or a restarted job's) classloader fails to load it again
            # ("NoSuchFieldException: loadedLibraryNames" on Java 17). With flink-python on the
            # TaskManagers' own classpath and Pemja's classes parent-first, one loader loads it.
            lib = base / "lib"
            lib.mkdir(exist_ok=True)
            pkg = Path(pyflink.__file__).parent
            for jar in [*(pkg / "lib").glob("*.jar"), *(pkg / "opt").glob("flink-python-*.jar")]:
                (lib / jar.name).symlink_to(jar)
            settings["classloader.parent-first-patterns.additional"] = "pemja."
            lib_env["FLINK_LIB_DIR"] = str(lib)
        (self.conf / "config.yaml").write_text(
            "".join(
                f"{k}: {json.dumps(v) if isinstance(v, str) else v}\n" for k, v in settings.items()
            )
        )
        self.env = dict(
            os.environ,
            FLINK_CONF_DIR=str(self.conf),
            FLINK_LOG_DIR=str(self.log),
            FLINK_PID_DIR=str(self.pid_dir),
            TMPDIR=str(self.tmp),
            JVM_ARGS=f"-Djava.io.tmpdir={self.tmp}",
            RATCHET_TEST_EXEC_LOG=str(base / "exec.log"),  # the Python workers inherit it
            **lib_env,
        )
        self.exec_log = base / "exec.log"
        self.started: list[int] = []
        self.reported: set[str] = set()  # crash reports a test already failed for

    @property
    def jobmanager(self) -> str:
        return f"localhost:{self.rest_port}"

    def _script(self, name: str, *args: str) -> None:
        subprocess.run(
            ["bash", str(BIN / name), *args],
            env=self.env,
            check=True,
            timeout=60,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _pids(self, kind: str) -> list[int]:
        f = self.pid_dir / f"flink-{os.environ.get('USER', 'root')}-{kind}.pid"
        if not f.exists():
            matches = list(self.pid_dir.glob(f"flink-*-{kind}.pid"))
            if not matches:
                return []
            f = matches[0]
        return [int(x) for x in f.read_text().split()]

    def start(self) -> None:
        self._script("jobmanager.sh", "start")
        self.start_taskmanager()
        wait_for("the JobManager's REST API", lambda: self.rest("/overview"), 90)
        self.started += self._pids("standalonesession")

    def start_taskmanager(self) -> int:
        before = set(self._pids("taskexecutor"))
        self._script("taskmanager.sh", "start")
        pid = wait_for(
            "a new TaskManager pid",
            lambda: (
                (set(self._pids("taskexecutor")) - before)
                and max(set(self._pids("taskexecutor")) - before)
            ),
            30,
        )
        self.started.append(pid)
        return int(pid)

    def taskmanager_pids(self) -> list[int]:
        """The TaskManagers still running (a killed one nobody reaped yet is not)."""
        return [p for p in self._pids("taskexecutor") if running(p)]

    def rest(self, path: str, method: str = "GET", body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"http://localhost:{self.rest_port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else {}

    def job_status(self, job_id: str) -> str:
        return str(self.rest(f"/jobs/{job_id}")["state"])

    def ready(self, timeout: float = 120) -> None:
        """Wait until a live TaskManager is registered and every slot is free: a test starts
        on a cluster no earlier job still holds. A timeout says what the cluster was doing."""

        def idle() -> bool:
            tms = self.rest("/taskmanagers")["taskmanagers"]
            running = [j for j in self.rest("/jobs")["jobs"] if j["status"] not in _ENDED]
            # A killed TaskManager stays registered until its heartbeat times out, its slots
            # shown free: a job scheduled there fails. Wait until only live ones are listed.
            return bool(
                self.taskmanager_pids()
                and len(tms) == len(self.taskmanager_pids())
                and not running
                and all(t["freeSlots"] == t["slotsNumber"] for t in tms)
            )

        if not self.taskmanager_pids() and self.pyflink_teardown_fault():
            # PyFlink's own fault (process mode): cancelling a job's Python operator can end
            # its TaskManager ("Fatal error ... Reference count must not be negative", in
            # Beam's bundle factory), after the test that cancelled it passed. Not this
            # test's, nor ratchet's (no ratchet frame): a TaskManager is started in its place,
            # as an operator would, and the test runs.
            print("the last TaskManager ended on PyFlink's teardown fault; started another")
            self.start_taskmanager()
        if not self.taskmanager_pids():
            # No TaskManager process left: it crashed (a report below), something else ended
            # it (the OOM killer), or a kill test failed before starting its replacement.
            # Start another, so the tests after this one run, and fail this one saying so.
            said = self.explain()
            self.start_taskmanager()
            self.reported.update(self.crashes())
            raise AssertionError(
                "the standalone cluster had no live TaskManager after the earlier tests "
                f"(started another):\n{said}"
            )
        self.check_crashes("during or after an earlier test")
        wait_for("an idle cluster", idle, timeout, every=0.5, explain=self.explain)

    def pyflink_teardown_fault(self) -> bool:
        """Whether the newest TaskManager log ends on PyFlink's known fault when a job's
        Python operator is closed while it is cancelled (the TaskManager exits 1)."""
        logs = sorted(self.log.glob("flink-*-taskexecutor-*.log"), key=lambda f: f.stat().st_mtime)
        if not logs:
            return False
        text = logs[-1].read_text(errors="replace")
        fatal = text.rfind("Fatal error occurred while executing the TaskManager")
        return fatal >= 0 and "Reference count must not be negative" in text[fatal : fatal + 2000]

    def crashes(self) -> dict[str, str]:
        """Every JVM crash report of the cluster's processes: file name -> its first lines.
        A SIGKILL writes none; a fault in native code (Python inside the JVM) does."""
        found: dict[str, str] = {}
        for f in sorted(self.log.glob("hs_err_pid*.log")):
            found[f.name] = "\n".join(f.read_text(errors="replace").splitlines()[:80])
        for f in sorted(self.log.glob("*.out")):
            text = f.read_text(errors="replace")
            if "A fatal error has been detected" in text:
                found[f.name] = "\n".join(text.splitlines()[:40])
        return found

    def check_crashes(self, when: str = "during this test") -> None:
        """Fail if a JVM of the cluster crashed since the last check (each reported once)."""
        new = {k: v for k, v in self.crashes().items() if k not in self.reported}
        self.reported.update(new)
        if new:
            raise AssertionError(
                f"a JVM of the standalone cluster crashed {when}:\n"
                + "\n".join(f"--- {name}\n{text}" for name, text in new.items())
            )

    def explain(self, job_id: str | None = None) -> str:
        """What the cluster knows of a job that made no progress: its state, its tasks' states,
        the TaskManagers and their free slots, the job's exceptions, the logs' last errors."""
        parts: list[str] = []

        def add(label: str, get: Callable[[], Any]) -> None:
            try:
                parts.append(f"{label}: {get()}")
            except Exception as exc:  # noqa: BLE001 - report what could not be read
                parts.append(f"{label}: unreadable ({exc!r})")

        if job_id is not None:
            add("job state", lambda: self.job_status(job_id))
            add(
                "tasks",
                lambda: [
                    (v["name"][:40], v["status"], v.get("tasks"))
                    for v in self.rest(f"/jobs/{job_id}")["vertices"]
                ],
            )
        add(
            "taskmanagers",
            lambda: [
                (t["id"][-12:], t["slotsNumber"], t["freeSlots"])
                for t in self.rest("/taskmanagers")["taskmanagers"]
            ],
        )
        add("jobs", lambda: [(j["id"], j["status"]) for j in self.rest("/jobs")["jobs"]])
        if job_id is not None:
            add("checkpoints", lambda: self.checkpoints(job_id)["counts"])
            add(
                "root exception",
                lambda: (self.rest(f"/jobs/{job_id}/exceptions").get("root-exception") or "")[
                    :3000
                ],
            )
        add("taskmanager pids alive", self.taskmanager_pids)
        for name, text in self.crashes().items():
            parts.append(f"--- JVM crash report {name}:\n{text}")
        for log in sorted(self.log.glob("flink-*.log")):  # crash reports: below
            lines = log.read_text(errors="replace").splitlines()
            bad = [ln for ln in lines if " ERROR " in ln or " WARN " in ln or "Exception" in ln]
            parts.append(f"--- {log.name}: {len(lines)} lines, last problems:")
            parts.extend(ln[:400] for ln in bad[-15:])
        return "\n".join(parts)

    def checkpoints(self, job_id: str) -> dict[str, Any]:
        return self.rest(f"/jobs/{job_id}/checkpoints")  # type: ignore[no-any-return]

    def cancel(self, job_id: str) -> None:
        try:
            self.rest(f"/jobs/{job_id}?mode=cancel", method="PATCH")
        except OSError:
            return
        wait_for(
            f"job {job_id} to end",
            lambda: self.job_status(job_id) in ("CANCELED", "FINISHED", "FAILED"),
            60,
        )

    def stop_with_savepoint(self, job_id: str, directory: Path) -> str:
        trig = self.rest(
            f"/jobs/{job_id}/stop",
            method="POST",
            body={"targetDirectory": str(directory), "drain": False},
        )["request-id"]

        def done() -> Any:
            st = self.rest(f"/jobs/{job_id}/savepoints/{trig}")
            if st["status"]["id"] != "COMPLETED":
                return None
            op = st["operation"]
            if "failure-cause" in op:
                raise AssertionError(f"savepoint failed: {op['failure-cause']}")
            return op["location"]

        return str(wait_for("the savepoint", done, 90))

    def stop(self) -> None:
        pids = list(self.started)
        for p in list(pids):
            pids += descendants(p)
        kill_pids(pids)


@contextlib.contextmanager
def reporting_cluster(base: Path, interval: str, log_reports: bool) -> Iterator[Cluster]:
    """A started cluster whose TaskManager runs Flink's SLF4J metric reporter (in the pip
    package's plugins) every `interval`, reading every metric; its reports go to the
    TaskManager's log only with `log_reports`."""
    c = Cluster(
        base,
        settings={
            "metrics.reporter.slf4j.factory.class": (
                "org.apache.flink.metrics.slf4j.Slf4jReporterFactory"
            ),
            "metrics.reporter.slf4j.interval": interval,
        },
    )
    if not log_reports:
        with open(c.conf / "log4j.properties", "a") as f:
            f.write(
                "\nlogger.metricreports.name = org.apache.flink.metrics.slf4j.Slf4jReporter\n"
                "logger.metricreports.level = OFF\n"
            )
    try:
        c.start()
        yield c
    finally:
        c.stop()


_ENDED = ("FINISHED", "CANCELED", "FAILED")


def _java_opts() -> str:
    text = (CONF / "config.yaml").read_text()
    for line in text.splitlines():
        if line.strip().startswith("all: --add-exports"):
            return line.strip()[len("all: ") :]
    return ""
