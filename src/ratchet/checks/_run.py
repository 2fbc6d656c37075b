"""One run of a plan: the shell that performs what `_decide` decides, through `Seams`.

Life of a stage: its data dependencies finish; its resource locks are taken; its declared
inputs are probed and its cache key is computed; on `--resume` a matching checkpoint whose
log still re-hashes to the sealed digest is reused, otherwise the command runs; the inputs
are probed again; only a pass with unchanged inputs becomes a verified checkpoint, and only
once a receipt holding it is on disk; then the locks are released and consumers may start.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from ratchet._clock import utc_iso
from ratchet._errors import ConfigError
from ratchet.checks import _explain
from ratchet.checks._cache import CheckCache
from ratchet.checks._decide import (
    FINGERPRINT_VERSION,
    Decision,
    Facts,
    LogEvidence,
    cache_components,
    checkpoint_id,
    decide,
    digest,
    outcome,
    run_status,
)
from ratchet.checks._errors import (
    EmptyPlanError,
    ProjectError,
    ReceiptError,
    ResumeRefusedError,
    StageTimeoutError,
)
from ratchet.checks._execute import SubprocessExecutor
from ratchet.checks._plan import load_project, normalize_stages, plan_fingerprint
from ratchet.checks._receipts import (
    ReceiptBook,
    blank_record,
    check_run_id,
    latest_run_id,
    new_run_id,
    read_receipt,
    receipt_path,
    state_dir_for,
)
from ratchet.checks._recover import active, hostname, process_start
from ratchet.checks._report import LiveProgress
from ratchet.checks._schedule import schedule
from ratchet.checks._seams import ENV_KEYS, Seams, extra_env_keys
from ratchet.checks._signing import SECRET_ENV, hash_value, signing_key
from ratchet.checks.checkpoints import MISSING_REPOSITORY, outputs_manifest, runtime_identity
from ratchet.checks.common import (
    LOCK_SCOPE_ENV,
    machine_lock_dir,
    resource_lock,
    safe_file_name,
    scope_lock_dir,
    state_root,
)

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from ratchet._clock import Clock
    from ratchet.checks._protocols import Prober

__all__ = ["project_path", "run_checks"]

# How long a stage waits for a resource another process holds (--lock-timeout).
DEFAULT_LOCK_TIMEOUT_SECONDS = 600.0
LOCK_POLL_SECONDS = 0.05
# How many of the newest run folders a cache miss reads for the stage's last verified
# checkpoint, to say which cache-key component changed since (no index: one pass, once).
RECENT_RUNS = 20


def run_checks(
    args: argparse.Namespace, stages: Sequence[Mapping[str, Any]], seams: Seams | None = None
) -> dict[str, Any]:
    """Run a plan of stages and return the sealed receipt (also written to `receipt_path`).

    `args` carries `workspace_root`, `project`, `state_dir`, `dry_run`, `jobs`, `profile`,
    `resume` (a run id to reuse verified checkpoints from, or None), `repo` and `changed`;
    `seams` the clock, random source, prober, executor, writer and waiter (default: real).
    """
    seams = seams if seams is not None else Seams()
    lock_timeout = _lock_timeout(args)  # a bad value is refused before anything is probed
    if getattr(args, "resume", None) == "":  # not "no --resume": a script's unset variable
        raise ConfigError(
            "--resume: an empty run id; pass a run id (`ratchet checks list` shows them) or "
            "'latest', or leave --resume out for a run that resumes nothing"
        )
    workspace_root = Path(getattr(args, "workspace_root", None) or ".").resolve()
    state_dir = state_dir_for(workspace_root, getattr(args, "state_dir", None))
    _check_state_dir(state_dir, given=bool(getattr(args, "state_dir", None)))
    project = project_path(workspace_root, getattr(args, "project", None))
    planned = normalize_stages(stages)
    if not planned and not getattr(args, "allow_empty", False):
        raise EmptyPlanError(
            "the plan selects no checks (nothing matched the profile, --repo or --changed "
            "selection), so nothing would be verified; pass --allow-empty to accept an empty "
            "run as a pass"
        )
    repositories = _resolve_repositories(workspace_root, project, planned)
    prober = seams.prober(workspace_root, repositories, state_dir, clock=seams.clock)
    exclude = getattr(prober, "exclude_from_workspace", None)
    if project is not None and exclude is not None:
        exclude(project)
    for stage in planned:
        prober.scope(stage)  # unknown repositories fail before anything runs
    _check_cwds(workspace_root, project, planned, stages)
    resume = getattr(args, "resume", None)
    if resume == "latest":
        resume = latest_run_id(workspace_root, state_dir)

    previous = _load_previous(workspace_root, state_dir, resume) if resume else None
    key = signing_key()
    env = seams.environment()
    env = env if isinstance(env, str) else _hide_values(env, key)
    strict_env = bool(getattr(args, "strict_env", False))
    if getattr(args, "dry_run", False):
        dry = _Run(
            book=ReceiptBook(
                header={
                    "run_id": "dry-run",
                    "environment": env,
                    "environment_fingerprint": env if isinstance(env, str) else digest(env),
                },
                records=[blank_record(s) for s in planned],
                path=state_dir / "runs" / "dry-run" / "receipt.json",
                writer=_never_write,
            ),
            stages=planned,
            previous=previous,
            prober=prober,
            seams=seams,
            workspace_root=workspace_root,
            strict_env=strict_env,
            key=key,
            cache=_open_cache(args, state_dir, seams.clock, read_only=True),
            state_dir=state_dir,
        )
        return _dry_run(dry, planned, resume)
    run_id = check_run_id(getattr(args, "run_id", None) or new_run_id(seams.clock, seams.rng))
    path = receipt_path(state_dir, run_id)
    if path.exists():
        raise ReceiptError(f"run {run_id!r} already has a receipt at {path}")
    try:
        source = prober.source_identity()
    except OSError as exc:
        raise ConfigError(
            f"workspace {workspace_root}: its inputs cannot be read ({exc}); make them "
            "readable, or list them in .gitignore so they are not inputs"
        ) from exc
    header: dict[str, Any] = {
        "run_id": run_id,
        "status": "running",
        "phase": "checking",
        "receipt_path": str(path),
        "workspace_root": str(workspace_root),
        "project": str(project) if project else None,
        "profile": getattr(args, "profile", None),
        "resumed_from": resume,
        "snapshot_verified": False,
        "source_fingerprint": digest(source),
        "plan_fingerprint": plan_fingerprint(planned),
        "environment_fingerprint": env if isinstance(env, str) else digest(env),
        "environment": env,
        "strict_env": strict_env,
        "signed": key is not None,
        "fingerprint_version": FINGERPRINT_VERSION,
        "started_at": utc_iso(seams.clock),
        "finished_at": None,
        "pid": os.getpid(),
        "pid_start": process_start(os.getpid()),
        "host": hostname(),
        "error": None,
    }
    book = ReceiptBook(
        header=header,
        records=[blank_record(s) for s in planned],
        path=path,
        writer=seams.writer,
        journal=seams.journal,
    )
    run = _Run(
        book=book,
        stages=planned,
        previous=previous,
        prober=prober,
        seams=seams,
        workspace_root=workspace_root,
        strict_env=strict_env,
        key=key,
        cache=_open_cache(args, state_dir, seams.clock),
        lock_timeout=lock_timeout,
        shared_locks_dir=_shared_locks_dir(args, project, planned),
        state_dir=state_dir,
    )
    book.persist()
    jobs = max(1, int(getattr(args, "jobs", 1) or 1))
    with active(run_id):
        return _finish(run, jobs, _progress_enabled(args))


def _check_state_dir(state_dir: Path, *, given: bool) -> None:
    """Make the state folder, or raise ConfigError naming where it came from: otherwise
    the first write into it fails later, reported as an unreadable input."""
    reason = ""
    try:
        if state_dir.exists() and not state_dir.is_dir():
            reason = "it is a file, not a folder"
        else:
            state_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(state_dir, os.W_OK | os.X_OK):
                reason = "it is not writable"
    except OSError as exc:
        reason = str(exc)
    if reason:
        fix = (
            "pass --state-dir a folder you can write (or leave it out)"
            if given
            else "set XDG_STATE_HOME to a folder you can write, or pass --state-dir DIR"
        )
        raise ConfigError(
            f"{'--state-dir ' if given else 'state folder '}{state_dir} cannot be used: "
            f"{reason}; {fix}"
        )


def _check_cwds(
    workspace_root: Path,
    project: Path | None,
    planned: Sequence[Mapping[str, Any]],
    given: Sequence[Mapping[str, Any]],
) -> None:
    """Refuse, before anything runs, a stage whose cwd is not a folder when no stage of the
    plan runs before it (no `deps`, no `after`): nothing in this run can make it, so its
    command could only fail, blamed on the program. A stage that runs after others may
    have its cwd made by them (a build folder), so it is checked when it starts instead."""
    for stage in planned:
        if stage["deps"] or stage["after"]:
            continue
        problem = _missing_cwd(workspace_root, stage)
        if problem is None:
            continue
        sid = stage["id"]
        field = f"stage {sid!r} cwd"
        with contextlib.suppress(Exception):  # naming the field must not hide the error
            if project is not None and project.is_file():
                ids = [c["id"] for c in load_project(project)["checks"]]
                field = f"{project}: checks[{ids.index(sid)}].cwd (check {sid!r})"
            else:
                ids = [s.get("id") for s in given]
                field = f"stages[{ids.index(sid)}].cwd (stage {sid!r})"
        raise ProjectError(
            f"{field}: {problem}, and no stage runs before this one to make it; fix the cwd "
            "(it is relative to the workspace root), or create the folder"
        )


def _missing_cwd(workspace_root: Path, stage: Mapping[str, Any]) -> str | None:
    """Why a stage's cwd cannot be a command's working folder, or None."""
    path = workspace_root / stage["cwd"]
    if path.is_dir():
        return None
    what = "is not a folder" if path.exists() else "does not exist"
    return f"{stage['cwd']!r} ({path}) {what}"


def project_path(workspace_root: Path, project: str | os.PathLike[str] | None) -> Path | None:
    """The project file's path (relative paths are under the workspace root), or None."""
    if not project:
        return None
    p = Path(project)
    return p if p.is_absolute() else workspace_root / p


