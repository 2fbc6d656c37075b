"""The content-addressed cache: verified checkpoints stored by cache key.

An entry holds what a passed stage proved: its cache key, checkpoint id, exit code, the
digest of its log and of its declared outputs, and the run it came from. The log and the
output files are stored as blobs named by their SHA-256, so an entry does not depend on
the run folder that produced it. An entry is sealed like a receipt (signed under the
signing key when one is configured) and trusted only while its seal matches; its blobs are
re-hashed before every reuse. A damaged or missing entry is a miss: the stage runs.

The cache is a plain directory, so a folder every machine mounts is a shared cache. A
read-only cache (for jobs that must not be able to poison it) is read and never written.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from ratchet.checks._receipts import seal_receipt
from ratchet.checks._signing import signing_key
from ratchet.checks.checkpoints import declared_output
from ratchet.checks.common import atomic_json, read_json
from ratchet.store import sha256_file, verify_seal

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

    from ratchet._clock import Clock

__all__ = ["CACHE_VERSION", "CheckCache", "check_entry", "gc", "is_digest"]

CACHE_VERSION = 1
_HEX = set("0123456789abcdef")


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


class CheckCache:
    """One cache directory: `entries/<cache key>.json` and `blobs/<sha256>`."""

    def __init__(self, root: Path, *, read_only: bool = False) -> None:
        self.root = root
        self.read_only = read_only

    def abort(self) -> None:
        """The run was interrupted: end any request in flight at once (a cache server's;
        a directory cache has none)."""

    # --- paths --------------------------------------------------------------------------
    def entry_path(self, cache_key: str) -> Path:
        return self.root / "entries" / cache_key[:2] / f"{cache_key}.json"

    def blob_path(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256[:2] / sha256

    # --- reading ------------------------------------------------------------------------
    def lookup(self, cache_key: str) -> tuple[dict[str, Any] | None, str]:
        """The verified entry for `cache_key`, or None and why there is none."""
        if not _is_digest(cache_key):
            return None, "no cache key"
        path = self.entry_path(cache_key)
        try:
            entry = read_json(path)
        except FileNotFoundError:
            return None, "no cache entry"
        except (OSError, ValueError) as exc:
            return None, f"cache entry {path} is unreadable ({exc})"
        problem = check_entry(entry, cache_key, str(path))
        if problem is not None:
            return None, problem
        return self.check_log(entry, str(path))

    def check_log(self, entry: dict[str, Any], where: str) -> tuple[dict[str, Any] | None, str]:
        """`entry` if the log blob it names is here and hashes to its digest."""
        log_sha = str(entry["log_sha256"])
        blob = self.blob_path(log_sha)
        try:
            actual = sha256_file(blob)
        except OSError:
            return None, f"the cached log {blob} is missing"
        if actual != log_sha:
            return None, f"the cached log {blob} was altered"
        return entry, "hit"

    # --- raw writes (the cache server, and a remote cache's local mirror) ---------------
    def write_entry_bytes(self, cache_key: str, data: bytes) -> None:
        """Keep an entry's bytes as given; whoever reads it verifies it (`check_entry`)."""
        path = self.entry_path(cache_key)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, [data])

    def write_blob(self, sha256: str, chunks: Iterable[bytes]) -> bool:
        """Keep the bytes of `chunks` as blob `sha256` if they hash to it; False if not
        (nothing is kept)."""
        blob = self.blob_path(sha256)
        blob.parent.mkdir(parents=True, exist_ok=True)
        return _write_atomic(blob, chunks, sha256=sha256)

    def undeclared_output(
        self, workspace_root: Path, manifest: Mapping[str, str], patterns: list[str]
    ) -> str | None:
        """Why the manifest names a file the stage does not declare (or one reached through
        a link out of the workspace), or None: nothing else is ever written."""
        root = os.path.realpath(workspace_root)
        for rel in manifest:
            if not declared_output(rel, patterns):
                return f"it names {rel!r}, which is not among the stage's declared outputs"
            parent = os.path.realpath(workspace_root / rel.rstrip("/"), strict=False)
            if os.path.commonpath([root, os.path.dirname(parent)]) != root:
                return f"its output {rel!r} leads out of the workspace (through a link)"
        return None

    def restore_outputs(
        self, workspace_root: Path, manifest: Mapping[str, str], patterns: list[str]
    ) -> str | None:
        """Write the files of an outputs manifest from blobs, each a declared output of the
        stage (`patterns`); None, or why it cannot. A write that fails (a folder where a
        file goes, a full disk) is a reason too: what this restore wrote and the folders it
        made are removed again, and the stage runs."""
        plan, problem = self._restore_plan(workspace_root, manifest, patterns)
        if plan is None:
            return problem
        written: list[Path] = []
        made: list[Path] = []
        try:
            for target, sha, executable in plan:
                if not sha:
                    _make_dirs(target, made)
                    continue
                _make_dirs(target.parent, made)
                if target.is_symlink() or target.is_file():
                    target.unlink()
                _copy_atomic(self.blob_path(sha), target)
                written.append(target)
                os.chmod(target, 0o755 if executable else 0o644)
        except OSError as exc:
            for path in reversed(written):
                with contextlib.suppress(OSError):
                    path.unlink()
            for folder in reversed(made):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            return f"its outputs could not be restored ({exc})"
        return None

    def check_restore(
        self, workspace_root: Path, manifest: Mapping[str, str], patterns: list[str]
    ) -> str | None:
        """What `restore_outputs` would refuse, without writing anything (a dry run)."""
        return self._restore_plan(workspace_root, manifest, patterns)[1]

    def _restore_plan(
        self, workspace_root: Path, manifest: Mapping[str, str], patterns: list[str]
    ) -> tuple[list[tuple[Path, str, bool]] | None, str | None]:
        """(target, blob sha or "" for an empty folder, executable) per output, every blob
        re-hashed; or None and why the manifest cannot be restored."""
        problem = self.undeclared_output(workspace_root, manifest, patterns)
        if problem is not None:
            return None, problem
        plan: list[tuple[Path, str, bool]] = []
        for rel, ident in manifest.items():
            if rel.endswith(" [non-UTF-8 name]"):
                return None, f"output {rel} has a name the cache cannot restore"
            target = workspace_root / rel
            if rel.endswith("/") and ident == "dir:empty":
                plan.append((target, "", False))
                continue
            executable = ident.startswith("x:")
            body = ident[2:] if executable else ident
            if not body.startswith("sha256:"):
                kind = ident.split(":", 1)[0]
                return None, f"output {rel} ({kind}) cannot be restored from blobs"
            sha = body[len("sha256:") :]
            blob = self.blob_path(sha)
            try:
                if sha256_file(blob) != sha:
                    return None, f"the cached output {rel} was altered"
            except OSError:
                return None, f"the cached output {rel} is missing"
            plan.append((target, sha, executable))
        return plan, None

    # --- writing ------------------------------------------------------------------------
    def store(
        self,
        cache_key: str,
        record: Mapping[str, Any],
        *,
        workspace_root: Path,
        outputs: Mapping[str, str] | None,
        stage_id: str,
        clock: Clock,
    ) -> None:
        """Keep a verified checkpoint (and its log and output bytes) under its cache key."""
        if self.read_only or not _is_digest(cache_key):
            return
        log_sha = str(record["log_sha256"])
        self._put_blob(Path(record["log_path"]), log_sha)
        for rel, ident in (outputs or {}).items():
            body = ident[2:] if ident.startswith("x:") else ident
            if body.startswith("sha256:"):
                self._put_blob(workspace_root / rel, body[len("sha256:") :])
        entry = {
            "version": CACHE_VERSION,
            "cache_key": cache_key,
            "stage_id": stage_id,
            "checkpoint_id": record["checkpoint_id"],
            "exit_code": record.get("exit_code"),
            "log_sha256": log_sha,
            "outputs_digest": record.get("outputs_digest"),
            "outputs": dict(outputs) if outputs else None,
            "origin_run_id": record.get("origin_run_id"),
            "stored_at": clock.now(),
        }
        atomic_json(self.entry_path(cache_key), seal_receipt(entry))

    def _put_blob(self, source: Path, sha256: str) -> None:
        blob = self.blob_path(sha256)
        with contextlib.suppress(OSError):
            if sha256_file(blob) == sha256:
                return  # already there, intact (a damaged one is replaced below)
        blob.parent.mkdir(parents=True, exist_ok=True)
        _copy_atomic(source, blob)
        if sha256_file(blob) != sha256:  # the file changed under us: keep nothing
            blob.unlink()
            raise OSError(f"{source} changed while it was copied into the cache")


