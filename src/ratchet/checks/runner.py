"""The check runner: schedules stages, verifies their checkpoints, seals receipts.

Life of a stage: its data dependencies finish; its resource locks are taken; its declared
inputs are probed and its cache key is computed; on `--resume` a matching checkpoint whose
log still re-hashes to the sealed digest is reused, otherwise the command runs; the inputs
are probed again; only a pass with unchanged inputs becomes a verified checkpoint, and only
once a receipt holding it is on disk; then the locks are released and consumers may start.

Names the tests patch are looked up through this module at call time: `atomic_json`,
`environment_fingerprint`, `_execute_stage_command` and `wait`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import platform
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from ratchet.checks import _explain
from ratchet.checks._errors import (
    LegacyReceiptError,
    ProjectError,
    ReceiptError,
    ResumeRefusedError,
    StageTimeoutError,
)
from ratchet.checks._plan import load_project, normalize_stages, plan_fingerprint, plan_stages
from ratchet.checks._report import LiveProgress
from ratchet.checks.checkpoints import MISSING_REPOSITORY, Checkpoints
from ratchet.checks.common import atomic_json, read_json, resource_lock, state_root
from ratchet.store import canonical_json, seal, sha256_bytes, sha256_file, verify_seal

__all__ = [
    "CHECKPOINT_VERSION",
    "FINGERPRINT_VERSION",
    "atomic_json",
    "environment_fingerprint",
    "explain",
    "read_receipt",
    "recover",
    "register",
    "run_checks",
    "wait",
]

FINGERPRINT_VERSION = 1
CHECKPOINT_VERSION = 1
SCHEDULER_TICK_SECONDS = 0.05
# Environment variables that enter every cache key; RATCHET_ENV_KEYS (comma-separated) adds more.
ENV_KEYS = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LANG", "LC_ALL", "TZ")
RUN_STATUSES = ("passed", "failed", "stale", "interrupted", "running")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")

_LIVE: set[subprocess.Popen[bytes]] = set()
_ACTIVE_RUNS: set[str] = set()  # runs this process is executing right now
_LIVE_GUARD = threading.Lock()


# --- patchable seams ------------------------------------------------------------------


def environment_fingerprint() -> dict[str, str]:
    """What of the machine enters every cache key: the interpreter, platform, chosen env vars."""
    env = {
        "python": sys.version,
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "machine": platform.machine(),
        "system": platform.system(),
    }
    extra = [k.strip() for k in os.environ.get("RATCHET_ENV_KEYS", "").split(",") if k.strip()]
    for key in (*ENV_KEYS, *extra):
        if key in os.environ:
            env[f"env:{key}"] = os.environ[key]
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _execute_stage_command(
    stage: Mapping[str, Any],
    *,
    cwd: Path,
    log_path: Path,
    timeout: float | None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run one stage's argv in its own process group; stdout+stderr go to `log_path` as is.

    Returns the exit code. On timeout the whole process group is killed and
    StageTimeoutError is raised; leftovers of a finished stage are killed too, so nothing
    outlives the stage's resource locks.
    """
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(stage["argv"]),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(env) if env is not None else None,
        )
        with _LIVE_GUARD:
            _LIVE.add(proc)
        try:
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
                raise StageTimeoutError(
                    f"stage {stage['id']!r} timed out after {timeout:g} s; "
                    "its process group was killed"
                ) from None
        finally:
            _kill_group(proc)
            with _LIVE_GUARD:
                _LIVE.discard(proc)


def _kill_live_processes() -> None:
    with _LIVE_GUARD:
        procs = list(_LIVE)
    for proc in procs:
        _kill_group(proc)


def _seal(receipt: Mapping[str, Any]) -> dict[str, Any]:
    """The receipt with its seal: a SHA-256 over its canonical JSON (minus the seal)."""
    return seal(dict(receipt))


# --- small helpers --------------------------------------------------------------------


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _digest(value: Any) -> str:
    return sha256_bytes(canonical_json(value))


def _new_run_id() -> str:
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{secrets.token_hex(4)}"


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ReceiptError(f"run id {run_id!r} is not a valid run id")
    return run_id