class _Run:
    """One run in flight: the plan, its receipt book, the previous receipt and the seams."""

    def __init__(
        self,
        *,
        book: ReceiptBook,
        stages: list[dict[str, Any]],
        previous: dict[str, Any] | None,
        prober: Prober,
        seams: Seams,
        workspace_root: Path,
        strict_env: bool = False,
        key: bytes | None = None,
        cache: CheckCache | None = None,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT_SECONDS,
        shared_locks_dir: Path | None = None,
        state_dir: Path | None = None,
    ) -> None:
        self.book = book
        self.state_dir = state_dir
        self._recent: dict[str, tuple[str, dict[str, Any], Any]] | None = None
        self._recent_guard = threading.Lock()
        self.cache = cache
        self.lock_timeout = lock_timeout
        # This project's folder in the machine-wide lock folder (None: no stage has a
        # resource): what makes two clones of the workspace exclude each other.
        self.shared_locks_dir = shared_locks_dir
        self.stopping = threading.Event()
        self._warned_lock = threading.Lock()
        self._cache_warned = False
        self.commands_started = 0  # stage commands started in this run
        self.strict_env = strict_env
        self.key = key
        self.stages = {s["id"]: s for s in stages}
        self.previous = previous
        self.previous_id: str | None = previous["run_id"] if previous else None
        self.previous_records = (
            {r["id"]: r for r in previous.get("stages", []) if isinstance(r, dict) and "id" in r}
            if previous
            else {}
        )
        self.prober = prober
        self.seams = seams
        self.clock = seams.clock
        self.workspace_root = workspace_root
        self.locks_dir = state_root(workspace_root) / "resource-locks"
        self.logs_dir = book.path.parent / "logs"

    def now(self) -> str:
        return utc_iso(self.clock)

    def warn_cache_write(self, exc: BaseException) -> None:
        """Say once per run that the cache cannot be written: otherwise the only sign is
        each stage's `cache_error` in the receipt, and nothing is shared."""
        with self._warned_lock:
            if self._cache_warned:
                return
            self._cache_warned = True
        root = getattr(self.cache, "root", None)
        print(
            f"ratchet checks: warning: the cache {root} cannot be written ({exc}); this run's "
            "results are not stored in it (each stage's cache_error in the receipt says why)",
            file=sys.stderr,
            flush=True,
        )

    def interrupt(self) -> None:
        """The run was interrupted: stop waiting for locks, kill the stage commands, cut
        the cache requests in flight (a worker blocked on a slow cache server would
        otherwise hold up the end of the run)."""
        self.stopping.set()
        self.seams.executor.kill_all()
        if self.cache is not None:
            self.cache.abort()

    def elapsed(self, started: float) -> float:
        return round(self.clock.monotonic() - started, 3)

    def last_checkpoint(self, sid: str) -> tuple[str, dict[str, Any], Any] | None:
        """(run id, record, that run's environment) of stage `sid`'s newest verified
        checkpoint in the most recent earlier runs, or None. Read on the first cache miss
        that asks, once per run: a miss runs a command, which costs far more."""
        with self._recent_guard:
            if self._recent is None:
                self._recent = (
                    {}
                    if self.state_dir is None
                    else _recent_checkpoints(self.workspace_root, self.state_dir, self.book.run_id)
                )
            return self._recent.get(sid)


