"""`ratchet checks gc`: bound the cache and the run folders a state directory keeps."""

from __future__ import annotations

from pathlib import Path

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet.checks._cache import gc as gc_cache
from ratchet.checks._receipts import read_receipt

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

__all__ = ["collect_garbage"]


def collect_garbage(
    state_dir: Path,
    cache_root: Path,
    *,
    max_age_seconds: float,
    keep_runs: int,
    dry_run: bool = False,
    clock: Clock = SYSTEM_CLOCK,
) -> dict[str, Any]:
    """Drop cache entries older than `max_age_seconds` and unreferenced blobs, and the
    folders of finished runs beyond the `keep_runs` most recent. A run still `running`
    (or whose receipt cannot be trusted) is never removed: it may be a live run, or
    evidence someone needs to look at. Nor is a run whose logs a kept run reuses (a reused
    stage's `log_path` stays in the run that ran it): removing it would make the kept run's
    evidence missing, so `--resume` from it would fail."""
    finished: list[tuple[str, str]] = []
    uses: dict[str, set[str]] = {}  # run folder -> the other run folders its logs are in
    blobs: dict[str, set[str]] = {}  # run folder -> the cache blobs its logs are
    kept: set[str] = set()
    runs_dir = state_dir / "runs"
    for child in sorted(runs_dir.iterdir()) if runs_dir.is_dir() else []:
        try:
            receipt = read_receipt(state_dir, state_dir, child.name)
        except ValueError:
            kept.add(child.name)
            continue
        folders, blobs[child.name] = _log_places(receipt)
        uses[child.name] = folders - {child.name}
        if receipt.get("status") != "running":
            finished.append((str(receipt.get("started_at") or ""), child.name))
        else:
            kept.add(child.name)
    finished.sort(reverse=True)
    kept.update(name for _, name in finished[:keep_runs])
    beyond = {name for _, name in finished[keep_runs:]}
    todo = list(kept)
    while todo:  # every folder a kept run's logs are in, and theirs in turn
        for name in uses.get(todo.pop(), ()):
            if name not in kept:
                kept.add(name)
                todo.append(name)
    removed_runs = [name for _, name in finished[keep_runs:] if name not in kept]
    cache = gc_cache(
        cache_root,
        max_age_seconds=max_age_seconds,
        now=clock.now(),
        dry_run=dry_run,
        keep_blobs=frozenset(blob for name in kept for blob in blobs.get(name, ())),
    )
    referenced = sorted(beyond & kept)
    if not dry_run:
        import shutil  # here: only `gc` removes folders

        for name in removed_runs:
            shutil.rmtree(runs_dir / name, ignore_errors=True)
    verb = "would remove" if dry_run else "removed"
    text = (
        f"{verb} {cache['removed_entries']} cache entries, {cache['removed_blobs']} blobs "
        f"({cache['freed_bytes']} bytes) and {len(removed_runs)} run folders"
    )
    if referenced:
        text += (
            f"; kept {len(referenced)} older run folders whose logs kept runs reuse "
            f"({', '.join(referenced)})"
        )
    return {
        "ok": True,
        "dry_run": dry_run,
        **cache,
        "removed_runs": removed_runs,
        "kept_referenced_runs": referenced,
        "text": text,
    }


def _log_places(receipt: dict[str, Any]) -> tuple[set[str], set[str]]:
    """Where a receipt's stage logs are: the run folders (`.../runs/RUN/logs/X`) and the
    cache blobs (`.../blobs/ab/abcd...`, a stage reused from the cache).

    Matched by shape, not by the state folder's path, which a relative `--state-dir` or a
    moved state folder changes; a false match only keeps something longer."""
    folders, blobs = set(), set()
    for rec in receipt.get("stages") or []:
        log = rec.get("log_path") if isinstance(rec, dict) else None
        parts = Path(log).parts if isinstance(log, str) else ()
        if len(parts) >= 4 and parts[-2] == "logs" and parts[-4] == "runs":
            folders.add(parts[-3])
        elif len(parts) >= 3 and parts[-3] == "blobs":
            blobs.add(parts[-1])
    return folders, blobs
