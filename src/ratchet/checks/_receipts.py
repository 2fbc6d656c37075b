"""Receipts: where a run's receipt lives, how it is sealed, read back, and kept while it runs.

A receipt is trusted only when its seal matches. While a run goes, `ReceiptBook` holds its
records in memory. The whole receipt (`receipt.json`) is written twice, atomically: when the
run starts (every stage pending) and when it ends. In between, each change of state is one
record appended to the run's **receipt journal** (`receipt.journal`) and fsync'd: a line of
canonical JSON naming its sequence number and the seal of the record before it, sealed (or
signed) itself. While `receipt.json` says `running`, the receipt is that file with the
journal folded over it; a torn last record (a crash mid-append) is ignored, so what it held
counts as not done. Appending one record per stage keeps a run linear in its stages, where
rewriting the whole receipt after every stage was quadratic.

A checkpoint counts only once the append (or write) holding it has returned, so a failing
writer can never make one trusted. The one exception is a *kept* record (`ReceiptBook.keep`,
a reused checkpoint): it counts in this process at once and reaches disk with the next
append or write, which comes before any stage command starts and at the end of the
schedule; a crash before then loses it, so the stage counts as not done, which costs the
next run one re-verification and never trusts anything unverified. A no-op resume of N
stages thus makes one append (one fsync), not N.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from ratchet._clock import utc_iso
from ratchet.checks._decide import CHECKPOINT_VERSION, FINGERPRINT_VERSION
from ratchet.checks._errors import LegacyReceiptError, ReceiptError
from ratchet.checks._signing import KEY_ENV, KEY_FILE_ENV, signing_key
from ratchet.checks.common import read_json, state_root
from ratchet.store import canonical_json, seal, verify_seal
from ratchet.store._files import fsync_dir

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

    from ratchet._clock import Clock

__all__ = [
    "JOURNAL_NAME",
    "JournalAppender",
    "ReceiptBook",
    "ReceiptWriter",
    "blank_record",
    "check_run_id",
    "append_record",
    "journal_path",
    "latest_run_id",
    "new_run_id",
    "read_receipt",
    "receipt_path",
    "seal_receipt",
    "state_dir_for",
]

# Writes a JSON payload to a path atomically: readers see the old file or the new one.
ReceiptWriter = Callable[[Path, "dict[str, Any]"], None]  # a string: `Any` is not imported
# Appends one journal record (a line of bytes) to a path durably: when it returns, the record
# is on disk; when it raises, the file holds no part of it (or, after a crash, a torn end
# that readers ignore).
JournalAppender = Callable[[Path, bytes], None]

JOURNAL_NAME = "receipt.journal"
JOURNAL_VERSION = 1

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


def journal_path(receipt: Path) -> Path:
    """The receipt journal beside a receipt."""
    return receipt.with_name(JOURNAL_NAME)


def append_record(path: Path, line: bytes) -> None:
    """Append one record to a journal and fsync it (the folder too, when the file is new).

    If the write or the fsync fails, the file is cut back to its length before, so a later
    record never follows a partial one; the error is raised.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        before = os.fstat(fd).st_size
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)
                os.fsync(fd)
            raise
    finally:
        os.close(fd)
    if before == 0:
        fsync_dir(path.parent)


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
    # A seal proves who wrote a receipt, not which run folder it belongs in: another run's
    # genuine receipt copied here would otherwise pass for this run.
    _check_belongs(receipt, run_id, path)
    if receipt["fingerprint_version"] != FINGERPRINT_VERSION:
        raise LegacyReceiptError(
            f"receipt of run {run_id!r} has fingerprint_version "
            f"{receipt['fingerprint_version']!r}; this ratchet computes version "
            f"{FINGERPRINT_VERSION}, so it grants no reuse; run without --resume"
        )
    if receipt.get("status") == "running":
        # In flight, or crashed: what happened since the start is in the journal.
        return _fold_journal(receipt, journal_path(path), run_id, key)
    return receipt


def _check_belongs(receipt: Mapping[str, Any], run_id: str, path: Path) -> None:
    """Raise ReceiptError unless the receipt names the run whose folder it was read from.

    `receipt_path` is compared by its run folder only: a state folder may be moved."""
    recorded = receipt.get("run_id")
    where = receipt.get("receipt_path")
    folder = Path(where).parent.name if isinstance(where, str) and where else run_id
    if recorded != run_id or folder != run_id:
        other = recorded if recorded != run_id else folder
        raise ReceiptError(
            f"receipt at {path} is the receipt of run {other!r}, not of run {run_id!r} whose "
            "folder holds it: it was copied or moved there and is not trusted; resume from "
            f"run {other!r} itself, or run without --resume"
        )


