"""Compatibility: the check runner's old module, kept as thin shims over the seams.

An outside suite calls `run_checks(args, stages)`, `read_receipt`, `recover` and `explain`
from here, and patches `atomic_json`, `wait`, `_execute_stage_command` and
`environment_fingerprint`. Those patches keep working because the seams these entry points
use by default look the names up on this module at call time. New code passes a `Seams`
instead (`ratchet.checks.Seams`; see docs/checks.md, "How the runner is built").
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import wait
from pathlib import Path

from ratchet._clock import SYSTEM_CLOCK
from ratchet.checks import _recover, _run
from ratchet.checks import common as _common
from ratchet.checks._cli import add_common_arguments, register
from ratchet.checks._decide import CHECKPOINT_VERSION, FINGERPRINT_VERSION
from ratchet.checks._execute import SubprocessExecutor
from ratchet.checks._execute import execute_stage_command as _execute_stage_command
from ratchet.checks._explain import explain
from ratchet.checks._receipts import append_record, read_receipt, seal_receipt
from ratchet.checks._recover import process_start
from ratchet.checks._seams import Seams, environment_fingerprint
from ratchet.checks.common import atomic_json

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "CHECKPOINT_VERSION",
    "FINGERPRINT_VERSION",
    "add_common_arguments",
    "atomic_json",
    "environment_fingerprint",
    "explain",
    "patchable_seams",
    "read_receipt",
    "recover",
    "register",
    "run_checks",
    "wait",
]

# Read from here by the suite; defined where they belong.
_seal = seal_receipt
_process_start = process_start


def _write(path: Path, payload: dict[str, Any]) -> None:
    atomic_json(path, payload)


def _wait(
    fs: Iterable[Any], timeout: float | None = None, return_when: str = "ALL_COMPLETED"
) -> tuple[set[Any], set[Any]]:
    done, not_done = wait(fs, timeout=timeout, return_when=return_when)
    return done, not_done


def _environment() -> Mapping[str, str] | str:
    return environment_fingerprint()


def patchable_seams() -> Seams:
    """The real seams, reaching the executor, writer, waiter and environment fingerprint
    through this module's names (so patching them here takes effect).

    A suite that patches `atomic_json` sees every receipt write through it, as before the
    receipt journal existed: while it is patched, runs rewrite the whole receipt after each
    change of state instead of appending to the journal."""
    return Seams(
        executor=SubprocessExecutor(lambda *a, **k: _execute_stage_command(*a, **k)),
        writer=_write,
        journal=append_record if atomic_json is _common.atomic_json else None,
        waiter=_wait,
        environment=_environment,
    )


def run_checks(
    args: argparse.Namespace, stages: Sequence[Mapping[str, Any]], *, seams: Seams | None = None
) -> dict[str, Any]:
    """Run a plan of stages and return the sealed receipt (also written to `receipt_path`).

    `args` carries `workspace_root`, `project`, `state_dir`, `dry_run`, `jobs`, `profile`,
    `resume` (a run id to reuse verified checkpoints from, or None), `repo` and `changed`.
    Without `seams` it uses `patchable_seams()`.
    """
    return _run.run_checks(args, stages, seams if seams is not None else patchable_seams())


def recover(
    workspace_root: str | os.PathLike[str],
    state_dir: str | os.PathLike[str] | None,
    run_id: str,
    *,
    apply: bool = False,
    confirm_processes_stopped: bool = False,
    stop_stages: bool = False,
) -> dict[str, Any]:
    """Turn a receipt left `running` by a crash into `interrupted` (see `_recover.recover`);
    the new receipt is written through this module's `atomic_json`."""
    return _recover.recover(
        workspace_root,
        state_dir,
        run_id,
        apply=apply,
        confirm_processes_stopped=confirm_processes_stopped,
        clock=SYSTEM_CLOCK,
        writer=_write,
        stop_stages=stop_stages,
    )