def _finish(run: _Run, jobs: int, progress_enabled: bool) -> dict[str, Any]:
    book = run.book
    try:
        with LiveProgress(len(book.order), enabled=progress_enabled) as progress:
            schedule(
                book,
                run.stages,
                lambda sid: _stage_worker(run, sid),
                jobs=jobs,
                waiter=run.seams.waiter,
                progress=progress,
                on_interrupt=run.interrupt,
            )
    except BaseException:
        book.set_header(status="interrupted", phase="interrupted", finished_at=run.now())
        with contextlib.suppress(Exception):
            book.write_receipt()
        raise
    # The reused checkpoints kept in memory, in one append: the journal then holds them
    # should the final write below fail. If this append fails, that write still has them.
    with contextlib.suppress(Exception):
        book.settle()
    book.set_header(phase="verifying")
    snapshot_ok = _final_snapshot(run)
    records = book.all_records()
    status = run_status(records, snapshot_ok)
    book.set_header(
        status=status,
        phase="done",
        snapshot_verified=snapshot_ok and not any(r["status"] == "stale" for r in records),
        finished_at=run.now(),
    )
    try:
        book.write_receipt()
    except Exception as exc:
        raise ReceiptError(
            f"run {book.run_id!r} finished ({status}) but its final receipt could not be "
            f"written: {exc}; the receipt on disk still says 'running' — recover it before "
            "resuming"
        ) from exc
    return book.sealed()


# --- one stage ----------------------------------------------------------------------------


def _stage_worker(run: _Run, sid: str) -> None:
    """Everything one stage does, inside its resource locks; never raises for a stage's
    failure (it becomes the stage's status and error)."""
    stage = run.stages[sid]
    started = run.clock.monotonic()
    try:
        with contextlib.ExitStack() as locks:
            for name in sorted(stage["resources"]):
                _take_lock(run, sid, locks, name)
            _stage_locked(run, stage, started)
    except Exception as exc:
        if run.book.status(sid) in ("pending", "running"):
            run.book.update(
                sid,
                status="failed",
                checkpoint_verified=False,
                error=f"{type(exc).__name__}: {exc}",
                finished_at=run.now(),
                duration_seconds=run.elapsed(started),
            )
            with contextlib.suppress(Exception):
                run.book.persist()


def _take_lock(run: _Run, sid: str, locks: contextlib.ExitStack, name: str) -> None:
    """Hold resource `name` for the stage, waiting up to the run's lock timeout while
    another process (another run, another clone's run) holds it. The wait is real time, as
    a stage's timeout is; it ends early if the run is interrupted.

    Two locks make up one resource: the workspace's own (in its state folder, as before)
    and the machine-wide one of the project (`--lock-dir`), shared by every clone. Both are
    taken or neither: a run never sits on one while it waits for the other."""
    # An infinite timeout waits until the resource is free or the run is interrupted.
    forever = math.isinf(run.lock_timeout)
    polls = 0 if forever else max(0, math.ceil(run.lock_timeout / LOCK_POLL_SECONDS))
    folders = [run.locks_dir]
    if run.shared_locks_dir is not None:
        folders.append(run.shared_locks_dir)
    for attempt in itertools.count() if forever else range(polls + 1):
        try:
            with contextlib.ExitStack() as both:
                for folder in folders:
                    both.enter_context(resource_lock(folder, name))
                locks.enter_context(both.pop_all())
        except RuntimeError as exc:
            if "busy" not in str(exc):
                raise
            if attempt == polls and not forever:
                raise RuntimeError(
                    f"{exc}; gave up after waiting {run.lock_timeout:g} s "
                    "(raise it with --lock-timeout SECONDS)"
                ) from exc
            if attempt == 0:
                run.book.update(sid, waiting_for_resource=name)
                with contextlib.suppress(Exception):
                    run.book.persist()
            if run.stopping.wait(LOCK_POLL_SECONDS):
                raise RuntimeError(
                    f"the run was interrupted while waiting for resource {name!r}"
                ) from exc
            continue
        if attempt:
            run.book.update(sid, waiting_for_resource=None)
        return