def check_entry(entry: Any, cache_key: str, where: str) -> str | None:
    """None if `entry` is a trustworthy entry for `cache_key` (its seal, or with a signing
    key its signature, matches; right key and version; a log digest), else why not."""
    if not isinstance(entry, dict):
        return f"cache entry {where} is not an object"
    key = signing_key()
    recorded = entry.get("seal")
    signed = isinstance(recorded, str) and recorded.startswith("hmac-")
    if key is not None and not signed:
        return f"cache entry {where} is not signed and a signing key is configured"
    if not verify_seal(entry, key) if key is not None else not verify_seal(entry):
        return f"cache entry {where} does not match its seal"
    if entry.get("cache_key") != cache_key or entry.get("version") != CACHE_VERSION:
        return f"cache entry {where} is for another key or version"
    if not _is_digest(entry.get("log_sha256")):
        return f"cache entry {where} has no log evidence"
    return None


def is_digest(value: Any) -> bool:
    """A SHA-256 hex digest (a cache key, a blob name)."""
    return _is_digest(value)


def _mkstemp(directory: Path) -> tuple[int, str]:
    # Imported here: a run that stores nothing in the cache never loads `tempfile`.
    import tempfile

    return tempfile.mkstemp(dir=directory, prefix=".tmp-")


def _write_atomic(target: Path, chunks: Iterable[bytes], *, sha256: str | None = None) -> bool:
    import hashlib  # here: a run that stores nothing in the cache does not load OpenSSL

    fd, tmp = _mkstemp(target.parent)
    try:
        hasher = hashlib.sha256()
        with os.fdopen(fd, "wb") as handle:
            for chunk in chunks:
                hasher.update(chunk)
                handle.write(chunk)
        if sha256 is not None and hasher.hexdigest() != sha256:
            os.unlink(tmp)
            return False
        os.replace(tmp, target)
        return True
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _make_dirs(folder: Path, made: list[Path]) -> None:
    """`folder.mkdir(parents=True, exist_ok=True)`, adding the folders it made to `made`
    (outermost first)."""
    missing: list[Path] = []
    at = folder
    while not os.path.lexists(at) and at != at.parent:
        missing.append(at)
        at = at.parent
    folder.mkdir(parents=True, exist_ok=True)
    made.extend(reversed(missing))


