"""`ratchet run --supervise`: a supervisor process that runs the engine in a worker process,
restarts it when it dies, serves the REST status API, and stops cleanly.

Restarts: after --restart-delay seconds (doubled for each worker in a row that could not reach
a connector's server, up to UNREACHABLE_DELAY_CAP), at most --restart-attempts of them in a
row; a worker that ran --restart-reset-after seconds (from its first report) starts that count
again, so a job that runs for months is not given up for a few crashes weeks apart. The total
of restarts (/v1/job's `restarts`, the Prometheus counter) is never reset.

The worker is an ordinary `ratchet run` (same arguments, without `--supervise`); it reports
its checkpoint statistics and effective configuration over a pipe, one JSON line after its
restore and after every checkpoint. The replacement of a dead worker restores from the
state directory like any restart.

`GET /metrics` (Prometheus) is made from those reports. A worker's own counts (inputs, runs
completed, ctx.metrics counters, ...) start at zero in every worker; the supervisor adds the
last report of each ended worker to the current one's, so its counters only grow for as long as
the supervisor lives. Checkpoint counts are durable (kept in the state) and exported as they are.
"""

from __future__ import annotations

import errno
import importlib
import ipaddress
import json
import logging
import math
import os
import random
import re
import signal
import socket
import subprocess
import threading
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import EXIT_FAILED, EXIT_NO_RESTART, EXIT_OK, EXIT_USAGE, ConfigError
from ratchet.runtime._say import say
from ratchet.runtime._supervisor_env import (
    REFUSED_STATE_IN_USE,
    REFUSED_UNREACHABLE,
    RESOURCE_ID_ENV,
    REST_TOKEN_ENV,
    STATUS_FD_ENV,
    SUPERVISOR_PID_ENV,
    check_token,
)
from ratchet.store._sqlite import SUPERVISOR_LOCK_NAME, StateLock, state_dir_error

log = logging.getLogger("ratchet.supervisor")
# The supervisor's lifecycle lines (REST API address, a worker's death, a restart) are always
# shown: a logger of their own at INFO, so they pass without -v under --log-format json.
lifecycle = logging.getLogger("ratchet.supervisor.lifecycle")

# Counts of one worker (engine.status()), summed over workers for /metrics: name -> help.
WORKER_COUNTS = {
    "inputs": "inputs admitted",
    "runs_completed": "runs completed",
    "outputs": "outputs released to the output file",
    "runs_failed": "runs that ended in an error (each also a dead letter)",
    "dead_letters": "dead letters recorded (failed runs and bad lines)",
}
CHECKPOINT_DURATION_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
HISTORY_SAMPLES = 720
# While a worker cannot reach a connector's server at start, the delay before the next one
# doubles from --restart-delay up to this (or --restart-delay, if that is longer).
UNREACHABLE_DELAY_CAP = 30.0
# A worker that has run this long (seconds since its first report) starts the count of
# restarts that --restart-attempts limits again (--restart-reset-after; 0: never).
RESTART_RESET_AFTER = 600.0
_LABELLED = re.compile(r"^(?P<name>[^\[\]]+)\[(?P<label>.*)\]$")


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    resource_id: str
    started: float
    reader: threading.Thread | None = None
    # What held the state's lock when this worker was refused it ("pid 123"), as it said on
    # its pipe before it exited 2; None for any other end.
    state_in_use_by: str | None = None
    # The connector's server it could not reach at start ("PostgreSQL at db:5432"), as it said
    # on its pipe before it exited 2; None for any other end.
    unreachable: str | None = None
    # clock.monotonic() at its first report (its restore done: running); None until then, and
    # for a worker refused at start (it never reports).
    running_since: float | None = None


@dataclass
class SupervisorState:
    state: str = "starting"
    restarts: int = 0  # in all, since the supervisor started: only grows
    # The restarts --restart-attempts limits: those since the supervisor started or since the
    # last worker that ran --restart-reset-after seconds (see Supervisor.counted_restarts).
    window_restarts: int = 0
    worker: _Worker | None = None
    last_exit: str | None = None
    report: dict[str, Any] | None = None
    started: float = 0.0
    # For /metrics: the counts of ended workers (their last reports), summed; the highest
    # completed checkpoint id seen (each newer one is observed once in the duration histogram).
    ended_counts: dict[str, float] = field(default_factory=dict)
    worker_counts: dict[str, float] = field(default_factory=dict)
    # per shard of a sharded job ("": a one-process job): checkpoint ids are each shard's own
    last_completed_ids: dict[str, int] = field(default_factory=dict)
    last_report_at: float | None = None
    # For the dashboard's charts: one sample per worker report (after a restore and after
    # every checkpoint), the newest HISTORY_SAMPLES of them.
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY_SAMPLES))