def _decide_stage(
    run: _Run, stage: Mapping[str, Any], components: dict[str, Any], cache_key: str
) -> tuple[Decision, dict[str, Any]]:
    """The decision for a stage, gathering the log evidence it asks for, and its explanation."""
    old = run.previous_records.get(stage["id"])
    facts = Facts(stage["id"], stage["reuse"], cache_key, run.previous_id, old)
    decision = decide(facts)
    if decision.action == "hash-log":
        assert decision.log_path is not None
        evidence = _observe_log(run.prober, decision.log_path)
        facts = facts._replace(log=evidence)
        decision = decide(facts)
    if decision.action == "hash-outputs":
        patterns = list(stage.get("outputs") or [])
        on_disk = digest(outputs_manifest(run.workspace_root, patterns)) if patterns else ""
        decision = decide(facts._replace(outputs=on_disk))
    explanation = decision.explanation(run.previous_id)
    if decision.action == "reuse" and not explanation.get("reasons"):
        explanation["reasons"] = [_explain.reused_reason(run.previous_id)]
    if decision.key_changed:
        assert old is not None and run.previous is not None
        changes = _explain.diff_components(
            old.get("cache_components") or {},
            components,
            old_env=run.previous.get("environment"),
            new_env=run.book.header.get("environment"),
            checkpoints=run.prober,
        )
        explanation["reasons"] = [_explain.describe(c) for c in changes] or ["cache key changed"]
        explanation["changes"] = changes
    return decision, explanation


def _observe_log(prober: Prober, path: str) -> LogEvidence:
    try:
        return LogEvidence(sha256=prober.log_digest(path))
    except FileNotFoundError:
        return LogEvidence(missing=True)
    except OSError as exc:
        return LogEvidence(error=str(exc))


def _stage_locked(run: _Run, stage: dict[str, Any], started: float) -> None:
    sid, book, prober = stage["id"], run.book, run.prober

    def probe_failed(what: str, exc: Exception) -> None:
        book.update(
            sid,
            status="failed",
            error=f"could not probe the stage's {what}: {type(exc).__name__}: {exc}",
            finished_at=run.now(),
        )
        book.persist()

    try:
        ident = prober.identity(stage)
    except Exception as exc:
        probe_failed("inputs", exc)
        return
    env = _stage_env(run, stage)
    try:
        extra = _extra_components(run, stage, env)
    except Exception as exc:
        probe_failed("runtime inputs", exc)
        return
    components = cache_components(
        stage,
        ident,
        {d: _produced(book.record(d)) for d in stage["deps"]},
        book.header["environment_fingerprint"],
        extra,
    )
    cache_key = digest(components)
    decision, explanation = _decide_stage(run, stage, components, cache_key)

    if decision.action == "run" and run.cache is None:
        explanation["cache"] = "the cache is off (--no-cache)"
    elif decision.action == "run" and stage["reuse"] != "auto":
        if f"reuse is {stage['reuse']!r}" not in explanation["reasons"]:
            explanation["cache"] = f"not asked (reuse is {stage['reuse']!r})"
    elif decision.action == "run" and _reuse_from_cache(
        run, stage, components, cache_key, explanation, started
    ):
        return
    if decision.action == "reuse":
        old = run.previous_records[sid]
        rec = book.record(sid)
        rec.update(
            status="passed",
            exit_code=old.get("exit_code"),
            log_path=old["log_path"],
            log_sha256=old["log_sha256"],
            checkpoint_verified=True,
            checkpoint_id=old["checkpoint_id"],
            outputs_digest=old.get("outputs_digest"),
            cache_key=cache_key,
            cache_components=components,
            origin_run_id=old.get("origin_run_id") or run.previous_id,
            reused_from=run.previous_id,
            explain=explanation,
            error=None,
            started_at=run.now(),
            finished_at=run.now(),
            duration_seconds=run.elapsed(started),
        )
        _persist_checkpoint(run, sid, rec, reused=True)
        return
    if decision.action == "refuse":
        book.update(
            sid,
            status="failed",
            cache_key=cache_key,
            cache_components=components,
            explain=explanation,
            error=explanation["reasons"][0],
            finished_at=run.now(),
        )
        book.persist()
        return

    run.logs_dir.mkdir(parents=True, exist_ok=True)
    log_path = run.logs_dir / _log_name(sid)
    log_path.write_bytes(b"")  # the evidence exists even if the command never starts
    book.update(
        sid,
        status="running",
        log_path=str(log_path),
        cache_key=cache_key,
        cache_components=components,
        explain=explanation,
        started_at=run.now(),
    )
    book.persist()

    exit_code, error = _execute(run, stage, log_path, env)
    done = {"finished_at": run.now(), "duration_seconds": run.elapsed(started)}
    command_ok = error is None and exit_code == 0
    try:
        after = prober.identity(stage)
    except Exception as exc:
        probe_error = f"post-run input probe failed: {type(exc).__name__}: {exc}"
        book.update(
            sid,
            status=outcome(command_ok=command_ok, inputs_unchanged=None),
            exit_code=exit_code,
            checkpoint_verified=False,
            error=f"{error}; {probe_error}" if error else probe_error,
            **done,
        )
        book.persist()
        return
    status = outcome(command_ok=command_ok, inputs_unchanged=after == ident)
    if status == "failed":
        book.update(
            sid,
            status="failed",
            exit_code=exit_code,
            error=error or f"command exited with status {exit_code}",
            **done,
        )
        book.persist()
        return
    if status == "stale":
        changed = _explain.diff_identity(ident, after, prober)
        book.update(
            sid,
            status="stale",
            exit_code=exit_code,
            checkpoint_verified=False,
            error="inputs changed while the stage ran: " + _explain.summarize(changed),
            **done,
        )
        book.persist()
        return
    outputs_digest = None
    if stage.get("outputs"):
        produced = outputs_manifest(run.workspace_root, stage["outputs"])
        if not produced:
            book.update(
                sid,
                status="failed",
                exit_code=exit_code,
                checkpoint_verified=False,
                error=(
                    f"the command passed but its declared outputs {stage['outputs']} match no "
                    "file: fix the command or the outputs patterns"
                ),
                **done,
            )
            book.persist()
            return
        outputs_digest = digest(produced)
        _keep_manifest(run, outputs_digest, produced)
    else:
        produced = None
    log_sha = prober.log_digest(log_path)
    rec = book.record(sid)
    rec.update(
        status="passed",
        exit_code=exit_code,
        log_sha256=log_sha,
        outputs_digest=outputs_digest,
        checkpoint_verified=True,
        checkpoint_id=checkpoint_id(cache_key, log_sha, book.run_id),
        origin_run_id=book.run_id,
        error=None,
        **done,
    )
    _persist_checkpoint(run, sid, rec)
    if run.cache is not None and stage["reuse"] == "auto" and book.status(sid) == "passed":
        try:
            run.cache.store(
                cache_key,
                rec,
                workspace_root=run.workspace_root,
                outputs=produced,
                stage_id=sid,
                clock=run.clock,
            )
        except (OSError, ValueError) as exc:
            book.update(sid, cache_error=f"not stored in the cache: {exc}")
            run.warn_cache_write(exc)