def _copy_atomic(source: Path, target: Path) -> None:
    import shutil

    fd, tmp = _mkstemp(target.parent)
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def gc(
    cache_root: Path,
    *,
    max_age_seconds: float,
    now: float,
    dry_run: bool = False,
    keep_blobs: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Drop entries stored more than `max_age_seconds` ago (and unreadable ones), then every
    blob no remaining entry names and `keep_blobs` (the logs kept runs reuse) does not
    name. Returns what was (or would be) removed."""
    entries_dir, blobs_dir = cache_root / "entries", cache_root / "blobs"
    removed_entries, kept_blobs = 0, set(keep_blobs)
    for path in sorted(entries_dir.glob("*/*.json")) if entries_dir.is_dir() else []:
        try:
            entry = read_json(path)
            stored = float(entry.get("stored_at"))
        except (OSError, ValueError, TypeError, AttributeError):
            entry, stored = None, float("-inf")
        if entry is None or now - stored > max_age_seconds:
            removed_entries += 1
            if not dry_run:
                path.unlink(missing_ok=True)
            continue
        kept_blobs.add(str(entry.get("log_sha256")))
        for ident in (entry.get("outputs") or {}).values():
            body = ident[2:] if str(ident).startswith("x:") else str(ident)
            if body.startswith("sha256:"):
                kept_blobs.add(body[len("sha256:") :])
    removed_blobs, freed = 0, 0
    for blob in sorted(blobs_dir.glob("*/*")) if blobs_dir.is_dir() else []:
        if blob.name in kept_blobs:
            continue
        removed_blobs += 1
        with contextlib.suppress(OSError):
            freed += blob.stat().st_size
            if not dry_run:
                blob.unlink()
    return {
        "removed_entries": removed_entries,
        "removed_blobs": removed_blobs,
        "freed_bytes": freed,
    }