def _counts_of(report: dict[str, Any] | None) -> dict[str, float]:
    """A worker's own counts in a report: WORKER_COUNTS and its ctx.metrics counters."""
    status = (report or {}).get("status") or {}
    counts: dict[str, float] = {}
    for name in WORKER_COUNTS:
        value = status.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            counts[name] = float(value)
    for name, value in (status.get("metrics") or {}).items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            counts[f"metrics:{name}"] = float(value)
    # A sharded job: the coordinator's restarts of each shard's worker. Counted from zero by
    # every coordinator, so kept with the other counts of an ended worker (monotonic).
    for shard in (report or {}).get("shards") or []:
        if isinstance(shard, dict) and type(shard.get("shard")) is int:
            restarts = shard.get("restarts")
            if type(restarts) is int:
                counts[f"shard_restarts:{shard['shard']}"] = float(restarts)
    return counts


def unreachable_delay(delay: float, waits: int) -> float:
    """The delay before the next worker after the `waits`-th worker in a row that could not
    reach a connector's server: `delay` (--restart-delay), doubled for each one before it, up
    to UNREACHABLE_DELAY_CAP (or `delay`, if that is longer)."""
    return min(delay * 2.0 ** min(waits - 1, 30), max(delay, UNREACHABLE_DELAY_CAP))