def _reuse_from_cache(
    run: _Run,
    stage: Mapping[str, Any],
    components: dict[str, Any],
    cache_key: str,
    explanation: dict[str, Any],
    started: float,
) -> bool:
    """Reuse a verified checkpoint the cache holds under `cache_key`, after re-hashing its
    log and making sure its declared outputs are on disk (restoring them from the cache's
    blobs when they are not). False (the stage runs) on a miss or any doubt."""
    assert run.cache is not None
    sid = stage["id"]
    try:
        entry, why = run.cache.lookup(cache_key)
        if entry is None:
            explanation["cache"] = why
            explanation.update(
                _since_last_checkpoint(run, sid, components, cache_key, why, explanation)
            )
            return False
        problem, restored = _cached_outputs(run, entry, list(stage.get("outputs") or []), True)
    except OSError as exc:  # the cache folder, or the workspace, cannot be read or written
        explanation["cache"] = f"cache entry not usable: {exc}"
        return False
    if problem is not None:
        explanation["cache"] = problem
        return False
    origin = entry.get("origin_run_id")
    how = "its log re-hashed" + ("; its outputs were restored from the cache" if restored else "")
    rec = run.book.record(sid)
    rec.update(
        status="passed",
        exit_code=entry.get("exit_code"),
        log_path=str(run.cache.blob_path(entry["log_sha256"])),
        log_sha256=entry["log_sha256"],
        checkpoint_verified=True,
        checkpoint_id=entry["checkpoint_id"],
        outputs_digest=entry.get("outputs_digest"),
        cache_key=cache_key,
        cache_components=components,
        origin_run_id=origin,
        reused_from=origin,
        cache_hit=True,
        explain={
            "resumed_from": run.previous_id,
            "decision": "reused",
            "reasons": [
                f"cache hit: run {origin} left a verified checkpoint with this cache key ({how})"
            ],
        },
        error=None,
        started_at=run.now(),
        finished_at=run.now(),
        duration_seconds=run.elapsed(started),
    )
    _persist_checkpoint(run, sid, rec, reused=True)
    return True


def _since_last_checkpoint(
    run: _Run,
    sid: str,
    components: Mapping[str, Any],
    cache_key: str,
    why: str,
    explanation: Mapping[str, Any],
) -> dict[str, Any]:
    """For a cache that has no entry for `cache_key`: which run's checkpoint of the stage
    it was compared with (`compared_with`) and what differs (`changes`), as `--resume`
    names it; nothing when the reason is another (a damaged entry says so itself), when the
    decision already named the changes, or when no earlier verified checkpoint is found.
    Explaining never fails a stage."""
    if not why.startswith("no cache entry") or "changes" in explanation:
        return {}
    try:
        found = run.last_checkpoint(sid)
        if found is None:
            return {}
        since, old, old_env = found
        if old.get("cache_key") == cache_key:
            return {"compared_with": since, "changes": []}
        changes = _explain.diff_components(
            old["cache_components"],
            components,
            old_env=old_env,
            new_env=run.book.header.get("environment"),
            checkpoints=run.prober,
        )
    except Exception:  # noqa: BLE001 - an explanation is never worth a failed stage
        return {}
    return {"compared_with": since, "changes": changes}


