"""Receipts: where a run's receipt lives, how it is sealed, read back, and kept while it runs.

A receipt is trusted only when its seal matches. While a run goes, `ReceiptBook` holds its
records in memory and writes them through an injected writer: a checkpoint counts only once
a write holding it has returned, so a failing writer can never make one trusted.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ratchet._clock import Clock, utc_iso
from ratchet.checks._decide import CHECKPOINT_VERSION, FINGERPRINT_VERSION
from ratchet.checks._errors import LegacyReceiptError, ReceiptError
from ratchet.checks._signing import KEY_ENV, KEY_FILE_ENV, signing_key
from ratchet.checks.common import read_json, state_root
from ratchet.store import seal, verify_seal

__all__ = [
    "ReceiptBook",
    "ReceiptWriter",
    "blank_record",
    "check_run_id",
    "latest_run_id",
    "new_run_id",
    "read_receipt",
    "receipt_path",
    "seal_receipt",
    "state_dir_for",
]

# Writes a JSON payload to a path atomically: readers see the old file or the new one.
ReceiptWriter = Callable[[Path, dict[str, Any]], None]

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def seal_receipt(receipt: Mapping[str, Any]) -> dict[str, Any]:
    """The receipt with its seal over its canonical JSON (minus the seal): an HMAC-SHA256
    under the signing key when one is configured (`_signing`), else a plain SHA-256."""
    return seal(dict(receipt), signing_key())


def new_run_id(clock: Clock, rng: random.Random) -> str:
    """A run id: the UTC start second, then 8 hex digits from `rng`."""
    stamp = utc_iso(clock, "seconds").replace("-", "").replace(":", "").rstrip("Z")
    return f"{stamp}-{rng.getrandbits(32):08x}"


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ReceiptError(f"run id {run_id!r} is not a valid run id")
    return run_id


def state_dir_for(workspace_root: Path, state_dir: str | os.PathLike[str] | None) -> Path:
    """The state folder: the one given, else the workspace's folder under XDG_STATE_HOME."""
    return Path(state_dir) if state_dir else state_root(workspace_root)


def receipt_path(state_dir: Path, run_id: str) -> Path:
    return state_dir / "runs" / check_run_id(run_id) / "receipt.json"


def read_receipt(
    workspace_root: str | os.PathLike[str], state_dir: str | os.PathLike[str] | None, run_id: str
) -> dict[str, Any]:
    """Load a run's receipt, trusting it only if its seal matches.

    Raises ReceiptError (a ValueError) when it is missing, unreadable or its seal does not
    match, and LegacyReceiptError when it predates checkpoints (no `fingerprint_version`).
    """
    path = receipt_path(state_dir_for(Path(workspace_root), state_dir), run_id)
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
    key = signing_key()
    recorded = receipt.get("seal")
    signed = isinstance(recorded, str) and recorded.startswith("hmac-")
    if key is not None and not signed:
        raise ReceiptError(
            f"receipt of run {run_id!r} at {path} is not signed, and a signing key is "
            f"configured ({KEY_ENV}/{KEY_FILE_ENV}): it is refused; anyone who can write the "
            "state directory could have written it"
        )
    if key is None and signed:
        raise ReceiptError(
            f"receipt of run {run_id!r} at {path} is signed, but no signing key is configured: "
            f"set {KEY_ENV} or {KEY_FILE_ENV} to verify it"
        )
    if key is not None and not verify_seal(receipt, key):
        raise ReceiptError(
            f"receipt of run {run_id!r} at {path} does not match its signature under the "
            "configured key: it was altered, or signed with another key, and is not trusted"
        )
    if key is None and not verify_seal(receipt):
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


def latest_run_id(workspace_root: Path, state_dir: Path) -> str:
    """The most recently started run that finished (any status but `running`) and whose
    receipt is trusted: what `--resume latest` resumes from."""
    runs_dir = state_dir / "runs"
    best: tuple[str, str] | None = None
    for child in runs_dir.iterdir() if runs_dir.is_dir() else []:
        try:
            receipt = read_receipt(workspace_root, state_dir, child.name)
        except ReceiptError:
            continue
        if receipt.get("status") == "running":
            continue
        stamp = (str(receipt.get("started_at") or ""), child.name)
        if best is None or stamp > best:
            best = stamp
    if best is None:
        raise ReceiptError(
            f"--resume latest: no finished run with a trusted receipt in {runs_dir}; "
            "run without --resume first"
        )
    return best[1]


def blank_record(stage: Mapping[str, Any]) -> dict[str, Any]:
    """A stage's record before it starts."""
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


class ReceiptBook:
    """One run's header and stage records, and the writes of its receipt (any thread)."""

    def __init__(
        self,
        *,
        header: dict[str, Any],
        records: list[dict[str, Any]],
        path: Path,
        writer: ReceiptWriter,
    ) -> None:
        self.header = header
        self.order = [r["id"] for r in records]
        self.records = {r["id"]: r for r in records}
        self.path = path
        self._writer = writer
        self._state = threading.Lock()
        self._writing = threading.Lock()
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

    def status(self, sid: str) -> str:
        """A stage's status right now (one dict read: no lock needed)."""
        return str(self.records[sid]["status"])

    def record(self, sid: str) -> dict[str, Any]:
        with self._state:
            return dict(self.records[sid])

    def all_records(self) -> list[dict[str, Any]]:
        with self._state:
            return [dict(self.records[sid]) for sid in self.order]

    def sealed(self) -> dict[str, Any]:
        """The receipt as it stands, sealed."""
        with self._state:
            return seal_receipt(self._payload(None))

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
        with self._writing:
            self._write_locked(override)

    def try_flush(self) -> None:
        """Write pending changes unless another thread is writing (it will pick them up)."""
        if not self._dirty:
            return
        if not self._writing.acquire(blocking=False):
            return
        try:
            with contextlib.suppress(Exception):
                self._write_locked(None)
        finally:
            self._writing.release()

    def _write_locked(self, override: tuple[str, dict[str, Any]] | None) -> None:
        while True:
            with self._state:
                self._dirty = False
                payload = self._payload(override)
            try:
                self._writer(self.path, seal_receipt(payload))
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
