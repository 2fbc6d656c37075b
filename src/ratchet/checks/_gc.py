"""`ratchet checks gc`: bound the cache and the run folders a state directory keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet.checks._cache import gc as gc_cache
from ratchet.checks._receipts import read_receipt

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
    evidence someone needs to look at."""
    cache = gc_cache(cache_root, max_age_seconds=max_age_seconds, now=clock.now(), dry_run=dry_run)
    finished: list[tuple[str, str]] = []
    runs_dir = state_dir / "runs"
    for child in sorted(runs_dir.iterdir()) if runs_dir.is_dir() else []:
        try:
            receipt = read_receipt(state_dir, state_dir, child.name)
        except ValueError:
            continue
        if receipt.get("status") != "running":
            finished.append((str(receipt.get("started_at") or ""), child.name))
    finished.sort(reverse=True)
    removed_runs = [name for _, name in finished[keep_runs:]]
    if not dry_run:
        import shutil  # here: only `gc` removes folders

        for name in removed_runs:
            shutil.rmtree(runs_dir / name, ignore_errors=True)
    verb = "would remove" if dry_run else "removed"
    text = (
        f"{verb} {cache['removed_entries']} cache entries, {cache['removed_blobs']} blobs "
        f"({cache['freed_bytes']} bytes) and {len(removed_runs)} run folders"
    )
    return {"ok": True, "dry_run": dry_run, **cache, "removed_runs": removed_runs, "text": text}