def _recent_checkpoints(
    workspace_root: Path, state_dir: Path, skip: str
) -> dict[str, tuple[str, dict[str, Any], Any]]:
    """Stage id -> (run id, record, environment) of its newest verified checkpoint among
    the `RECENT_RUNS` most recently written run folders (but `skip`, this run) whose
    receipts are trusted: what the cache last stored for the stage, as near as the state
    folder knows without an index of the cache."""
    runs_dir = state_dir / "runs"

    def written(folder: Path) -> float:
        try:
            return folder.stat().st_mtime
        except OSError:
            return 0.0

    try:
        folders = [f for f in runs_dir.iterdir() if f.name != skip]
    except OSError:
        return {}
    receipts = []
    for folder in sorted(folders, key=written, reverse=True)[:RECENT_RUNS]:
        try:
            receipts.append(read_receipt(workspace_root, state_dir, folder.name))
        except (ValueError, OSError):  # ReceiptError is a ValueError: not trusted, skipped
            continue
    receipts.sort(key=lambda r: str(r.get("started_at") or ""), reverse=True)
    found: dict[str, tuple[str, dict[str, Any], Any]] = {}
    for receipt in receipts:
        for rec in receipt.get("stages") or []:
            if (
                isinstance(rec, dict)
                and isinstance(rec.get("id"), str)
                and rec["id"] not in found
                and rec.get("status") == "passed"
                and rec.get("checkpoint_verified") is True
                and isinstance(rec.get("cache_components"), dict)
            ):
                found[rec["id"]] = (str(receipt.get("run_id")), rec, receipt.get("environment"))
    return found


def _cached_outputs(
    run: _Run, entry: Mapping[str, Any], patterns: list[str], write: bool
) -> tuple[str | None, bool]:
    """Whether a cache entry's declared outputs are on disk or can be restored from its
    blobs (restored when `write`; a dry run only re-hashes them): why not, or None; and
    whether they were (would be) restored."""
    assert run.cache is not None
    want = entry.get("outputs_digest")
    if not want:
        return ("cache entry has no outputs digest" if patterns else None), False
    if digest(outputs_manifest(run.workspace_root, patterns)) == want:
        return None, False
    manifest = entry.get("outputs") or {}
    if digest(manifest) != want:
        problem: str | None = "its outputs manifest does not match its outputs digest"
    elif not write:
        problem = run.cache.check_restore(run.workspace_root, manifest, patterns)
    else:
        problem = run.cache.restore_outputs(run.workspace_root, manifest, patterns)
        if problem is None and digest(outputs_manifest(run.workspace_root, patterns)) != want:
            problem = "the declared outputs hold other files besides the cached ones"
    return (None if problem is None else f"cache entry not usable: {problem}"), True


def _shared_locks_dir(
    args: argparse.Namespace, project: Path | None, stages: Sequence[Mapping[str, Any]]
) -> Path | None:
    """This run's folder of machine-wide resource locks, or None when no stage declares a
    resource (a run without resources never touches the lock folder).

    The scope is `lock_scope` (`--lock-scope`, or RATCHET_CHECKS_LOCK_SCOPE), else the
    project file's `name`, which every clone of the workspace shares; without a project
    file, one scope for the whole machine. Two runs in the same scope exclude each other on
    a resource name, wherever their workspaces are."""
    if not any(stage.get("resources") for stage in stages):
        return None
    scope = getattr(args, "lock_scope", None) or os.environ.get(LOCK_SCOPE_ENV)
    if not scope and project is not None and project.exists():
        scope = "project:" + str(load_project(project)["name"])
    try:
        lock_dir = machine_lock_dir(getattr(args, "lock_dir", None))
    except OSError as exc:
        raise ConfigError(
            f"the resource lock folder cannot be used ({exc}); choose one with --lock-dir DIR"
        ) from exc
    return scope_lock_dir(lock_dir, scope or "machine")


def _lock_timeout(args: argparse.Namespace) -> float:
    """`--lock-timeout` in seconds: a number >= 0, or infinity (wait as long as it takes).
    NaN is refused here, before anything runs, not by the first stage that waits."""
    value = getattr(args, "lock_timeout", None)
    if value is None:
        return DEFAULT_LOCK_TIMEOUT_SECONDS
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or math.isnan(value)
        or value < 0
    ):
        raise ConfigError(
            f"--lock-timeout must be a number of seconds >= 0 (or inf to wait as long as it "
            f"takes), got {value!r}"
        )
    return float(value)


def _open_cache(
    args: argparse.Namespace, state_dir: Path, clock: Clock, *, read_only: bool = False
) -> CheckCache | None:
    """The cache this run reads and writes: `cache_dir` (or RATCHET_CHECKS_CACHE_DIR), or a
    cache server at `cache_url` (or RATCHET_CHECKS_CACHE_URL) with the state folder's
    `cache/` as its local mirror, else that `cache/` alone; None when `cache` is off (the
    Python API's default). A command-line option wins over the environment."""
    if not getattr(args, "cache", False):
        return None
    read_only = read_only or bool(getattr(args, "cache_read_only", False))
    given_dir, given_url = getattr(args, "cache_dir", None), getattr(args, "cache_url", None)
    if given_dir and given_url:
        raise ConfigError("--cache-dir and --cache-url are alternatives: pass only one of them")
    url_from = "--cache-url"
    if not given_dir and not given_url:
        url_from = "RATCHET_CHECKS_CACHE_URL"
        env_dir = os.environ.get("RATCHET_CHECKS_CACHE_DIR")
        env_url = os.environ.get("RATCHET_CHECKS_CACHE_URL")
        if env_dir and env_url:
            raise ConfigError(
                "both RATCHET_CHECKS_CACHE_DIR and RATCHET_CHECKS_CACHE_URL are set: set only one "
                "of them (or pass --cache-dir or --cache-url)"
            )
        given_dir, given_url = env_dir, env_url
    if given_url:
        from ratchet.checks import _remote  # urllib only when a cache server is used

        return _remote.RemoteCheckCache(
            _remote.check_url(given_url, url_from),
            state_dir / "cache",
            read_only=read_only,
            token=os.environ.get(_remote.TOKEN_ENV) or None,
            clock=clock,
        )
    root = Path(given_dir) if given_dir else state_dir / "cache"
    return CheckCache(root, read_only=read_only)


