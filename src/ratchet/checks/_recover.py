"""Recovering a crashed run: a receipt left `running` becomes `interrupted`.

Nobody knows what a dead run was doing, so recovery keeps only what was durable (verified
checkpoints), fails the stage that was running and skips the rest; and it refuses while
the run's process may still be alive, here or in this very process.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock, utc_iso
from ratchet.checks._errors import ReceiptError
from ratchet.checks._receipts import (
    ReceiptWriter,
    read_receipt,
    receipt_path,
    seal_receipt,
    state_dir_for,
)
from ratchet.checks.common import atomic_json

__all__ = ["active", "process_start", "recover"]

_ACTIVE_RUNS: set[str] = set()  # runs this process is executing right now


@contextlib.contextmanager
def active(run_id: str) -> Iterator[None]:
    """Mark `run_id` as executing in this process for the block (recover refuses it)."""
    _ACTIVE_RUNS.add(run_id)
    try:
        yield
    finally:
        _ACTIVE_RUNS.discard(run_id)


def process_start(pid: int) -> str | None:
    """The kernel's start time of a process (to tell a live pid from a reused one)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return data.rsplit(")", 1)[-1].split()[19]


def _default_writer(path: Path, payload: dict[str, Any]) -> None:
    atomic_json(path, payload)


def recover(
    workspace_root: str | os.PathLike[str],
    state_dir: str | os.PathLike[str] | None,
    run_id: str,
    *,
    apply: bool = False,
    confirm_processes_stopped: bool = False,
    clock: Clock = SYSTEM_CLOCK,
    writer: ReceiptWriter = _default_writer,
) -> dict[str, Any]:
    """Turn a receipt left `running` by a crash into `interrupted`.

    Without `apply` it only reports what it would do; without the confirmation it refuses.
    Verified checkpoints stay (they were durable); a stage that was running becomes
    `failed`, a stage not yet started `skipped`. `recovered_at` is read from `clock`; the
    new receipt goes through `writer` (a failed write raises ReceiptError).
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
    if _still_alive(receipt, run_id):
        return {
            **base,
            **plan,
            "ok": False,
            "action": "refused",
            "status": "running",
            "error": (
                f"refusing to recover run {run_id}: its process (pid {receipt.get('pid')}) "
                "is still alive"
            ),
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
        "recovered_at": utc_iso(clock),
        "stages": new_stages,
    }
    path = receipt_path(state_dir_for(root, state_dir), run_id)
    try:
        writer(path, seal_receipt(recovered))
    except OSError as exc:
        raise ReceiptError(
            f"could not write the recovered receipt of run {run_id!r} at {path}: {exc}; "
            "the receipt on disk is unchanged (still 'running')"
        ) from exc
    return {
        **base,
        **plan,
        "ok": True,
        "action": "recovered",
        "status": "interrupted",
        "text": f"run {run_id} marked interrupted; resume it with --resume {run_id}",
    }


def _still_alive(receipt: dict[str, Any], run_id: str) -> bool:
    """Whether the run's process may still be running: it is this process's active run, or
    its pid on this host still belongs to the process that started it."""
    if run_id in _ACTIVE_RUNS:
        return True
    pid = receipt.get("pid")
    same_process = pid == os.getpid()  # and not active: e.g. its final write failed
    return (
        receipt.get("host") == socket.gethostname()
        and isinstance(pid, int)
        and not same_process
        and receipt.get("pid_start") is not None
        and process_start(pid) == receipt.get("pid_start")
    )
