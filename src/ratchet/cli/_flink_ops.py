"""`ratchet flink status/savepoint/stop/prune-journal`: a running Flink job, through the
JobManager's REST API.

Plain HTTP (urllib), no PyFlink: an operator can watch, snapshot and stop a job from any
machine that reaches the JobManager, without the 850 MB `flink` extra.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

from ratchet._clock import SYSTEM_CLOCK
from ratchet._errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE

JOBMANAGER_ENV = "RATCHET_FLINK_JOBMANAGER"
DEFAULT_JOBMANAGER = "localhost:8081"
TERMINAL = frozenset({"FINISHED", "CANCELED", "FAILED"})
# The agent operator's metrics (ratchet.flink._function), summed over its subtasks.
RATCHET_METRICS = (
    "ratchet.inputs",
    "ratchet.outputs",
    "ratchet.runs_in_flight",
    "ratchet.queued_inputs",
    "ratchet.tasks_executed",
    "ratchet.tasks_replayed",
)


# The operator's group in a metric's id (`<operator>.ratchet.inputs`), and its `ctx.metrics`
# counters: `<operator>.ratchet.counter.<name>.total`.
RATCHET_GROUP = ".ratchet."
COUNTER_GROUP = ".ratchet.counter."
METRICS_PER_REQUEST = 20


def _is_counter(metric_id: str) -> bool:
    return COUNTER_GROUP in metric_id and metric_id.endswith(".total")


class JobManagerError(Exception):
    """The JobManager could not be asked, or said no: the message says which and what to do."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


