"""Recovering a crashed run: a receipt left `running` becomes `interrupted`.

Nobody knows what a dead run was doing, so recovery keeps only what was durable (verified
checkpoints), fails the stage that was running and skips the rest; and it refuses while
the run's process may still be alive, here or in this very process.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

from ratchet._clock import SYSTEM_CLOCK, utc_iso
from ratchet.checks._errors import ReceiptError
from ratchet.checks._receipts import (
    ReceiptWriter,
    read_receipt,
    receipt_path,
    seal_receipt,
    state_dir_for,
)
from ratchet.checks.common import atomic_json

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

    from ratchet._clock import Clock

__all__ = ["active", "hostname", "process_start", "recover"]

_ACTIVE_RUNS: set[str] = set()  # runs this process is executing right now


def hostname() -> str:
    """This machine's name, as `socket.gethostname()` gives it (on POSIX both read the
    kernel's node name) without importing `socket` at every start-up."""
    if hasattr(os, "uname"):
        return os.uname().nodename
    import socket

    return socket.gethostname()


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
    stop_stages: bool = False,
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
    live = _live_groups(receipt)
    plan = {
        "mark_failed": was_running,
        "mark_skipped": not_started,
        "verified_checkpoints_kept": kept,
        "live_process_groups": live,
    }
    if not apply:
        # With stage groups still alive, --apply alone would be refused: say what it needs.
        how = "re-run with --apply --confirm-processes-stopped" + (
            " --stop-stages (stage process groups are still alive: "
            + ", ".join(f"{g['stage']} (process group {g['pgid']})" for g in live)
            + "; --stop-stages kills them), or stop them yourself first"
            if live
            else ""
        )
        return {
            **base,
            **plan,
            "ok": True,
            "action": "would-recover",
            "status": "running",
            "text": (
                f"would mark run {run_id} interrupted (failed: {was_running or 'none'}, "
                f"skipped: {not_started or 'none'}, kept: {kept or 'none'}); {how}"
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
    # Only a run whose own process is gone has stage groups to stop: those of a live run are
    # its work, not leftovers (checked before --stop-stages kills anything).
    if _still_alive(receipt, run_id):
        return {
            **base,
            **plan,
            "ok": False,
            "action": "refused",
            "status": "running",
            "error": (
                f"refusing to recover run {run_id}: its process (pid {receipt.get('pid')}) "
                "is still alive, so the run is not over and nothing was stopped; wait for it "
                "to end, or stop it (Ctrl-C, or `kill PID`) and recover it then"
            ),
        }
    if live and stop_stages:
        for group in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group["pgid"], signal.SIGKILL)
        live = _wait_gone(receipt, clock)
        plan["live_process_groups"] = live
    if live:
        names = ", ".join(f"{g['stage']} (process group {g['pgid']})" for g in live)
        return {
            **base,
            **plan,
            "ok": False,
            "action": "refused",
            "status": "running",
            "error": (
                f"refusing to recover run {run_id}: stage process groups are still alive: "
                f"{names}; stop them (`kill -KILL -- -PGID`) or pass --stop-stages"
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


def _group_alive(pgid: int) -> bool:
    """Whether a process group has a live member; zombies (dead, not yet reaped by an init
    that may never reap them) do not count."""
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _live_groups(receipt: dict[str, Any]) -> list[dict[str, Any]]:
    """The recorded stage process groups that still exist on this host."""
    if receipt.get("host") != hostname():
        return []
    out = []
    for s in receipt.get("stages", []):
        pgid = s.get("pgid")
        if s.get("status") == "running" and isinstance(pgid, int) and pgid > 1:
            if _group_alive(pgid):
                out.append({"stage": s.get("id"), "pgid": pgid})
    return out


def _wait_gone(receipt: dict[str, Any], clock: Clock, attempts: int = 200) -> list[dict[str, Any]]:
    # SIGKILL is asynchronous: give the kernel a moment to tear the groups down.
    live = _live_groups(receipt)
    for _ in range(attempts):
        if not live:
            break
        clock.sleep_sync(0.01)
        live = _live_groups(receipt)
    return live


def _still_alive(receipt: dict[str, Any], run_id: str) -> bool:
    """Whether the run's process may still be running: it is this process's active run, or
    its pid on this host still belongs to the process that started it."""
    if run_id in _ACTIVE_RUNS:
        return True
    pid = receipt.get("pid")
    same_process = pid == os.getpid()  # and not active: e.g. its final write failed
    return (
        receipt.get("host") == hostname()
        and isinstance(pid, int)
        and not same_process
        and receipt.get("pid_start") is not None
        and process_start(pid) == receipt.get("pid_start")
    )