def _check_seconds(flag: str, value: float, zero: str | None = None) -> None:
    """Refuse a negative, infinite or NaN number of seconds for `flag`, naming the value."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        hint = f" ({zero})" if zero else ""
        raise ConfigError(f"{flag} must be a number of seconds >= 0{hint}, not {shown}")


def is_loopback(host: str) -> bool:
    """True for a loopback address or `localhost`: a REST API there needs no token."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_host(host: str) -> str:
    """`host` as a URL holds it: an IPv6 address in brackets (`http://[::1]:8765/`; without
    them a browser or curl reads the address's colons as the port)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for the REST API on `host`:`port` (each address the host has, as
    uvicorn would bind them), bound before anything else is made: a port in use is one line
    naming --rest-port and the fix, exit 2 (it was uvicorn's `[Errno 98]` line, a ratchet line
    that did not say why, and a state directory holding only the supervisor's lock)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(
            bare or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ConfigError(
            f"--rest-host {host}: not an address to listen on ({reason}); give an address of "
            f"this machine, such as 127.0.0.1 (the default)"
        ) from None
    addresses = list(dict.fromkeys((family, addr) for family, _, _, _, addr in infos))
    sockets: list[socket.socket] = []
    try:
        for family, addr in addresses:
            if port == 0 and sockets:  # the other addresses of the host: the port chosen
                addr = (addr[0], sockets[0].getsockname()[1], *addr[2:])
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:  # as asyncio binds: each family its own socket
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
                sock.listen(2048)  # listening: no other socket may bind the port meanwhile
            except OSError:
                sock.close()
                if port == 0 and sockets:
                    continue  # the port chosen for the first is taken here: serve the first
                raise
            sockets.append(sock)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--rest-port {port} is already in use on {host}: give another port "
                f"(--rest-port 0 picks a free one), or stop what listens on it (another "
                f"supervised job?)"
            ) from None
        raise ConfigError(
            f"--rest-host {host} --rest-port {port}: cannot listen there "
            f"({exc.strerror or exc}); give another port or an address of this machine"
        ) from None
    return sockets


def require_rest_server() -> None:
    """Refuse `--rest-port` without the `server` extra, before anything is started or created."""
    missing = []
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ConfigError(
            f"--rest-port needs the server extra ({', '.join(missing)} not installed): "
            f"pip install 'ratchet[server]'"
        )


class Supervisor:
    def __init__(
        self,
        worker_argv: list[str],
        state_dir: str | os.PathLike[str],
        restart_attempts: int = 10,
        restart_delay: float = 1.0,
        restart_reset_after: float = RESTART_RESET_AFTER,
        rest_host: str = "127.0.0.1",
        rest_port: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
        rest_token: str | None = None,
        log_format: str = "text",
    ) -> None:
        """`rest_token`: None reads the environment variable RATCHET_REST_TOKEN; a REST API on
        an address other than loopback is refused without one. `log_format` "json": the
        lifecycle lines are log records (one JSON object each), else plain stderr lines.
        `restart_reset_after`: seconds a worker must run (from its first report) to start the
        count of restarts that `restart_attempts` limits again; 0: never."""
        if restart_attempts < 0:
            raise ConfigError(f"--restart-attempts must be >= 0, not {restart_attempts}")
        _check_seconds("--restart-delay", restart_delay)
        _check_seconds("--restart-reset-after", restart_reset_after, zero="0: never")
        if rest_token is None:
            rest_token = os.environ.get(REST_TOKEN_ENV) or None
        if rest_token is not None:
            check_token(rest_token)
        if rest_port is not None:
            require_rest_server()
            if rest_token is None and not is_loopback(rest_host):
                raise ConfigError(
                    f"--rest-host {rest_host} is not a loopback address: the REST API there "
                    f"needs a token, --rest-token TOKEN or the environment variable "
                    f"{REST_TOKEN_ENV} (clients send `Authorization: Bearer TOKEN`)"
                )
        self.rest_token = rest_token
        self.log_format = log_format
        self.worker_argv = worker_argv
        self.state_dir = Path(state_dir)
        self.attempts = restart_attempts
        self.delay = restart_delay
        self.reset_after = float(restart_reset_after)
        self.rest_host = rest_host
        self.rest_port = rest_port
        self.clock = clock
        self.rng = rng if rng is not None else random.Random()
        self.s = SupervisorState(started=clock.now())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: Any = None
        self._registry: Any = None
        self._durations: Any = None
        if rest_port is not None:
            self._init_prometheus()

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
                restarts_counted=self._counted_restarts(),
                uptime_seconds=now - self.s.started,
                worker_uptime_seconds=(now - w.started) if w else None,
                last_exit=self.s.last_exit,
                in_flight_runs=status.get("in_flight_runs"),
                queued_inputs=status.get("buffered_inputs"),
                waiting=status.get("waiting"),
                paused=status.get("paused"),
                shards=self._shards_since_start(),
            )

    def _ran_past_reset(self, worker: _Worker | None) -> bool:
        """Whether `worker` has run --restart-reset-after seconds since its first report."""
        return (
            self.reset_after > 0
            and worker is not None
            and worker.running_since is not None
            and self.clock.monotonic() - worker.running_since >= self.reset_after
        )

    def _counted_restarts(self) -> int:
        """Under the lock: the restarts --restart-attempts limits now (`restart N/attempts` in
        the log): 0 once the live worker has run --restart-reset-after seconds, as its death
        will find it."""
        w = self.s.worker
        if w is not None and w.proc.poll() is None and self._ran_past_reset(w):
            return 0
        return self.s.window_restarts

    def _shards_since_start(self) -> list[Any] | None:
        """Under the lock: the report's shards, each one's `restarts` counted since this
        supervisor started (a restarted coordinator counts its shards' restarts from 0; the
        ended coordinators' counts are kept as for /metrics, see `_counts_of`)."""
        shards = (self.s.report or {}).get("shards")
        if not isinstance(shards, list):
            return shards
        whole: list[Any] = []
        for shard in shards:
            if isinstance(shard, dict) and type(shard.get("shard")) is int:
                name = f"shard_restarts:{shard['shard']}"
                total = self.s.ended_counts.get(name, 0.0) + self.s.worker_counts.get(name, 0.0)
                shard = dict(shard, restarts=int(total))
            whole.append(shard)
        return whole

    def send_signal(
        self, key: str, name: str, value: Any, key_type: str = "auto"
    ) -> dict[str, Any]:
        """REST: store a signal in the job's state (picked up by the worker, or the next; of a
        sharded job, in the key's shard)."""
        from ratchet.runtime._signals import send_signal

        sent = send_signal(self.state_dir, key, name, value, clock=self.clock, key_type=key_type)
        return {k: sent[k] for k in ("id", "key", "name", "sent_at", "key_type") if k in sent}

    def redrive(
        self, all_letters: bool, key: str | None, dead_id: int | None, key_type: str = "auto"
    ) -> dict[str, Any]:
        """REST: mark dead letters for redrive (the worker admits each once); `key_type` says
        which of the integer key 1 and the string key "1" a key's text is."""
        from ratchet.runtime._deadletters import request_redrive

        done = request_redrive(
            self.state_dir,
            all_letters=all_letters,
            key=key,
            dead_id=dead_id,
            clock=self.clock,
            key_type=key_type,
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
            restart_strategy=RestartStrategy(
                attempts=self.attempts,
                delay_seconds=self.delay,
                reset_after_seconds=self.reset_after,
                unreachable_delay_factor=2.0,
                unreachable_max_delay_seconds=max(self.delay, UNREACHABLE_DELAY_CAP),
            ),
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

    # -- Prometheus ---------------------------------------------------------------------------

    def _init_prometheus(self) -> None:
        """A registry of this supervisor's own (never the global one): a histogram fed from the
        reports, and a collector that reads the rest from the supervisor's state per scrape."""
        from prometheus_client import CollectorRegistry, Histogram

        registry = CollectorRegistry(auto_describe=False)
        self._durations = Histogram(
            "ratchet_checkpoint_duration_seconds",
            "duration of each completed checkpoint a worker reported",
            buckets=CHECKPOINT_DURATION_BUCKETS,
            registry=registry,
        )
        registry.register(_JobCollector(self))
        self._registry = registry

    def prometheus(self) -> tuple[bytes, str]:
        """REST: the body and content type of GET /metrics."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        assert self._registry is not None, "made when a REST port is set"
        return generate_latest(self._registry), CONTENT_TYPE_LATEST

    def _observe(self, report: dict[str, Any]) -> None:
        """Under the lock: feed newly completed checkpoints to the duration histogram (a
        sharded job's report has each shard's own under "shards")."""
        shards = report.get("shards")
        if isinstance(shards, list):
            for shard in shards:
                if isinstance(shard, dict):
                    self._observe_one(str(shard.get("shard")), shard.get("checkpoints") or {})
        else:
            self._observe_one("", report.get("checkpoints") or {})

    def _observe_one(self, which: str, checkpoints: dict[str, Any]) -> None:
        latest_all = checkpoints.get("latest") or {}
        latest = latest_all.get("completed")
        if not isinstance(latest, dict) or not isinstance(latest.get("id"), int):
            return
        last = self.s.last_completed_ids.get(which)
        if last is not None and latest["id"] <= last:
            return  # seen already (a restarted worker reports the restored one again)
        self.s.last_completed_ids[which] = latest["id"]
        restored = latest_all.get("restored")
        if isinstance(restored, dict) and restored.get("id") == latest["id"]:
            return  # the checkpoint a worker restored, made before this supervisor saw it
        if self._durations is not None and isinstance(latest.get("duration_ms"), int | float):
            self._durations.observe(latest["duration_ms"] / 1000.0)

    def _sample(self, report: dict[str, Any]) -> dict[str, Any]:
        """Under the lock: one point of the dashboard's charts. Counts are totals over this
        supervisor's workers (as /metrics has them), so a restart does not drop a line to 0."""
        status = report.get("status") or {}
        sample: dict[str, Any] = {"t": self.clock.now()}
        for name in WORKER_COUNTS:
            sample[name] = self.s.ended_counts.get(name, 0.0) + self.s.worker_counts.get(name, 0.0)
        sample["in_flight_runs"] = status.get("in_flight_runs")
        sample["queued_inputs"] = status.get("buffered_inputs")
        sample["waiting_runs"] = len(status.get("waiting") or [])
        latest = ((report.get("checkpoints") or {}).get("latest") or {}).get("completed")
        if isinstance(latest, dict):
            sample["checkpoint"] = {
                k: latest.get(k) for k in ("id", "duration_ms", "size_bytes", "trigger_timestamp")
            }
        else:
            sample["checkpoint"] = None
        sample["restarts"] = self.s.restarts
        return sample

    def history(self) -> list[dict[str, Any]]:
        """REST: the samples of the dashboard's charts, oldest first."""
        with self._lock:
            return list(self.s.history)

    def open_state(self) -> Any:
        """REST: a read-only view of the job's state (closed by the caller); StateError while
        no worker has created it."""
        from ratchet._state_api import open_state

        return open_state(self.state_dir)

    def _end_worker(self, worker: _Worker) -> None:
        """After a worker exited: read its last reports, then keep its counts in the totals."""
        if worker.reader is not None:
            worker.reader.join(timeout=5)  # the pipe closes with the worker
        with self._lock:
            for name, value in self.s.worker_counts.items():
                self.s.ended_counts[name] = self.s.ended_counts.get(name, 0.0) + value
            self.s.worker_counts = {}  # the next worker counts from zero

    def _start_rest(self, sockets: list[socket.socket]) -> None:
        """Serve the REST API on `sockets` (from `listen`) in a thread of its own."""
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
            prometheus=self.prometheus,
            token=self.rest_token,
            history=self.history,
            open_state=self.open_state,
        )
        config = uvicorn.Config(app, host=self.rest_host, port=self.rest_port, log_level="warning")
        server = uvicorn.Server(config)
        # uvicorn installs signal handlers only from the main thread; this one is not, so the
        # supervisor's own SIGTERM/SIGINT handlers stay in charge.
        self._server = server
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": sockets}, name="ratchet-rest", daemon=True
        )
        thread.start()
        deadline = self.clock.monotonic() + 10
        while not server.started and thread.is_alive() and self.clock.monotonic() < deadline:
            self.clock.sleep_sync(0.01)
        base = f"http://{url_host(self.rest_host)}:{self.rest_port}"
        if not server.started:
            raise ConfigError(f"the REST API could not start on {base}")
        self._say(
            logging.INFO,
            f"REST API on {base}/v1/job, dashboard on {base}/ (`ratchet status --url {base}`)",
        )

    def _say(self, level: int, message: str) -> None:
        say(lifecycle, message, self.log_format, level)

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
        env.pop(REST_TOKEN_ENV, None)  # the worker serves nothing: the token stays here
        proc = subprocess.Popen(self.worker_argv, env=env, pass_fds=(write_fd,))
        os.close(write_fd)
        reader = threading.Thread(
            target=self._read_reports, args=(read_fd, resource_id), daemon=True
        )
        reader.start()
        log.info("worker pid %d started (resource %s)", proc.pid, resource_id)
        return _Worker(proc, resource_id, self.clock.now(), reader)

    def _read_reports(self, fd: int, resource_id: str) -> None:
        with os.fdopen(fd, "r", encoding="utf-8") as fh:
            for line in fh:
                try:
                    report = json.loads(line)
                except ValueError:
                    log.warning("unreadable worker report: %r", line[:200])
                    continue
                if isinstance(report, dict) and REFUSED_STATE_IN_USE in report:
                    with self._lock:
                        w = self.s.worker
                        if w is not None and w.resource_id == resource_id:
                            w.state_in_use_by = str(report[REFUSED_STATE_IN_USE])
                    continue
                if isinstance(report, dict) and REFUSED_UNREACHABLE in report:
                    with self._lock:
                        w = self.s.worker
                        if w is not None and w.resource_id == resource_id:
                            w.unreachable = str(report[REFUSED_UNREACHABLE])
                    continue
                with self._lock:
                    if self.s.worker is not None and self.s.worker.resource_id == resource_id:
                        if self.s.worker.running_since is None:
                            self.s.worker.running_since = self.clock.monotonic()
                        self.s.report = report
                        self.s.worker_counts = _counts_of(report)
                        self.s.last_report_at = self.clock.now()
                        self._observe(report)
                        self.s.history.append(self._sample(report))
                        if self.s.state in ("starting", "restarting"):
                            self.s.state = "running"

    def request_stop(self, signum: int | None = None, _frame: Any = None) -> None:
        # A signal handler: it runs between two bytecodes of the main thread, which may hold
        # `_lock` (starting a worker), so it takes no lock (it hung there); a worker being
        # started meanwhile is stopped by `_supervise` once it exists.
        self._stop.set()
        w = self.s.worker
        if w is not None and w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        # The stop handlers first: a SIGTERM from the moment the supervisor holds its lock
        # (what a caller can see) is a clean stop, not the default death.
        previous = {s: signal.signal(s, self.request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        sockets: list[socket.socket] = []
        try:
            if self.rest_port is not None:  # before the state directory is made
                sockets = listen(self.rest_host, self.rest_port)
                # --rest-port 0: the port the system chose
                self.rest_port = int(sockets[0].getsockname()[1])
            try:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                lock = StateLock(self.state_dir, name=SUPERVISOR_LOCK_NAME)
                lock.acquire()
            except OSError as exc:
                raise state_dir_error(self.state_dir, exc) from exc
            try:
                self._start_rest(sockets)
                return self._supervise()
            finally:
                if self._server is not None:
                    self._server.should_exit = True
                lock.release()
        finally:
            if self._server is None:  # never served: uvicorn closes those it served on
                for sock in sockets:
                    sock.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _supervise(self) -> int:
        waits = 0  # workers in a row that could not reach a connector's server
        while True:
            if self._stop.is_set():  # asked to stop before a worker started: none starts
                with self._lock:
                    self.s.state = "finished"
                return EXIT_OK
            with self._lock:
                self.s.worker = self._spawn()
                worker = self.s.worker
            if self._stop.is_set():  # asked while it started: the handler did not see it
                worker.proc.send_signal(signal.SIGTERM)
            rc = worker.proc.wait()
            self._end_worker(worker)
            how = f"exit code {rc}" if rc >= 0 else f"killed by {signal.Signals(-rc).name}"
            with self._lock:
                self.s.last_exit = f"pid {worker.proc.pid}: {how}"
            if rc == 0:
                with self._lock:
                    self.s.state = "finished"
                return EXIT_OK
            if self._stop.is_set():
                if rc == -signal.SIGTERM:
                    # Our SIGTERM ended it before it had set up its own stop (still starting):
                    # nothing of it was committed that a restart would not find.
                    with self._lock:
                        self.s.state = "finished"
                    return EXIT_OK
                with self._lock:
                    self.s.state = "failed"
                return rc if rc > 0 else EXIT_FAILED
            waiting = rc == EXIT_USAGE and worker.unreachable is not None
            if worker.running_since is not None:
                waits = 0  # it ran: a server it lost mid-run starts a new streak
            waits = waits + 1 if waiting else 0
            what = f"worker died ({how})"
            if rc == EXIT_USAGE and worker.state_in_use_by is not None:
                # Refused only because another process held the state's lock for a moment
                # (`ratchet signal` upgrading an old schema, a command of an older ratchet):
                # that is gone by the next attempt, so it is restarted like a death.
                how = f"exit code {rc}: the state directory was in use by {worker.state_in_use_by}"
                what = f"worker died ({how})"
            elif waiting:
                # A connector's server was down or not yet taking connections (a database
                # restarting, a host that rebooted with ratchet first), at start or lost by a
                # source mid-run: the next worker starts from the last checkpoint as any does.
                what = f"worker could not reach {worker.unreachable} ({how})"
                with self._lock:
                    self.s.last_exit = (
                        f"pid {worker.proc.pid}: {how}: cannot reach {worker.unreachable}"
                    )
            elif rc in EXIT_NO_RESTART:
                with self._lock:
                    self.s.state = "failed"
                self._say(logging.ERROR, f"worker failed ({how}); not restarting")
                return rc
            again = ""
            with self._lock:
                if self._ran_past_reset(worker):
                    # It ran --restart-reset-after seconds: the deaths before it were not one
                    # crash loop, so the count --restart-attempts limits starts again (and a
                    # worker that ran was not refused: the unreachable doubling is at 1 too).
                    assert worker.running_since is not None
                    if self.s.window_restarts:
                        ran = self.clock.monotonic() - worker.running_since
                        again = (
                            f" (the count started again: the worker had run {ran:.1f} s, "
                            f"--restart-reset-after {self.reset_after:g} s)"
                        )
                    self.s.window_restarts = 0
                if self.s.window_restarts >= self.attempts:
                    self.s.state = "failed"
                    self._say(
                        logging.ERROR,
                        f"{what} and the {self.attempts} restart attempts are used up; the "
                        f"state directory keeps the last checkpoint",
                    )
                    return EXIT_FAILED
                self.s.restarts += 1
                self.s.window_restarts += 1
                counted = self.s.window_restarts
                self.s.state = "restarting"
            delay = self.delay
            if waiting:
                delay = unreachable_delay(self.delay, waits)
                self._say(
                    logging.WARNING,
                    f"{what}: waiting for it, retrying: restart {counted}/"
                    f"{self.attempts} in {delay:g} s (the delay doubles while it cannot be "
                    f"reached, up to {max(self.delay, UNREACHABLE_DELAY_CAP):g} s)",
                )
            else:
                self._say(
                    logging.WARNING,
                    f"{what}; restart {counted}/{self.attempts} in {delay:g} s{again}",
                )
            if self._stop.wait(delay):
                with self._lock:
                    self.s.state = "finished"
                return EXIT_OK


class _JobCollector:
    """Reads the supervisor's state at each scrape (prometheus_client's custom collector).

    Counters: worker counts summed over the workers of this supervisor (see the module doc),
    durable checkpoint counts as the latest report has them, worker restarts (the supervisor's
    and the coordinator's of shard workers). Gauges: what the
    latest report shows now (in-flight runs, buffered inputs, waiting runs, paused resources,
    the latest checkpoint's size); omitted until a worker has reported.
    """

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        metric: str
        help_text: str
        value: Any
        sup = self.sup
        with sup._lock:
            s = sup.s
            state = s.state
            restarts = s.restarts
            counted = sup._counted_restarts()
            worker_up = s.worker is not None and s.worker.proc.poll() is None
            report = s.report
            last_report_at = s.last_report_at
            totals = dict(s.ended_counts)
            for name, value in s.worker_counts.items():
                totals[name] = totals.get(name, 0.0) + value

        shard_restarts = {
            name.removeprefix("shard_restarts:"): value
            for name, value in totals.items()
            if name.startswith("shard_restarts:")
        }
        restarts_metric = CounterMetricFamily(
            "ratchet_worker_restarts",
            "workers restarted after dying: by the supervisor, and (--workers N) each shard's "
            "worker by the coordinator",
        )
        restarts_metric.add_metric([], restarts + sum(shard_restarts.values()))
        yield restarts_metric
        if shard_restarts:
            per_shard = CounterMetricFamily(
                "ratchet_shard_restarts",
                "a shard's worker restarted by the coordinator after dying (--workers N)",
                labels=["shard"],
            )
            for shard, value in sorted(shard_restarts.items(), key=lambda kv: int(kv[0])):
                per_shard.add_metric([shard], value)
            yield per_shard
        left = GaugeMetricFamily(
            "ratchet_worker_restarts_counted",
            "the supervisor's restarts that --restart-attempts limits now (it gives up at the "
            "next death once this equals the attempts); 0 again after a worker ran "
            "--restart-reset-after seconds",
        )
        left.add_metric([], float(counted))
        yield left
        up = GaugeMetricFamily("ratchet_worker_up", "1 while a worker process is alive")
        up.add_metric([], 1.0 if worker_up else 0.0)
        yield up
        states = GaugeMetricFamily(
            "ratchet_job_state", "1 for the job's current state", labels=["state"]
        )
        for name in ("starting", "running", "restarting", "finished", "failed"):
            states.add_metric([name], 1.0 if name == state else 0.0)
        yield states

        for name, help_text in WORKER_COUNTS.items():
            if name in totals:
                c = CounterMetricFamily(
                    f"ratchet_{name}", f"{help_text}, summed over the supervisor's workers"
                )
                c.add_metric([], totals[name])
                yield c
        calls = CounterMetricFamily(
            "ratchet_model_calls",
            "chat model calls made (not replayed), by model setup",
            labels=["model"],
        )
        tokens = CounterMetricFamily(
            "ratchet_model_tokens",
            "chat model tokens paid for, by model setup and direction",
            labels=["model", "direction"],
        )
        agent = CounterMetricFamily(
            "ratchet_agent_counter",
            "ctx.metrics counters (durable_calls.made, chat.model_calls, ...), by name",
            labels=["name"],
        )
        for key, value in sorted(totals.items()):
            if not key.startswith("metrics:"):
                continue
            name = key.removeprefix("metrics:")
            labelled = _LABELLED.match(name)
            if labelled is None:
                agent.add_metric([name], value)
            elif labelled["name"] == "chat.model_calls":
                calls.add_metric([labelled["label"]], value)
            elif labelled["name"] in ("chat.tokens.input", "chat.tokens.output"):
                direction = labelled["name"].rpartition(".")[2]
                tokens.add_metric([labelled["label"], direction], value)
            else:
                agent.add_metric([name], value)
        yield calls
        yield tokens
        yield agent

        if report is None:
            return
        if last_report_at is not None:
            at = GaugeMetricFamily(
                "ratchet_last_report_timestamp_seconds",
                "when the current worker last reported (after its restore or a checkpoint)",
            )
            at.add_metric([], last_report_at)
            yield at
        cp = report.get("checkpoints") or {}
        counts = cp.get("counts") or {}
        for name, help_text in (
            ("completed", "checkpoints completed (durable: kept in the state directory)"),
            ("failed", "checkpoints failed (durable)"),
        ):
            c = CounterMetricFamily(f"ratchet_checkpoints_{name}", help_text)
            c.add_metric([], float(counts.get(name) or 0))
            yield c
        restores = CounterMetricFamily(
            "ratchet_checkpoint_restores", "restores from a checkpoint (durable)"
        )
        restores.add_metric([], float(counts.get("restored") or 0))
        yield restores
        in_progress = GaugeMetricFamily(
            "ratchet_checkpoints_in_progress", "checkpoints being written"
        )
        in_progress.add_metric([], float(counts.get("in_progress") or 0))
        yield in_progress
        latest = cp.get("latest") or {}
        completed = latest.get("completed")
        if isinstance(completed, dict):
            for metric, help_text, value in (
                ("id", "id of the latest completed checkpoint", completed.get("id")),
                (
                    "size_bytes",
                    "size of the latest completed checkpoint",
                    completed.get("size_bytes"),
                ),
                (
                    "timestamp_seconds",
                    "trigger time of the latest completed checkpoint",
                    completed.get("trigger_timestamp"),
                ),
            ):
                if isinstance(value, int | float):
                    g = GaugeMetricFamily(f"ratchet_checkpoint_last_{metric}", help_text)
                    g.add_metric([], float(value))
                    yield g
        restore_seconds = (report.get("status") or {}).get("restore_seconds")
        if isinstance(restore_seconds, int | float) and not isinstance(restore_seconds, bool):
            g = GaugeMetricFamily(
                "ratchet_restore_duration_seconds",
                "how long the current worker's start took to read the state and rebuild its "
                "keys and runs in flight (its restore, or its start on a new state)",
            )
            g.add_metric([], float(restore_seconds))
            yield g
        restored = latest.get("restored")
        if isinstance(restored, dict) and isinstance(restored.get("restored_at"), int | float):
            g = GaugeMetricFamily(
                "ratchet_checkpoint_last_restore_timestamp_seconds",
                "when the latest restore from a checkpoint happened",
            )
            g.add_metric([], float(restored["restored_at"]))
            yield g

        status = report.get("status") or {}
        waiting = status.get("waiting")
        paused = status.get("paused")
        for metric, help_text, value in (
            ("in_flight_runs", "runs in flight", status.get("in_flight_runs")),
            ("buffered_inputs", "inputs admitted and not finished (queue depth)",
             status.get("buffered_inputs")),
            ("waiting_runs", "runs parked in a durable wait (sleep, signal, delayed event)",
             len(waiting) if isinstance(waiting, list) else None),
            ("paused_resources", "resources unavailable (no new input admitted meanwhile)",
             len(paused) if isinstance(paused, list) else None),
        ):  # fmt: skip
            if isinstance(value, int | float):
                g = GaugeMetricFamily(f"ratchet_{metric}", f"{help_text}, at the latest report")
                g.add_metric([], float(value))
                yield g
        if isinstance(paused, list):
            g = GaugeMetricFamily(
                "ratchet_resource_paused", "1 for each resource paused now", labels=["resource"]
            )
            for p in paused:
                if isinstance(p, dict) and "resource" in p:
                    g.add_metric([str(p["resource"])], 1.0)
            yield g