def _fold_journal(
    base: dict[str, Any], path: Path, run_id: str, key: bytes | None
) -> dict[str, Any]:
    """`base` (the receipt written when the run started) with the journal's records applied
    in order, resealed. Each record must carry the next sequence number and the seal of the
    record before it (the first: the base's seal), and verify under `key` as receipts do.
    A last record that fails (a torn append) is ignored; an earlier one makes the whole
    receipt untrusted."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return base
    except OSError as exc:
        raise ReceiptError(f"receipt journal of run {run_id!r} is unreadable: {exc}") from exc
    header = {k: v for k, v in base.items() if k not in ("stages", "seal")}
    stages = [dict(r) for r in base.get("stages") or [] if isinstance(r, dict)]
    index = {r.get("id"): i for i, r in enumerate(stages)}
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    prev = base.get("seal")
    for number, line in enumerate(lines, start=1):
        problem = _journal_problem(line, number, prev, run_id, key, index)
        if problem is not None:
            if number == len(lines):
                break  # torn by a crash mid-append: that change never happened
            raise ReceiptError(
                f"receipt journal of run {run_id!r} at {path}: record {number} {problem}; "
                "the journal was altered or corrupted and the receipt is not trusted"
            )
        record = json.loads(line)
        header.update(record.get("header") or {})
        for rec in record["stages"]:
            stages[index[rec["id"]]] = rec
        prev = record["seal"]
    return seal({**header, "stages": stages}, key)


def _journal_problem(
    line: bytes,
    number: int,
    prev: Any,
    run_id: str,
    key: bytes | None,
    index: Mapping[Any, int],
) -> str | None:
    """Why a journal line is not the record expected next, or None."""
    try:
        record = json.loads(line)
    except ValueError:
        return "is not JSON"
    if not isinstance(record, dict):
        return "is not a JSON object"
    if not verify_seal(record, key):
        return "does not match its " + ("signature" if key is not None else "seal")
    if record.get("run_id") != run_id or record.get("seq") != number:
        return "is out of sequence"
    if record.get("prev") != prev:
        return "does not follow the record before it"
    recs = record.get("stages")
    if not isinstance(recs, list) or any(
        not isinstance(r, dict) or r.get("id") not in index for r in recs
    ):
        return "names a stage the run does not have"
    if not isinstance(record.get("header") or {}, dict):
        return "has a header that is not an object"
    return None


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
    """One run's header and stage records, and the writes of its receipt (any thread).

    With a `journal` appender, the first `persist` writes the whole receipt (the base), every
    later one appends a record of what changed since, and `write_receipt` writes the whole
    receipt again (the end of the run). Without one, every `persist` rewrites the whole
    receipt through `writer` (the older behaviour, which fault-injecting writers rely on).
    """

    def __init__(
        self,
        *,
        header: dict[str, Any],
        records: list[dict[str, Any]],
        path: Path,
        writer: ReceiptWriter,
        journal: JournalAppender | None = None,
    ) -> None:
        self.header = header
        self.order = [r["id"] for r in records]
        self.records = {r["id"]: r for r in records}
        self.path = path
        self._writer = writer
        self._journal = journal
        self._key = signing_key()
        self._state = threading.Lock()
        self._writing = threading.Lock()
        self._dirty_ids: set[str] = set()
        self._kept_ids: set[str] = set()  # dirty too, but left for the next blocking write
        self._dirty_header = False
        self._seq = 0
        self._prev: str | None = None  # the seal the next journal record follows

    @property
    def run_id(self) -> str:
        return str(self.header["run_id"])

    @property
    def _dirty(self) -> bool:
        """Changes that `try_flush` writes (kept records wait for a blocking write)."""
        return self._dirty_header or bool(self._dirty_ids)

    def _take_dirty(self) -> tuple[set[str], bool]:
        """Everything not yet written, kept records included (with `_state` held)."""
        dirty = (self._dirty_ids | self._kept_ids, self._dirty_header)
        self._dirty_ids, self._kept_ids, self._dirty_header = set(), set(), False
        return dirty

    # state --------------------------------------------------------------------------
    def update(self, sid: str, **fields: Any) -> None:
        with self._state:
            self.records[sid].update(fields)
            self._dirty_ids.add(sid)

    def set_header(self, **fields: Any) -> None:
        with self._state:
            self.header.update(fields)
            self._dirty_header = True

    def keep(self, sid: str, rec: dict[str, Any]) -> None:
        """Make `rec` a stage's record now, leaving its write to the next blocking one.

        For a record whose loss in a crash costs only re-deriving it (a reused checkpoint,
        which the next run verifies again): it counts in this process at once, and reaches
        disk with the next `persist` (every stage command is preceded by one, so no command
        runs on a checkpoint that is not on disk), `settle` or `write_receipt`; `try_flush`
        leaves it alone. Without a journal this is `persist(override=...)`, as every change
        of state is then a whole write. Raises only as `persist` does."""
        if self._journal is None or self._prev is None:
            self.persist(override=(sid, rec))
            return
        with self._state:
            self.records[sid] = dict(rec)
            self._kept_ids.add(sid)

    def settle(self) -> None:
        """Write the records `keep` left pending, if any (one append); raises if it fails."""
        with self._state:
            pending = bool(self._kept_ids)
        if pending:
            self.persist()

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
            return seal(self._payload(None), self._key)

    def _payload(self, override: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
        stages = []
        for sid in self.order:
            rec = override[1] if override is not None and override[0] == sid else self.records[sid]
            stages.append(dict(rec))
        return {**self.header, "stages": stages}

    # persistence ----------------------------------------------------------------------
    def persist(self, override: tuple[str, dict[str, Any]] | None = None) -> None:
        """Make the receipt's pending changes durable now (blocking); with `override`, that
        record becomes visible to everyone only once it is on disk. Raises if the write
        fails."""
        with self._writing:
            if self._journal is None or self._prev is None:
                self._write_whole_locked(override)
            else:
                self._append_locked(override)

    def write_receipt(self) -> None:
        """Write the whole receipt now (the end of a run): readers no longer need the
        journal, which is then removed. Raises if the write fails."""
        with self._writing:
            self._write_whole_locked(None)
            if self._journal is not None:
                with contextlib.suppress(OSError):
                    journal_path(self.path).unlink(missing_ok=True)

    def try_flush(self) -> None:
        """Write pending changes unless another thread is writing (it will pick them up)."""
        if not self._dirty:
            return
        if not self._writing.acquire(blocking=False):
            return
        try:
            with contextlib.suppress(Exception):
                if self._journal is None or self._prev is None:
                    self._write_whole_locked(None)
                else:
                    self._append_locked(None)
        finally:
            self._writing.release()

    def _write_whole_locked(self, override: tuple[str, dict[str, Any]] | None) -> None:
        while True:
            with self._state:
                dirty = self._take_dirty()
                payload = self._payload(override)
            try:
                sealed = seal(payload, self._key)
                self._writer(self.path, sealed)
            except BaseException:
                self._mark_dirty(dirty)
                raise
            with self._state:
                if self._journal is not None and self._prev is None:
                    self._prev = sealed["seal"]  # the journal's first record follows it
                if override is not None:
                    self.records[override[0]] = dict(override[1])
                    override = None
                if not self._dirty:
                    return

    def _append_locked(self, override: tuple[str, dict[str, Any]] | None) -> None:
        assert self._journal is not None
        while True:
            with self._state:
                dirty = self._take_dirty()
                ids = set(dirty[0])
                if override is not None:
                    ids.add(override[0])
                stages = [
                    dict(override[1] if override is not None and override[0] == sid else rec)
                    for sid in self.order
                    if sid in ids
                    for rec in (self.records[sid],)
                ]
                record: dict[str, Any] = {
                    "journal_version": JOURNAL_VERSION,
                    "run_id": self.run_id,
                    "seq": self._seq + 1,
                    "prev": self._prev,
                    "stages": stages,
                }
                if dirty[1]:
                    record["header"] = dict(self.header)
            try:
                sealed = seal(record, self._key)
                self._journal(journal_path(self.path), canonical_json(sealed) + b"\n")
            except BaseException:
                self._mark_dirty(dirty)
                raise
            with self._state:
                self._seq += 1
                self._prev = sealed["seal"]
                if override is not None:
                    self.records[override[0]] = dict(override[1])
                    override = None
                if not self._dirty:
                    return

    def _mark_dirty(self, dirty: tuple[set[str], bool]) -> None:
        with self._state:
            self._dirty_ids |= dirty[0]
            self._dirty_header = self._dirty_header or dirty[1]
