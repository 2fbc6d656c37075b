"""`ratchet run --supervise`: a supervisor process that runs the engine in a worker process,
restarts it when it dies (fixed delay), serves the REST status API, and stops cleanly.

The worker is an ordinary `ratchet run` (same arguments, without `--supervise`); it reports
its checkpoint statistics and effective configuration over a pipe, one JSON line after its
restore and after every checkpoint. The replacement of a dead worker restores from the
state directory like any restart.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import EXIT_FAILED, EXIT_NO_RESTART, EXIT_OK, ConfigError
from ratchet.store._sqlite import StateLock

log = logging.getLogger("ratchet.supervisor")

STATUS_FD_ENV = "RATCHET_STATUS_FD"
RESOURCE_ID_ENV = "RATCHET_RESOURCE_ID"
SUPERVISOR_PID_ENV = "RATCHET_SUPERVISOR_PID"


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    resource_id: str
    started: float


@dataclass
class SupervisorState:
    state: str = "starting"
    restarts: int = 0
    worker: _Worker | None = None
    last_exit: str | None = None
    report: dict[str, Any] | None = None
    started: float = 0.0


def require_rest_server() -> None:
    """Refuse `--rest-port` without the `server` extra, before anything is started or created."""
    missing = []
    for module in ("fastapi", "uvicorn"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ConfigError(
            f"--rest-port needs the server extra ({' and '.join(missing)} not installed): "
            f"pip install 'ratchet[server]'"
        )


class Supervisor:
    def __init__(
        self,
        worker_argv: list[str],
        state_dir: str | os.PathLike[str],
        restart_attempts: int = 10,
        restart_delay: float = 1.0,
        rest_host: str = "127.0.0.1",
        rest_port: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
    ) -> None:
        if restart_attempts < 0 or restart_delay < 0:
            raise ConfigError("--restart-attempts and --restart-delay must be >= 0")
        if rest_port is not None:
            require_rest_server()
        self.worker_argv = worker_argv
        self.state_dir = Path(state_dir)
        self.attempts = restart_attempts
        self.delay = restart_delay
        self.rest_host = rest_host
        self.rest_port = rest_port
        self.clock = clock
        self.rng = rng if rng is not None else random.Random()
        self.s = SupervisorState(started=clock.now())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: Any = None

    # -- the REST views ---------------------------------------------------------------------

    def job_info(self) -> Any:
        from ratchet.runtime._rest import JobInfo

        with self._lock:
            w = self.s.worker
            now = self.clock.now()
            status = (self.s.report or {}).get("status") or {}
            return JobInfo(
                state=self.s.state,  # type: ignore[arg-type]
                worker_pid=w.proc.pid if w else None,
                resource_id=w.resource_id if w else None,
                restarts=self.s.restarts,
                uptime_seconds=now - self.s.started,
                worker_uptime_seconds=(now - w.started) if w else None,
                last_exit=self.s.last_exit,
                in_flight_runs=status.get("in_flight_runs"),
                queued_inputs=status.get("buffered_inputs"),
                waiting=status.get("waiting"),
                paused=status.get("paused"),
            )

    def send_signal(self, key: str, name: str, value: Any) -> dict[str, Any]:
        """REST: store a signal in the job's state (picked up by the worker, or the next)."""
        from ratchet.runtime._signals import send_signal

        sent = send_signal(self.state_dir, key, name, value, clock=self.clock)
        return {k: sent[k] for k in ("id", "key", "name", "sent_at")}

    def redrive(self, all_letters: bool, key: str | None, dead_id: int | None) -> dict[str, Any]:
        """REST: mark dead letters for redrive (the worker admits each once)."""
        from ratchet.runtime._deadletters import request_redrive

        done = request_redrive(
            self.state_dir, all_letters=all_letters, key=key, dead_id=dead_id, clock=self.clock
        )
        return {k: done[k] for k in ("marked", "bad_lines_skipped")}

    def checkpoint_stats(self) -> Any:
        from ratchet.runtime._rest import CheckpointStatistics

        with self._lock:
            report = self.s.report
        if report is None:
            return None
        return CheckpointStatistics.model_validate(report["checkpoints"])

    def job_config(self) -> Any:
        from ratchet.runtime._rest import JobConfig, RestartStrategy

        with self._lock:
            report = self.s.report
        if report is None:
            return None
        engine = report["config"]
        return JobConfig(
            checkpoint_interval_ms=engine["checkpoint_interval"] * 1000.0,
            tolerable_checkpoint_failures=engine["tolerable_checkpoint_failures"],
            max_concurrent_runs=engine["max_concurrent_runs"],
            max_buffered_inputs=engine["max_buffered_inputs"],
            restart_strategy=RestartStrategy(attempts=self.attempts, delay_seconds=self.delay),
            state_dir=str(self.state_dir),
            engine=engine,
        )

    def job_metrics(self) -> Any:
        from ratchet.runtime._rest import JobMetrics

        with self._lock:
            report = self.s.report
        if report is None:
            return None
        return JobMetrics(counters=(report.get("status") or {}).get("metrics") or {})

    def _start_rest(self) -> None:
        if self.rest_port is None:
            return
        import uvicorn

        from ratchet.runtime._rest import create_app

        app = create_app(
            self.job_info,
            self.checkpoint_stats,
            self.job_config,
            self.job_metrics,
            self.send_signal,
            self.redrive,
        )
        config = uvicorn.Config(app, host=self.rest_host, port=self.rest_port, log_level="warning")
        server = uvicorn.Server(config)
        # uvicorn installs signal handlers only from the main thread; this one is not, so the
        # supervisor's own SIGTERM/SIGINT handlers stay in charge.
        self._server = server
        thread = threading.Thread(target=server.run, name="ratchet-rest", daemon=True)
        thread.start()
        deadline = self.clock.monotonic() + 10
        while not server.started and thread.is_alive() and self.clock.monotonic() < deadline:
            self.clock.sleep_sync(0.01)
        if not server.started:
            raise ConfigError(f"the REST API could not listen on {self.rest_host}:{self.rest_port}")
        print(
            f"ratchet: REST API on http://{self.rest_host}:{self.rest_port}/v1/job", file=sys.stderr
        )

    # -- workers ----------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        read_fd, write_fd = os.pipe()
        resource_id = uuid.UUID(int=self.rng.getrandbits(128), version=4).hex
        env = dict(
            os.environ,
            **{
                STATUS_FD_ENV: str(write_fd),
                RESOURCE_ID_ENV: resource_id,
                SUPERVISOR_PID_ENV: str(os.getpid()),
            },
        )
        proc = subprocess.Popen(self.worker_argv, env=env, pass_fds=(write_fd,))
        os.close(write_fd)
        reader = threading.Thread(
            target=self._read_reports, args=(read_fd, resource_id), daemon=True
        )
        reader.start()
        log.info("worker pid %d started (resource %s)", proc.pid, resource_id)
        return _Worker(proc, resource_id, self.clock.now())

    def _read_reports(self, fd: int, resource_id: str) -> None:
        with os.fdopen(fd, "r", encoding="utf-8") as fh:
            for line in fh:
                try:
                    report = json.loads(line)
                except ValueError:
                    log.warning("unreadable worker report: %r", line[:200])
                    continue
                with self._lock:
                    if self.s.worker is not None and self.s.worker.resource_id == resource_id:
                        self.s.report = report
                        if self.s.state in ("starting", "restarting"):
                            self.s.state = "running"

    def request_stop(self, signum: int | None = None, _frame: Any = None) -> None:
        self._stop.set()
        with self._lock:
            w = self.s.worker
        if w is not None and w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        lock = StateLock(self.state_dir, name="supervisor.lock")
        lock.acquire()
        previous = {s: signal.signal(s, self.request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._start_rest()
            return self._supervise()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self._server is not None:
                self._server.should_exit = True
            lock.release()

    def _supervise(self) -> int:
        while True:
            with self._lock:
                self.s.worker = self._spawn()
                worker = self.s.worker
            rc = worker.proc.wait()
            how = f"exit code {rc}" if rc >= 0 else f"killed by {signal.Signals(-rc).name}"
            with self._lock:
                self.s.last_exit = f"pid {worker.proc.pid}: {how}"
            if rc == 0:
                with self._lock:
                    self.s.state = "finished"
                return EXIT_OK
            if self._stop.is_set():
                with self._lock:
                    self.s.state = "failed"
                return rc if rc > 0 else EXIT_FAILED
            if rc in EXIT_NO_RESTART:
                with self._lock:
                    self.s.state = "failed"
                print(f"ratchet: worker failed ({how}); not restarting", file=sys.stderr)
                return rc
            with self._lock:
                if self.s.restarts >= self.attempts:
                    self.s.state = "failed"
                    print(
                        f"ratchet: worker died ({how}) and the {self.attempts} restart attempts "
                        f"are used up; the state directory keeps the last checkpoint",
                        file=sys.stderr,
                    )
                    return EXIT_FAILED
                self.s.restarts += 1
                self.s.state = "restarting"
            print(
                f"ratchet: worker died ({how}); restart {self.s.restarts}/{self.attempts} "
                f"in {self.delay:g} s",
                file=sys.stderr,
            )
            if self._stop.wait(self.delay):
                with self._lock:
                    self.s.state = "finished"
                return EXIT_OK