def _process_start(pid: int) -> str | None:
    """The kernel's start time of a process (to tell a live pid from a reused one)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return data.rsplit(")", 1)[-1].split()[19]


def _state_dir(workspace_root: Path, state_dir: str | os.PathLike[str] | None) -> Path:
    return Path(state_dir) if state_dir else state_root(workspace_root)


def _receipt_path(state_dir: Path, run_id: str) -> Path:
    return state_dir / "runs" / _check_run_id(run_id) / "receipt.json"


def _fingerprint(env: Any) -> str:
    return env if isinstance(env, str) else _digest(env)


def read_receipt(
    workspace_root: str | os.PathLike[str], state_dir: str | os.PathLike[str] | None, run_id: str
) -> dict[str, Any]:
    """Load a run's receipt, trusting it only if its seal matches.

    Raises ReceiptError (a ValueError) when it is missing, unreadable or its seal does not
    match, and LegacyReceiptError when it predates checkpoints (no `fingerprint_version`).
    """
    path = _receipt_path(_state_dir(Path(workspace_root), state_dir), run_id)
    try:
        receipt = read_json(path)
    except FileNotFoundError:
        raise ReceiptError(f"no receipt for run {run_id!r} at {path}") from None
    except (OSError, ValueError) as exc:
        raise ReceiptError(f"receipt of run {run_id!r} is unreadable: {exc}") from exc
    if not isinstance(receipt, dict):
        raise ReceiptError(f"receipt of run {run_id!r} at {path} is not a JSON object")
    if "fingerprint_version" not in receipt:
        raise LegacyReceiptError(
            f"receipt of run {run_id!r} predates checkpoints (no fingerprint_version): "
            "it grants no reuse; run without --resume"
        )
    if not verify_seal(receipt):
        raise ReceiptError(
            f"receipt of run {run_id!r} at {path} does not match its seal: "
            "it was altered or corrupted and is not trusted"
        )
    if receipt["fingerprint_version"] != FINGERPRINT_VERSION:
        raise LegacyReceiptError(
            f"receipt of run {run_id!r} has fingerprint_version "
            f"{receipt['fingerprint_version']!r}; this ratchet computes version "
            f"{FINGERPRINT_VERSION}, so it grants no reuse; run without --resume"
        )
    return receipt


def _resolve_repositories(
    workspace_root: Path, project_path: Path | None, stages: Sequence[Mapping[str, Any]]
) -> dict[str, Path]:
    """Repository name -> directory, from the project file when there is one.

    Without a project file a named repository is the folder of that name under the
    workspace root, and the whole workspace is the root itself (as one repository, ".").
    """
    if project_path is not None and project_path.exists():
        project = load_project(project_path)
        return {r["name"]: workspace_root / r["path"] for r in project["repositories"]}
    repos: dict[str, Path] = {}
    for stage in stages:
        for name in (stage.get("inputs") or {}).get("repos") or []:
            repos[name] = workspace_root / name
    if not repos or any(s.get("inputs") is None for s in stages):
        repos.setdefault(".", workspace_root)
    return repos


def _blank_record(stage: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": stage["id"],
        "title": stage["title"],
        "status": "pending",
        "exit_code": None,
        "log_path": None,
        "log_sha256": None,
        "checkpoint_verified": False,
        "checkpoint_version": CHECKPOINT_VERSION,
        "checkpoint_id": None,
        "cache_key": None,
        "cache_components": None,
        "origin_run_id": None,
        "error": None,
        "started_at": None,
        "finished_at": None,
        "duration_seconds": None,
        "explain": None,
    }


# --- the run --------------------------------------------------------------------------


class _Run:
    """One run's in-memory state and its receipt writer (safe to call from any thread)."""

    def __init__(
        self,
        *,
        header: dict[str, Any],
        stages: list[dict[str, Any]],
        receipt_path: Path,
        previous: dict[str, Any] | None,
        checkpoints: Checkpoints,
        workspace_root: Path,
        state_dir: Path,
    ) -> None:
        self.header = header
        self.stages = {s["id"]: s for s in stages}
        self.order = [s["id"] for s in stages]
        self.records = {s["id"]: _blank_record(s) for s in stages}
        self.receipt_path = receipt_path
        self.previous = previous
        self.previous_records = (
            {r["id"]: r for r in previous.get("stages", []) if isinstance(r, dict) and "id" in r}
            if previous
            else {}
        )
        self.checkpoints = checkpoints
        self.workspace_root = workspace_root
        self.state_dir = state_dir
        self.locks_dir = state_root(workspace_root) / "resource-locks"
        self.logs_dir = receipt_path.parent / "logs"
        self._state = threading.Lock()
        self._writer = threading.Lock()
        self._dirty = False

    @property
    def run_id(self) -> str:
        return str(self.header["run_id"])

    # state --------------------------------------------------------------------------
    def update(self, sid: str, **fields: Any) -> None:
        with self._state:
            self.records[sid].update(fields)
            self._dirty = True

    def set_header(self, **fields: Any) -> None:
        with self._state:
            self.header.update(fields)
            self._dirty = True

    def record(self, sid: str) -> dict[str, Any]:
        with self._state:
            return dict(self.records[sid])

    def all_records(self) -> list[dict[str, Any]]:
        with self._state:
            return [dict(self.records[sid]) for sid in self.order]

    def _payload(self, override: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
        stages = []
        for sid in self.order:
            rec = override[1] if override is not None and override[0] == sid else self.records[sid]
            stages.append(dict(rec))
        return {**self.header, "stages": stages}

    # persistence ----------------------------------------------------------------------
    def persist(self, override: tuple[str, dict[str, Any]] | None = None) -> None:
        """Write the receipt now (blocking); with `override`, that record becomes visible
        to everyone only once a receipt holding it is on disk. Raises if the write fails."""
        with self._writer:
            self._write_locked(override)

    def try_flush(self) -> None:
        """Write pending changes unless another thread is writing (it will pick them up)."""
        if not self._dirty:
            return
        if not self._writer.acquire(blocking=False):
            return
        try:
            with contextlib.suppress(Exception):
                self._write_locked(None)
        finally:
            self._writer.release()

    def _write_locked(self, override: tuple[str, dict[str, Any]] | None) -> None:
        while True:
            with self._state:
                self._dirty = False
                payload = self._payload(override)
            try:
                atomic_json(self.receipt_path, _seal(payload))
            except BaseException:
                with self._state:
                    self._dirty = True
                raise
            with self._state:
                if override is not None:
                    self.records[override[0]] = dict(override[1])
                    override = None
                if not self._dirty:
                    return


def _load_previous(workspace_root: Path, state_dir: Path, run_id: str) -> dict[str, Any]:
    previous = read_receipt(workspace_root, state_dir, run_id)
    if previous.get("status") == "running":
        raise ResumeRefusedError(
            f"run {run_id!r} is still marked running: if its process is gone (crashed), run "
            f"`ratchet checks recover {run_id} --apply --confirm-processes-stopped` first"
        )
    return previous


def _log_name(sid: str) -> str:
    safe = _SAFE.sub("_", sid)
    if safe != sid:
        safe = f"{safe}-{sha256_bytes(sid.encode('utf-8'))[:8]}"
    return f"{safe}.log"


def _cache_components(run: _Run, stage: Mapping[str, Any], ident: Any) -> dict[str, Any]:
    inputs = stage.get("inputs")
    return {
        "fingerprint_version": FINGERPRINT_VERSION,
        "command": list(stage["argv"]),
        "cwd": stage["cwd"],
        "scope": None if inputs is None else sorted(inputs.get("repos") or []),
        "inputs": ident,
        "deps": {d: run.record(d)["checkpoint_id"] for d in sorted(stage["deps"])},
        "environment": run.header["environment_fingerprint"],
    }


def _decide(
    run: _Run, stage: Mapping[str, Any], components: dict[str, Any], cache_key: str
) -> tuple[str, dict[str, Any] | None, dict[str, Any]]:
    """("reuse" | "run" | "refuse", previous record, explanation)."""
    prev_id = run.previous["run_id"] if run.previous else None
    base = {"resumed_from": prev_id}
    if run.previous is None:
        return "run", None, {**base, "decision": "ran", "reasons": ["fresh run (no --resume)"]}
    old = run.previous_records.get(stage["id"])
    if old is None:
        return (
            "run",
            None,
            {**base, "decision": "ran", "reasons": [f"new stage: not in run {prev_id}"]},
        )
    if stage["reuse"] == "never":
        return "run", old, {**base, "decision": "ran", "reasons": ["reuse is 'never'"]}
    if old.get("checkpoint_version") != CHECKPOINT_VERSION or "cache_key" not in old:
        reason = f"run {prev_id} recorded no checkpoint for it (legacy record)"
        return "run", old, {**base, "decision": "ran", "reasons": [reason]}
    if old.get("status") != "passed" or old.get("checkpoint_verified") is not True:
        reason = (
            f"run {prev_id} left no verified checkpoint for it (status {old.get('status')!r}"
            + (f": {old['error']}" if old.get("error") else "")
            + ")"
        )
        return "run", old, {**base, "decision": "ran", "reasons": [reason]}
    if old.get("cache_key") != cache_key:
        changes = _explain.diff_components(
            old.get("cache_components") or {},
            components,
            old_env=(run.previous or {}).get("environment"),
            new_env=run.header.get("environment"),
            checkpoints=run.checkpoints,
        )
        reasons = [_explain.describe(c) for c in changes] or ["cache key changed"]
        return "run", old, {**base, "decision": "ran", "reasons": reasons, "changes": changes}
    log_path = old.get("log_path")
    expected = old.get("log_sha256")
    problem = None
    if not log_path or not expected:
        problem = "has no log evidence"
    else:
        try:
            actual = sha256_file(log_path)
        except FileNotFoundError:
            problem = f"log evidence {log_path} is missing"
        except OSError as exc:
            problem = f"log evidence {log_path} cannot be read ({exc})"
        else:
            if actual != expected:
                problem = (
                    f"log evidence {log_path} was altered (sha256 {actual}, sealed {expected})"
                )
    if problem is not None:
        error = (
            f"checkpoint of {stage['id']!r} from run {prev_id} {problem}; refusing to reuse it "
            "and not re-running it silently: run without --resume to re-run it"
        )
        return "refuse", old, {**base, "decision": "refused", "reasons": [error]}
    # The long form is spelled out by `explain`; receipts are rewritten often, keep them small.
    return "reuse", old, {**base, "decision": "reused", "reasons": []}


def _stage_worker(run: _Run, sid: str) -> None:
    """Everything one stage does, inside its resource locks; never raises for a stage's
    failure (it becomes the stage's status and error)."""
    stage = run.stages[sid]
    started = time.monotonic()
    try:
        with contextlib.ExitStack() as locks:
            for name in sorted(stage["resources"]):
                locks.enter_context(resource_lock(run.locks_dir, name))
            _stage_locked(run, stage, started)
    except Exception as exc:
        rec = run.record(sid)
        if rec["status"] in ("pending", "running"):
            run.update(
                sid,
                status="failed",
                checkpoint_verified=False,
                error=f"{type(exc).__name__}: {exc}",
                finished_at=_now(),
                duration_seconds=round(time.monotonic() - started, 3),
            )
            with contextlib.suppress(Exception):
                run.persist()


def _stage_locked(run: _Run, stage: dict[str, Any], started: float) -> None:
    sid = stage["id"]
    try:
        ident = run.checkpoints.identity(stage)
    except Exception as exc:
        run.update(
            sid,
            status="failed",
            error=f"could not probe the stage's inputs: {type(exc).__name__}: {exc}",
            finished_at=_now(),
        )
        run.persist()
        return
    components = _cache_components(run, stage, ident)
    cache_key = _digest(components)
    action, old, explanation = _decide(run, stage, components, cache_key)

    if action == "reuse":
        assert old is not None
        rec = run.record(sid)
        rec.update(
            status="passed",
            exit_code=old.get("exit_code"),
            log_path=old["log_path"],
            log_sha256=old["log_sha256"],
            checkpoint_verified=True,
            checkpoint_id=old["checkpoint_id"],
            cache_key=cache_key,
            cache_components=components,
            origin_run_id=old.get("origin_run_id") or run.previous["run_id"],  # type: ignore[index]
            reused_from=run.previous["run_id"],  # type: ignore[index]
            explain=explanation,
            error=None,
            started_at=_now(),
            finished_at=_now(),
            duration_seconds=round(time.monotonic() - started, 3),
        )
        _persist_checkpoint(run, sid, rec)
        return
    if action == "refuse":
        run.update(
            sid,
            status="failed",
            cache_key=cache_key,
            cache_components=components,
            explain=explanation,
            error=explanation["reasons"][0],
            finished_at=_now(),
        )
        run.persist()
        return

    run.logs_dir.mkdir(parents=True, exist_ok=True)
    log_path = run.logs_dir / _log_name(sid)
    log_path.write_bytes(b"")  # the evidence exists even if the command never starts
    run.update(
        sid,
        status="running",
        log_path=str(log_path),
        cache_key=cache_key,
        cache_components=components,
        explain=explanation,
        started_at=_now(),
    )
    run.persist()

    exit_code: int | None = None
    error: str | None = None
    env = {
        **os.environ,
        "RATCHET_RUN_ID": run.run_id,
        "RATCHET_STAGE_ID": sid,
        "RATCHET_WORKSPACE_ROOT": str(run.workspace_root),
    }
    run.checkpoints.command_started()
    try:
        exit_code = _execute_stage_command(
            stage,
            cwd=run.workspace_root / stage["cwd"],
            log_path=log_path,
            timeout=stage["timeout_seconds"],
            env=env,
        )
    except StageTimeoutError as exc:
        error = str(exc)
    except Exception as exc:
        error = f"could not run {stage['argv'][0]!r}: {type(exc).__name__}: {exc}"
    finally:
        run.checkpoints.command_finished()

    done = {"finished_at": _now(), "duration_seconds": round(time.monotonic() - started, 3)}
    try:
        after = run.checkpoints.identity(stage)
    except Exception as exc:
        probe_error = f"post-run input probe failed: {type(exc).__name__}: {exc}"
        failed = error is not None or exit_code != 0
        run.update(
            sid,
            status="failed" if failed else "stale",
            exit_code=exit_code,
            checkpoint_verified=False,
            error=f"{error}; {probe_error}" if error else probe_error,
            **done,
        )
        run.persist()
        return
    if error is not None or exit_code != 0:
        run.update(
            sid,
            status="failed",
            exit_code=exit_code,
            error=error or f"command exited with status {exit_code}",
            **done,
        )
        run.persist()
        return
    if after != ident:
        changed = _explain.diff_identity(ident, after, run.checkpoints)
        run.update(
            sid,
            status="stale",
            exit_code=exit_code,
            checkpoint_verified=False,
            error="inputs changed while the stage ran: " + _explain.summarize(changed),
            **done,
        )
        run.persist()
        return
    log_sha = sha256_file(log_path)
    rec = run.record(sid)
    rec.update(
        status="passed",
        exit_code=exit_code,
        log_sha256=log_sha,
        checkpoint_verified=True,
        checkpoint_id=_digest({"cache_key": cache_key, "log_sha256": log_sha, "run": run.run_id}),
        origin_run_id=run.run_id,
        error=None,
        **done,
    )
    _persist_checkpoint(run, sid, rec)


def _persist_checkpoint(run: _Run, sid: str, rec: dict[str, Any]) -> None:
    """Make `rec` (a verified checkpoint) durable before anyone may build on it."""
    try:
        run.persist(override=(sid, rec))
    except Exception as exc:
        run.update(
            sid,
            status="failed",
            checkpoint_verified=False,
            checkpoint_id=None,
            error=f"the verified checkpoint could not be persisted: {type(exc).__name__}: {exc}",
        )
        with contextlib.suppress(Exception):
            run.persist()


def _blocked_by(run: _Run, stage: Mapping[str, Any]) -> str | None:
    for kind, preds in (("depends on", stage["deps"]), ("comes after", stage["after"])):
        for pred in preds:
            status = run.records[pred]["status"]
            if status in ("failed", "skipped", "stale"):
                return f"{kind} {pred!r}, which is {status}"
    return None


def _ready(run: _Run, stage: Mapping[str, Any]) -> bool:
    return all(run.records[p]["status"] == "passed" for p in (*stage["deps"], *stage["after"]))


def _schedule(run: _Run, jobs: int, progress: LiveProgress) -> None:
    pending = list(run.order)
    running: dict[Future[None], str] = {}
    busy: set[str] = set()
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ratchet-stage") as pool:
        try:
            while pending or running:
                for sid in list(pending):
                    reason = _blocked_by(run, run.stages[sid])
                    if reason is not None:
                        pending.remove(sid)
                        run.update(sid, status="skipped", error=f"not started: it {reason}")
                for sid in list(pending):
                    if len(running) >= jobs:
                        break
                    stage = run.stages[sid]
                    if _ready(run, stage) and not busy & set(stage["resources"]):
                        pending.remove(sid)
                        busy |= set(stage["resources"])
                        running[pool.submit(_stage_worker, run, sid)] = sid
                run.try_flush()
                progress.update(run.all_records())
                if not running:
                    if pending:  # cannot happen with a valid plan; fail closed anyway
                        for sid in pending:
                            run.update(sid, status="skipped", error="not started: unschedulable")
                        pending.clear()
                    break
                done, _ = wait(
                    list(running), timeout=SCHEDULER_TICK_SECONDS, return_when=FIRST_COMPLETED
                )
                for fut in done:
                    sid = running.pop(fut)
                    busy -= set(run.stages[sid]["resources"])
                    exc = fut.exception()
                    if exc is not None or run.records[sid]["status"] in ("pending", "running"):
                        run.update(
                            sid,
                            status="failed",
                            checkpoint_verified=False,
                            error=f"internal error in the stage worker: {exc!r}",
                        )
        except BaseException:
            _kill_live_processes()
            raise


def _final_snapshot(run: _Run) -> bool:
    """Probe every passed stage's inputs again; True only if none changed."""
    run.checkpoints.forget()
    ok = True
    for rec in run.all_records():
        if rec["status"] != "passed":
            continue
        stage = run.stages[rec["id"]]
        checked = (rec.get("cache_components") or {}).get("inputs")
        try:
            now = _snapshot_probe(run, stage, checked)
        except Exception as exc:
            ok = False
            run.update(
                rec["id"],
                snapshot_verified=False,
                snapshot_error=f"end-of-run input probe failed: {type(exc).__name__}: {exc}",
            )
            continue
        if now != checked:
            ok = False
            changed = _explain.diff_identity(checked, now, run.checkpoints)
            run.update(
                rec["id"],
                snapshot_verified=False,
                snapshot_error="inputs changed after its checkpoint: "
                + _explain.summarize(changed),
            )
        else:
            run.update(rec["id"], snapshot_verified=True)
    return ok


def _snapshot_probe(run: _Run, stage: Mapping[str, Any], recorded: Any) -> Any:
    """Probe for the end-of-run snapshot, comparing like with like: an identity of the
    built-in shape is re-probed directly; one produced by a replaced `identity` (a plugin,
    a test double) is re-probed through it."""
    scope = run.checkpoints.scope(stage)
    builtin = (
        isinstance(recorded, dict)
        and sorted(recorded) == scope
        and all(
            isinstance(v, str) and (len(v) == 64 or v == MISSING_REPOSITORY)
            for v in recorded.values()
        )
    )
    if builtin:
        return run.checkpoints.snapshot_identity(stage)
    return run.checkpoints.identity(stage)


def _run_status(records: Sequence[Mapping[str, Any]], snapshot_ok: bool) -> str:
    statuses = {r["status"] for r in records}
    if "failed" in statuses:
        return "failed"
    if "stale" in statuses or not snapshot_ok:
        return "stale"
    if statuses - {"passed"}:
        return "failed"
    return "passed"


def _project_path(workspace_root: Path, project: str | os.PathLike[str] | None) -> Path | None:
    if not project:
        return None
    p = Path(project)
    return p if p.is_absolute() else workspace_root / p


def run_checks(args: argparse.Namespace, stages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Run a plan of stages and return the sealed receipt (also written to `receipt_path`).

    `args` carries `workspace_root`, `project`, `state_dir`, `dry_run`, `jobs`, `profile`,
    `resume` (a run id to reuse verified checkpoints from, or None), `repo` and `changed`.
    """
    workspace_root = Path(getattr(args, "workspace_root", None) or ".").resolve()
    state_dir = _state_dir(workspace_root, getattr(args, "state_dir", None))
    project_path = _project_path(workspace_root, getattr(args, "project", None))
    planned = normalize_stages(stages)
    repositories = _resolve_repositories(workspace_root, project_path, planned)
    checkpoints = Checkpoints(workspace_root, repositories, state_dir)
    for stage in planned:
        checkpoints.scope(stage)  # unknown repositories fail before anything runs
    resume = getattr(args, "resume", None)

    if getattr(args, "dry_run", False):
        return _dry_run(planned, resume, workspace_root, state_dir)

    previous = _load_previous(workspace_root, state_dir, resume) if resume else None
    env = environment_fingerprint()
    run_id = _check_run_id(getattr(args, "run_id", None) or _new_run_id())
    receipt_path = _receipt_path(state_dir, run_id)
    if receipt_path.exists():
        raise ReceiptError(f"run {run_id!r} already has a receipt at {receipt_path}")
    source = checkpoints.source_identity()
    header: dict[str, Any] = {
        "run_id": run_id,
        "status": "running",
        "phase": "checking",
        "receipt_path": str(receipt_path),
        "workspace_root": str(workspace_root),
        "project": str(project_path) if project_path else None,
        "profile": getattr(args, "profile", None),
        "resumed_from": resume,
        "snapshot_verified": False,
        "source_fingerprint": _digest(source),
        "plan_fingerprint": plan_fingerprint(planned),
        "environment_fingerprint": _fingerprint(env),
        "environment": env,
        "fingerprint_version": FINGERPRINT_VERSION,
        "started_at": _now(),
        "finished_at": None,
        "pid": os.getpid(),
        "pid_start": _process_start(os.getpid()),
        "host": socket.gethostname(),
        "error": None,
    }
    run = _Run(
        header=header,
        stages=planned,
        receipt_path=receipt_path,
        previous=previous,
        checkpoints=checkpoints,
        workspace_root=workspace_root,
        state_dir=state_dir,
    )
    run.persist()

    jobs = max(1, int(getattr(args, "jobs", 1) or 1))
    _ACTIVE_RUNS.add(run_id)
    try:
        return _finish(run, jobs, args)
    finally:
        _ACTIVE_RUNS.discard(run_id)


def _finish(run: _Run, jobs: int, args: argparse.Namespace) -> dict[str, Any]:
    run_id = run.run_id
    try:
        with LiveProgress(len(run.order), enabled=_progress_enabled(args)) as progress:
            _schedule(run, jobs, progress)
    except BaseException:
        run.set_header(status="interrupted", phase="interrupted", finished_at=_now())
        with contextlib.suppress(Exception):
            run.persist()
        raise
    run.set_header(phase="verifying")
    snapshot_ok = _final_snapshot(run)
    records = run.all_records()
    status = _run_status(records, snapshot_ok)
    run.set_header(
        status=status,
        phase="done",
        snapshot_verified=snapshot_ok and not any(r["status"] == "stale" for r in records),
        finished_at=_now(),
    )
    try:
        run.persist()
    except Exception as exc:
        raise ReceiptError(
            f"run {run_id!r} finished ({status}) but its final receipt could not be written: "
            f"{exc}; the receipt on disk still says 'running' — recover it before resuming"
        ) from exc
    return _seal(run._payload(None))


def _progress_enabled(args: argparse.Namespace) -> bool:
    if getattr(args, "json", False) or getattr(args, "no_progress", False):
        return False
    return sys.stderr.isatty()


def _dry_run(
    stages: list[dict[str, Any]], resume: str | None, workspace_root: Path, state_dir: Path
) -> dict[str, Any]:
    previous = _load_previous(workspace_root, state_dir, resume) if resume else None
    return {
        "run_id": None,
        "status": "planned",
        "dry_run": True,
        "resumed_from": resume,
        "plan_fingerprint": plan_fingerprint(stages),
        "fingerprint_version": FINGERPRINT_VERSION,
        "previous_status": previous.get("status") if previous else None,
        "stages": [{**s, "status": "planned"} for s in stages],
    }


# --- recover and explain --------------------------------------------------------------


def recover(
    workspace_root: str | os.PathLike[str],
    state_dir: str | os.PathLike[str] | None,
    run_id: str,
    *,
    apply: bool = False,
    confirm_processes_stopped: bool = False,
) -> dict[str, Any]:
    """Turn a receipt left `running` by a crash into `interrupted`.

    Without `apply` it only reports what it would do; without the confirmation it refuses.
    Verified checkpoints stay (they were durable); a stage that was running becomes
    `failed`, a stage not yet started `skipped`.
    """
    root = Path(workspace_root).resolve()
    receipt = read_receipt(root, state_dir, run_id)
    base = {"run_id": run_id, "receipt_path": receipt.get("receipt_path")}
    if receipt.get("status") != "running":
        return {
            **base,
            "ok": True,
            "action": "none",
            "status": receipt.get("status"),
            "text": f"run {run_id} is {receipt.get('status')}, not running: nothing to recover",
        }
    stages = receipt.get("stages", [])
    was_running = [s["id"] for s in stages if s.get("status") == "running"]
    not_started = [s["id"] for s in stages if s.get("status") == "pending"]
    kept = [s["id"] for s in stages if s.get("checkpoint_verified") is True]
    plan = {
        "mark_failed": was_running,
        "mark_skipped": not_started,
        "verified_checkpoints_kept": kept,
    }
    if not apply:
        return {
            **base,
            **plan,
            "ok": True,
            "action": "would-recover",
            "status": "running",
            "text": (
                f"would mark run {run_id} interrupted (failed: {was_running or 'none'}, "
                f"skipped: {not_started or 'none'}, kept: {kept or 'none'}); "
                "re-run with --apply --confirm-processes-stopped"
            ),
        }
    if not confirm_processes_stopped:
        return {
            **base,
            **plan,
            "ok": False,
            "action": "refused",
            "status": "running",
            "error": (
                f"refusing to recover run {run_id} without --confirm-processes-stopped: make "
                f"sure its ratchet process (pid {receipt.get('pid')} on {receipt.get('host')}) "
                "and its stage processes are stopped first"
            ),
        }
    pid = receipt.get("pid")
    same_process = pid == os.getpid() and run_id not in _ACTIVE_RUNS  # e.g. a failed write
    if (
        receipt.get("host") == socket.gethostname()
        and isinstance(pid, int)
        and not same_process
        and receipt.get("pid_start") is not None
        and _process_start(pid) == receipt.get("pid_start")
    ) or run_id in _ACTIVE_RUNS:
        return {
            **base,
            **plan,
            "ok": False,
            "action": "refused",
            "status": "running",
            "error": f"refusing to recover run {run_id}: its process (pid {pid}) is still alive",
        }
    new_stages = []
    for s in stages:
        s = dict(s)
        if s.get("status") == "running":
            s.update(
                status="failed",
                checkpoint_verified=False,
                error="interrupted: the run stopped while this stage ran; its result is not trusted",
            )
        elif s.get("status") == "pending":
            s.update(status="skipped", error="not started: the run was interrupted")
        new_stages.append(s)
    recovered = {
        **receipt,
        "status": "interrupted",
        "phase": "recovered",
        "recovered_at": _now(),
        "stages": new_stages,
    }
    atomic_json(_receipt_path(_state_dir(root, state_dir), run_id), _seal(recovered))
    return {
        **base,
        **plan,
        "ok": True,
        "action": "recovered",
        "status": "interrupted",
        "text": f"run {run_id} marked interrupted; resume it with --resume {run_id}",
    }


def explain(
    workspace_root: str | os.PathLike[str],
    state_dir: str | os.PathLike[str] | None,
    run_id: str,
    stage_id: str,
) -> dict[str, Any]:
    """Why a stage of a run re-ran or was reused, naming the cache-key component that changed."""
    receipt = read_receipt(Path(workspace_root).resolve(), state_dir, run_id)
    recs = {s.get("id"): s for s in receipt.get("stages", [])}
    if stage_id not in recs:
        known = ", ".join(str(k) for k in recs)
        raise ProjectError(f"stage: run {run_id} has no stage {stage_id!r} (stages: {known})")
    return _explain.explain_record(receipt, recs[stage_id])


# --- CLI --------------------------------------------------------------------------------


def _handle_run(parsed: argparse.Namespace) -> dict[str, Any]:
    root = Path(parsed.workspace_root).resolve()
    project_path = _project_path(root, parsed.project)
    if project_path is None:
        raise ProjectError("project: no project file given (--project)")
    project = load_project(project_path)
    repos = parsed.repo
    if isinstance(repos, str):
        repos = [repos]
    stages = plan_stages(
        project,
        workspace_root=root,
        profile=parsed.profile,
        repos=repos,
        changed=bool(parsed.changed),
    )
    return run_checks(parsed, stages)


def _handle_recover(parsed: argparse.Namespace) -> dict[str, Any]:
    return recover(
        parsed.workspace_root,
        parsed.state_dir,
        parsed.run_id,
        apply=parsed.apply,
        confirm_processes_stopped=parsed.confirm_processes_stopped,
    )


def _handle_explain(parsed: argparse.Namespace) -> dict[str, Any]:
    return explain(parsed.workspace_root, parsed.state_dir, parsed.run_id, parsed.stage)


def _handle_list(parsed: argparse.Namespace) -> dict[str, Any]:
    root = Path(parsed.workspace_root).resolve()
    project_path = _project_path(root, parsed.project)
    if project_path is None:
        raise ProjectError("project: no project file given (--project)")
    project = load_project(project_path)
    state_dir = _state_dir(root, parsed.state_dir)
    runs = []
    runs_dir = state_dir / "runs"
    if runs_dir.is_dir():
        for child in sorted(runs_dir.iterdir()):
            try:
                receipt = read_receipt(root, state_dir, child.name)
                runs.append({"run_id": child.name, "status": receipt.get("status")})
            except ValueError as exc:
                runs.append({"run_id": child.name, "status": "untrusted", "error": str(exc)})
    lines = [f"project {project['name']}: {len(project['checks'])} checks"]
    for c in project["checks"]:
        edges = "".join(
            [
                f"  deps={','.join(c['deps'])}" if c["deps"] else "",
                f"  after={','.join(c['after'])}" if c["after"] else "",
            ]
        )
        lines.append(f"  {c['id']}: {' '.join(c['argv'])}{edges}")
    for name, ids in project["profiles"].items():
        lines.append(f"profile {name}: {', '.join(ids)}")
    for r in runs[-10:]:
        lines.append(f"run {r['run_id']}: {r['status']}")
    return {
        "ok": True,
        "project": project["name"],
        "checks": project["checks"],
        "profiles": project["profiles"],
        "runs": runs,
        "text": "\n".join(lines),
    }


def add_common_arguments(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """The workspace options; on subcommands they default to SUPPRESS, so they may come
    before or after the subcommand name."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--workspace-root", default=default(os.getcwd()), help="workspace root (default: cwd)"
    )
    parser.add_argument(
        "--project",
        default=default("checks.project.json"),
        help="project file, relative to the workspace root (default: checks.project.json)",
    )
    parser.add_argument(
        "--state-dir",
        default=default(None),
        help="where runs and logs live (default: a folder under $XDG_STATE_HOME)",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print the result as JSON"
    )


def register(subparsers: Any) -> None:
    """Add `run`, `recover`, `explain` and `list`; each sets `handler(parsed) -> dict`."""
    run_p = subparsers.add_parser("run", help="run the checks (or resume a run)")
    add_common_arguments(run_p, suppress=True)
    run_p.add_argument("--profile", default=None, help="run only this profile's checks")
    run_p.add_argument(
        "--repo", action="append", default=None, help="only checks covering this repository"
    )
    run_p.add_argument(
        "--changed", action="store_true", help="only checks covering repos with uncommitted changes"
    )
    run_p.add_argument(
        "--resume", default=None, metavar="RUN_ID", help="reuse verified checkpoints"
    )
    run_p.add_argument("--jobs", "-j", type=int, default=1, help="stages run in parallel")
    run_p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    run_p.set_defaults(handler=_handle_run)

    rec_p = subparsers.add_parser("recover", help="mark a crashed run interrupted")
    add_common_arguments(rec_p, suppress=True)
    rec_p.add_argument("run_id", metavar="RUN_ID")
    rec_p.add_argument("--apply", action="store_true", help="change the receipt (default: report)")
    rec_p.add_argument(
        "--confirm-processes-stopped",
        action="store_true",
        help="confirm the run's processes are gone",
    )
    rec_p.set_defaults(handler=_handle_recover)

    exp_p = subparsers.add_parser("explain", help="why a stage re-ran or was reused")
    add_common_arguments(exp_p, suppress=True)
    exp_p.add_argument("run_id", metavar="RUN_ID")
    exp_p.add_argument("stage", metavar="STAGE")
    exp_p.set_defaults(handler=_handle_explain)

    list_p = subparsers.add_parser("list", help="list checks, profiles and recent runs")
    add_common_arguments(list_p, suppress=True)
    list_p.set_defaults(handler=_handle_list)