def _stage_env(run: _Run, stage: Mapping[str, Any]) -> dict[str, str]:
    """The environment a stage's command (and its runtime inputs) see. Never the signing
    key; in strict mode only the fingerprinted variables and the stage's declared `env`."""
    if run.strict_env:
        names = {*ENV_KEYS, *extra_env_keys(), *stage.get("env", ())}
        base = {k: v for k, v in os.environ.items() if k in names}
    else:
        base = dict(os.environ)
    for secret in SECRET_ENV:
        base.pop(secret, None)
    return {
        **base,
        "RATCHET_RUN_ID": run.book.run_id,
        "RATCHET_STAGE_ID": stage["id"],
        "RATCHET_WORKSPACE_ROOT": str(run.workspace_root),
    }


def _extra_components(
    run: _Run, stage: Mapping[str, Any], env: Mapping[str, str]
) -> dict[str, Any]:
    """The cache-key components only some stages have: declared outputs, declared env
    variables (values hashed, never stored), runtime inputs, and strict env mode."""
    extra: dict[str, Any] = {}
    if stage.get("outputs"):
        extra["outputs"] = sorted(stage["outputs"])
    if stage.get("env"):
        extra["env"] = {
            name: None if name not in os.environ else hash_value(os.environ[name], run.key)
            for name in sorted(stage["env"])
        }
    if stage.get("runtime_inputs"):
        missing = _missing_cwd(run.workspace_root, stage)
        if missing is not None and any("argv" in item for item in stage["runtime_inputs"]):
            raise OSError(f"its cwd {missing}, so its runtime input commands cannot run there")
        extra["runtime"] = runtime_identity(
            stage["runtime_inputs"],
            workspace_root=run.workspace_root,
            cwd=run.workspace_root / stage["cwd"],
            env=env,
        )
    if run.strict_env:
        extra["env_mode"] = "strict"
    return extra


def _produced(record: Mapping[str, Any]) -> str | None:
    """What a consumer keys on for a dependency: its outputs' digest when it declares
    outputs (a re-run producing the same bytes changes nothing: early cutoff), else its
    checkpoint."""
    if record.get("outputs_digest"):
        return "outputs:" + str(record["outputs_digest"])
    return record.get("checkpoint_id")


def _keep_manifest(run: _Run, key: str, manifest: Mapping[str, str]) -> None:
    store = getattr(run.prober, "keep_manifest", None)
    if store is not None:
        with contextlib.suppress(OSError):
            store(key, dict(manifest))


def _hide_values(env: Mapping[str, str], key: bytes | None) -> dict[str, str]:
    """The environment fingerprint as receipts keep it: variables' values hashed."""
    return {k: hash_value(v, key) if k.startswith("env:") else v for k, v in env.items()}


def _execute(
    run: _Run, stage: Mapping[str, Any], log_path: Path, env: Mapping[str, str]
) -> tuple[int | None, str | None]:
    """(exit code, error) of the stage's command; a timeout or a failure to start is an error."""
    sid = stage["id"]

    def started(pgid: int) -> None:
        # Recorded so `recover` can see (and stop) a group a killed ratchet left behind.
        run.book.update(sid, pgid=pgid, pgid_start=process_start(pgid))
        run.book.persist()

    missing = _missing_cwd(run.workspace_root, stage)
    if missing is not None:  # else the program is blamed: "could not run 'make': ..."
        return None, (
            f"its cwd {missing} when the stage starts: no stage before it made that folder; "
            "fix the check's cwd, or have a stage it depends on (deps or after) create it"
        )
    executor = run.seams.executor
    run.commands_started += 1
    run.prober.command_started()
    try:
        if isinstance(executor, SubprocessExecutor):
            exit_code = executor.run(
                stage,
                cwd=run.workspace_root / stage["cwd"],
                log_path=log_path,
                timeout=stage["timeout_seconds"],
                env=env,
                on_start=started,
            )
        else:
            exit_code = executor.run(
                stage,
                cwd=run.workspace_root / stage["cwd"],
                log_path=log_path,
                timeout=stage["timeout_seconds"],
                env=env,
            )
    except StageTimeoutError as exc:
        return None, str(exc)
    except Exception as exc:
        return None, f"could not run {stage['argv'][0]!r}: {type(exc).__name__}: {exc}"
    finally:
        run.prober.command_finished()
    return exit_code, None


def _persist_checkpoint(run: _Run, sid: str, rec: dict[str, Any], *, reused: bool = False) -> None:
    """Make `rec` (a verified checkpoint) durable before anyone may build on it.

    A `reused` one (this run verified an earlier checkpoint, or a cache entry) is kept
    (`ReceiptBook.keep`): it reaches disk with the next blocking write, which comes before
    any stage command starts and at the end of the schedule, so a no-op resume makes one
    append instead of one per stage. Losing it in a crash loses no verified work that a
    command built on; the next run verifies the stage again."""
    try:
        if reused:
            run.book.keep(sid, rec)
        else:
            run.book.persist(override=(sid, rec))
    except Exception as exc:
        run.book.update(
            sid,
            status="failed",
            checkpoint_verified=False,
            checkpoint_id=None,
            error=f"the verified checkpoint could not be persisted: {type(exc).__name__}: {exc}",
        )
        with contextlib.suppress(Exception):
            run.book.persist()


def _log_name(sid: str) -> str:
    return safe_file_name(sid, ".log")


# --- the end-of-run snapshot --------------------------------------------------------------