class JobManager:
    """The few REST calls these commands make (Flink 2.x's REST API, `/v1` paths)."""

    def __init__(self, address: str, timeout: float = 10.0, *, env_hint: bool = True) -> None:
        address = address.strip().rstrip("/")
        if "://" not in address:
            address = "http://" + address
        self.base = address
        self.timeout = timeout
        # What to change: `flink run` reads only its --jobmanager, not the environment.
        self.fix = "pass --jobmanager HOST:PORT (the JobManager's REST port, 8081 by default)"
        if env_hint:
            self.fix += f" or set {JOBMANAGER_ENV}"

    def call(self, path: str, method: str = "GET", body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = _errors_of(exc)
            if exc.code == 404:
                raise JobManagerError(f"{self.base}{path}: not found ({detail})") from None
            raise JobManagerError(f"{self.base}{path}: HTTP {exc.code} ({detail})") from None
        except http.client.InvalidURL as exc:  # `host:abc`: before any connection
            raise self._not_flink(str(exc)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise JobManagerError(
                f"cannot reach the JobManager at {self.base} ({reason}); is the cluster "
                f"running? {self.fix[0].upper()}{self.fix[1:]}"
            ) from None
        except http.client.HTTPException as exc:  # something answered, not in HTTP
            raise self._not_flink(f"{type(exc).__name__}: {str(exc)[:80]!r}") from None
        try:
            return json.loads(raw) if raw else {}
        except ValueError:  # an HTTP server, not Flink's REST API
            raise self._not_flink(f"{path} did not answer JSON: {raw[:60]!r}") from None

    def _not_flink(self, what: str) -> JobManagerError:
        return JobManagerError(f"{self.base} is not a Flink REST address ({what}); {self.fix}")

    def _dict(self, path: str) -> dict[str, Any]:
        got = self.call(path)
        if not isinstance(got, dict):
            raise self._not_flink(f"{path} answered {type(got).__name__}, not an object")
        return got

    def jobs(self) -> list[dict[str, Any]]:
        try:
            return list(self._dict("/jobs/overview").get("jobs", []))
        except JobManagerError as exc:
            if "not found" in str(exc):  # any HTTP server: Flink's REST API has this path
                raise self._not_flink("no /jobs/overview") from None
            raise

    def job(self, job_id: str) -> dict[str, Any]:
        _check_id(job_id)
        try:
            return self._dict(f"/jobs/{job_id}")
        except JobManagerError as exc:
            if "not found" in str(exc):
                raise JobManagerError(
                    f"no job {job_id} at {self.base}; `ratchet flink status` lists its jobs"
                ) from None
            raise

    def checkpoints(self, job_id: str) -> dict[str, Any]:
        return dict(self.call(f"/jobs/{job_id}/checkpoints"))

    def ratchet_metrics(self, job: dict[str, Any]) -> dict[str, float]:
        """The agent operators' `ratchet.*` metrics, summed over subtasks (empty when the job
        has none, or is not running)."""
        found: dict[str, float] = {}
        for vertex in job.get("vertices", []):
            base = f"/jobs/{job['jid']}/vertices/{vertex['id']}/subtasks/metrics"
            try:
                names = [m["id"] for m in self.call(base)]
            except JobManagerError:
                continue
            wanted = [n for n in names if n.endswith(RATCHET_METRICS) or _is_counter(n)]
            # A counter's name is the user's: escaped, and asked for a few at a time (an
            # agent may count many things; a request line has a length limit).
            for at in range(0, len(wanted), METRICS_PER_REQUEST):
                ids = ",".join(quote(n, safe="") for n in wanted[at : at + METRICS_PER_REQUEST])
                for m in self.call(f"{base}?get={ids}&agg=sum"):
                    short = m["id"][m["id"].find(RATCHET_GROUP) + 1 :]
                    found[short] = found.get(short, 0.0) + float(m.get("sum", 0.0))
        return found

    def savepoint(self, job_id: str, target: str | None, *, stop: bool, drain: bool = False) -> str:
        """Trigger a savepoint (and with `stop`, stop the job with it); wait for it; its path."""
        self.job(job_id)  # a clear error for an unknown job
        target = _target(target)
        if stop:
            body: dict[str, Any] = {"drain": drain, "formatType": "CANONICAL"}
            if target:
                body["targetDirectory"] = target
            trigger = self._trigger(f"/jobs/{job_id}/stop", body, target)
        else:
            body = {"cancel-job": False, "formatType": "CANONICAL"}
            if target:
                body["target-directory"] = target
            trigger = self._trigger(f"/jobs/{job_id}/savepoints", body, target)
        while True:
            got = self.call(f"/jobs/{job_id}/savepoints/{trigger}")
            if got.get("status", {}).get("id") == "COMPLETED":
                op = got.get("operation", {})
                if "location" in op:
                    return str(op["location"])
                cause = op.get("failure-cause", {})
                text = str(cause.get("stack-trace") or cause.get("serialized-throwable") or op)
                raise JobManagerError(
                    f"the savepoint of job {job_id} failed: {_root_cause(text)}", EXIT_FAILED
                )
            SYSTEM_CLOCK.sleep_sync(0.25)

    def _trigger(self, path: str, body: dict[str, Any], target: str | None) -> str:
        try:
            return str(self.call(path, "POST", body)["request-id"])
        except JobManagerError as exc:
            if target is None and NO_SAVEPOINT_DIR in str(exc):
                raise JobManagerError(
                    f"the cluster at {self.base} has no default savepoint folder "
                    "(execution.checkpointing.savepoint-dir): pass --target with a folder (an "
                    "absolute path or a URI) the JobManager and TaskManagers can write"
                ) from None
            raise


# Flink's refusal of a savepoint with no target and no cluster default ("Config key
# [execution.checkpointing.savepoint-dir] is not set. Property [...] must be provided.").
NO_SAVEPOINT_DIR = "savepoint-dir] is not set"


def _target(target: str | None) -> str | None:
    """A relative local path made absolute here: the JobManager would resolve it against its
    own working folder, wherever that is."""
    if target is None or "://" in target or target.startswith("file:"):
        return target
    return os.path.abspath(os.path.expanduser(target))


def _check_id(job_id: str) -> None:
    if len(job_id) != 32 or any(c not in "0123456789abcdef" for c in job_id.lower()):
        raise JobManagerError(
            f"{job_id!r} is not a Flink job id (32 hex digits); `ratchet flink status` lists them"
        )


def _errors_of(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        return exc.reason or "no detail"
    errors = body.get("errors") or [exc.reason]
    return _root_cause(str(errors[0]))


def _root_cause(text: str) -> str:
    """The last `Caused by:` line of a Java stack trace (or its first line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    causes = [ln for ln in lines if ln.startswith("Caused by:")]
    line = causes[-1][len("Caused by:") :].strip() if causes else (lines[0] if lines else text)
    return line[:400]


def jobmanager_of(args: argparse.Namespace) -> JobManager:
    return JobManager(args.jobmanager or os.environ.get(JOBMANAGER_ENV) or DEFAULT_JOBMANAGER)


def _jm_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--jobmanager",
        default=None,
        metavar="HOST:PORT",
        help=f"the JobManager's REST endpoint (default: ${JOBMANAGER_ENV} or {DEFAULT_JOBMANAGER})",
    )


def register(group: Any) -> None:
    """Add the operations commands to `ratchet flink`'s subparsers."""
    status = group.add_parser("status", help="a cluster's jobs, or one job's state in detail")
    status.add_argument("job", nargs="?", default=None, help="job id (default: list the jobs)")
    _jm_option(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    sp = group.add_parser("savepoint", help="take a savepoint of a running job (it keeps running)")
    sp.add_argument("job", help="job id")
    sp.add_argument(
        "--target",
        default=None,
        help="savepoint folder the cluster writes: a path (a relative one is taken from here) or a URI",
    )
    _jm_option(sp)
    sp.set_defaults(func=cmd_savepoint)

    stop = group.add_parser("stop", help="stop a job with a savepoint (resume: --from-savepoint)")
    stop.add_argument("job", help="job id")
    stop.add_argument(
        "--target",
        default=None,
        help="savepoint folder the cluster writes: a path (a relative one is taken from here) or a URI",
    )
    stop.add_argument(
        "--drain",
        action="store_true",
        help="end the input first: every key's runs finish and end-of-input output is emitted "
        "(for a job you will not resume)",
    )
    _jm_option(stop)
    stop.set_defaults(func=cmd_stop)

    prune = group.add_parser(
        "prune-journal",
        help="clean a --detach'ed job's call journal while it runs (`flink run` does this itself "
        "for a job it waits for)",
    )
    prune.add_argument("job", help="job id")
    prune.add_argument("--call-journal", default=None, metavar="URI", help="PostgreSQL URI")
    prune.add_argument(
        "--call-journal-namespace",
        required=True,
        metavar="NAME",
        help="the job's namespace (`flink run --detach` prints it)",
    )
    prune.add_argument("--call-journal-margin", type=float, default=60.0, metavar="S")
    prune.add_argument("--every", type=float, default=5.0, metavar="S")
    prune.add_argument("--once", action="store_true", help="one pass, then exit")
    _jm_option(prune)
    prune.set_defaults(func=cmd_prune_journal)


def _fail(exc: JobManagerError) -> int:
    print(f"ratchet flink: {exc}", file=sys.stderr)
    return exc.code


def job_summary(jm: JobManager, job_id: str) -> dict[str, Any]:
    """One job's state, checkpoints and ratchet metrics, as `status --json` prints them."""
    job = jm.job(job_id)
    cps = jm.checkpoints(job_id)
    latest = cps.get("latest") or {}
    completed = latest.get("completed") or {}
    restored = latest.get("restored") or {}
    return {
        "job_id": job["jid"],
        "name": job.get("name"),
        "state": job.get("state"),
        "start_time_ms": job.get("start-time"),
        "duration_ms": job.get("duration"),
        "checkpoints": {
            "counts": cps.get("counts", {}),
            "latest_completed": {
                "id": completed.get("id"),
                "trigger_timestamp_ms": completed.get("trigger_timestamp"),
                "path": completed.get("external_path"),
                "size_bytes": completed.get("checkpointed_size", completed.get("state_size")),
            }
            if completed
            else None,
            "restored_from": {
                "id": restored.get("id"),
                "path": restored.get("external_path"),
                "is_savepoint": restored.get("is_savepoint"),
            }
            if restored
            else None,
        },
        "ratchet": jm.ratchet_metrics(job) if job.get("state") == "RUNNING" else {},
    }


def cmd_status(args: argparse.Namespace) -> int:
    jm = jobmanager_of(args)
    try:
        if args.job is None:
            jobs = jm.jobs()
            if args.json:
                print(json.dumps(jobs, indent=2))
                return EXIT_OK
            _print_jobs(jm, jobs)
            return EXIT_OK
        summary = job_summary(jm, args.job)
    except JobManagerError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(summary, indent=2))
        return EXIT_OK
    _print_job(summary)
    return EXIT_OK


def _print_jobs(jm: JobManager, jobs: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Flink jobs at {jm.base}")
    for col in ("job id", "name", "state", "running for"):
        table.add_column(col)
    for j in sorted(jobs, key=lambda j: -int(j.get("start-time", 0))):
        table.add_row(j["jid"], str(j.get("name")), str(j.get("state")), _dur(j.get("duration")))
    Console().print(table)


def _print_job(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Flink job {s['job_id']}", show_header=False)
    table.add_row("name", str(s["name"]))
    table.add_row("state", str(s["state"]))
    table.add_row("running for", _dur(s["duration_ms"]))
    cp = s["checkpoints"]
    c = cp["counts"]
    table.add_row(
        "checkpoints",
        f"completed {c.get('completed', 0)}, failed {c.get('failed', 0)}, "
        f"in progress {c.get('in_progress', 0)}, restored {c.get('restored', 0)}",
    )
    if cp["latest_completed"]:
        lc = cp["latest_completed"]
        table.add_row("latest checkpoint", f"{lc['id']} at {lc['path']}")
    if cp["restored_from"]:
        rf = cp["restored_from"]
        kind = "savepoint" if rf["is_savepoint"] else "checkpoint"
        table.add_row("restored from", f"{kind} {rf['id']} {rf['path'] or ''}".strip())
    for name, value in sorted(s["ratchet"].items()):
        table.add_row(name, f"{value:g}")
    if not s["ratchet"] and s["state"] == "RUNNING":
        table.add_row("ratchet", "no agent operator metrics reported yet")
    Console().print(table)


def _dur(ms: Any) -> str:
    if not isinstance(ms, int | float) or ms < 0:
        return "-"
    s = int(ms // 1000)
    return (
        f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
    )


def cmd_savepoint(args: argparse.Namespace) -> int:
    try:
        path = jobmanager_of(args).savepoint(args.job, args.target, stop=False)
    except JobManagerError as exc:
        return _fail(exc)
    print(json.dumps({"job_id": args.job, "savepoint": path}))
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    try:
        path = jobmanager_of(args).savepoint(args.job, args.target, stop=True, drain=args.drain)
    except JobManagerError as exc:
        return _fail(exc)
    print(json.dumps({"job_id": args.job, "savepoint": path, "drained": args.drain}))
    print(
        f"ratchet flink: job {args.job} stopped; resume it with `ratchet flink run ... "
        f"--from-savepoint {path}`",
        file=sys.stderr,
    )
    return EXIT_OK


def cmd_prune_journal(args: argparse.Namespace) -> int:
    from ratchet._errors import RatchetError
    from ratchet.connectors._pg_journal import DSN_ENV, PostgresCallJournal

    dsn = args.call_journal or os.environ.get(DSN_ENV)
    if not dsn:
        print(f"ratchet flink: give --call-journal URI (or set {DSN_ENV})", file=sys.stderr)
        return EXIT_USAGE
    jm = jobmanager_of(args)
    try:
        jm.job(args.job)
        journal = PostgresCallJournal(dsn, args.call_journal_namespace)
    except JobManagerError as exc:
        return _fail(exc)
    except RatchetError as exc:
        print(f"ratchet flink: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from ratchet.runtime._journal_prune import JournalPruner

    pruner = JournalPruner(journal, jm.base, args.job, margin_s=args.call_journal_margin)
    try:
        while True:
            try:
                n = pruner.step()
            except Exception as exc:  # noqa: BLE001 - a journal or REST fault: the next pass retries
                print(f"ratchet flink: not pruned this pass: {exc}", file=sys.stderr)
                n = 0
            if n:
                print(f"ratchet flink: {n} call record(s) pruned", file=sys.stderr, flush=True)
            if args.once or jm.job(args.job).get("state") in TERMINAL:
                break
            SYSTEM_CLOCK.sleep_sync(args.every)
    except JobManagerError as exc:
        return _fail(exc)
    finally:
        journal.close()
    print(json.dumps({"job_id": args.job, "pruned": pruner.pruned}))
    return EXIT_OK