def _final_snapshot(run: _Run) -> bool:
    """Probe every passed stage's inputs again; True only if none changed.

    When no stage command ran in this run (a no-op resume), nothing the run did can have
    changed an input, so the prober's snapshot from the start of the run (what every reuse
    was decided on) stands: it is not read again. Otherwise every input is re-read."""
    if run.commands_started:
        run.prober.forget()
    ok = True
    for rec in run.book.all_records():
        if rec["status"] != "passed":
            continue
        stage = run.stages[rec["id"]]
        checked = (rec.get("cache_components") or {}).get("inputs")
        try:
            now = _snapshot_probe(run.prober, stage, checked)
        except Exception as exc:
            ok = False
            run.book.update(
                rec["id"],
                snapshot_verified=False,
                snapshot_error=f"end-of-run input probe failed: {type(exc).__name__}: {exc}",
            )
            continue
        if now != checked:
            ok = False
            changed = _explain.diff_identity(checked, now, run.prober)
            run.book.update(
                rec["id"],
                snapshot_verified=False,
                snapshot_error="inputs changed after its checkpoint: "
                + _explain.summarize(changed),
            )
        else:
            run.book.update(rec["id"], snapshot_verified=True)
    return ok


def _snapshot_probe(prober: Prober, stage: Mapping[str, Any], recorded: Any) -> Any:
    """Probe for the end-of-run snapshot, comparing like with like: an identity of the
    built-in shape is re-probed directly; one produced by a replaced `identity` (a plugin,
    a test double) is re-probed through it."""
    scope = prober.scope(stage)
    builtin = (
        isinstance(recorded, dict)
        and sorted(recorded) == scope
        and all(
            isinstance(v, str) and (len(v) == 64 or v == MISSING_REPOSITORY)
            for v in recorded.values()
        )
    )
    if builtin:
        return prober.snapshot_identity(stage)
    return prober.identity(stage)


# --- before the run -----------------------------------------------------------------------


def _load_previous(workspace_root: Path, state_dir: Path, run_id: str) -> dict[str, Any]:
    previous = read_receipt(workspace_root, state_dir, run_id)
    if previous.get("status") == "running":
        raise ResumeRefusedError(
            f"run {run_id!r} is still marked running: if its process is gone (crashed), run "
            f"`ratchet checks recover {run_id} --apply --confirm-processes-stopped` first"
        )
    return previous


def _resolve_repositories(
    workspace_root: Path, project: Path | None, stages: Sequence[Mapping[str, Any]]
) -> dict[str, Path]:
    """Repository name -> directory, from the project file when there is one.

    Without a project file a named repository is the folder of that name under the
    workspace root, and the whole workspace is the root itself (as one repository, ".").
    """
    if project is not None and project.exists():
        loaded = load_project(project)
        return {r["name"]: workspace_root / r["path"] for r in loaded["repositories"]}
    repos: dict[str, Path] = {}
    for stage in stages:
        for name in (stage.get("inputs") or {}).get("repos") or []:
            repos[name] = workspace_root / name
    if not repos or any(s.get("inputs") is None for s in stages):
        repos.setdefault(".", workspace_root)
    return repos


def _progress_enabled(args: argparse.Namespace) -> bool:
    if getattr(args, "json", False) or getattr(args, "no_progress", False):
        return False
    return sys.stderr.isatty()


def _never_write(path: Path, payload: dict[str, Any]) -> None:
    raise AssertionError(f"a dry run writes no receipt (asked to write {path})")


def _dry_run(run: _Run, stages: list[dict[str, Any]], resume: str | None) -> dict[str, Any]:
    """The plan, with each stage's predicted decision (`reuse`, `run` or `fail`) and why.

    It probes inputs and runtime inputs and re-hashes the evidence a reuse would rest on,
    as a run would, but runs no stage and writes no receipt. A stage whose data dependency
    would run is predicted to run (its dependency's new checkpoint is not known yet).
    """
    produced: dict[str, str | None] = {}
    out = []
    for stage in stages:
        sid = stage["id"]
        prediction, reasons, produced[sid] = _predict(run, stage, produced)
        out.append({**stage, "status": "planned", "prediction": prediction, "reasons": reasons})
    return {
        "run_id": None,
        "status": "planned",
        "dry_run": True,
        "resumed_from": resume,
        "plan_fingerprint": plan_fingerprint(stages),
        "fingerprint_version": FINGERPRINT_VERSION,
        "previous_status": run.previous.get("status") if run.previous else None,
        "stages": out,
    }


def _predict(
    run: _Run, stage: Mapping[str, Any], produced: Mapping[str, str | None]
) -> tuple[str, list[str], str | None]:
    """(prediction, reasons, what the stage would produce for its consumers)."""
    sid = stage["id"]
    waiting = [d for d in stage["deps"] if produced.get(d) is None]
    if waiting:
        return "run", [f"dependency {waiting[0]!r} would run, so what it produces is new"], None
    try:
        ident = run.prober.identity(stage)
        extra = _extra_components(run, stage, _stage_env(run, stage))
    except Exception as exc:
        return "fail", [f"its inputs cannot be probed: {type(exc).__name__}: {exc}"], None
    components = cache_components(
        stage,
        ident,
        {d: produced[d] for d in stage["deps"]},
        run.book.header["environment_fingerprint"],
        extra,
    )
    cache_key = digest(components)
    decision, explanation = _decide_stage(run, stage, components, cache_key)
    if decision.action == "reuse":
        old = run.previous_records[sid]
        return "reuse", [f"its checkpoint in run {run.previous_id} matches"], _produced(old)
    if decision.action == "refuse":
        return "fail", list(explanation["reasons"]), None
    reasons = list(explanation["reasons"])
    if run.cache is not None and stage["reuse"] == "auto":
        entry, why = run.cache.lookup(cache_key)
        if entry is not None:
            note = f"cache hit: run {entry.get('origin_run_id')} left a verified checkpoint"
            patterns = list(stage.get("outputs") or [])
            problem, restore = _cached_outputs(run, entry, patterns, False)
            if problem is None:
                if restore:
                    note += " (its outputs would be restored from the cache)"
                return "reuse", [note], _produced(entry)
            why = problem
        found = {**explanation, "cache": why}
        found.update(_since_last_checkpoint(run, sid, components, cache_key, why, explanation))
        reasons += _explain.cache_reasons(found)
    return "run", reasons, None
