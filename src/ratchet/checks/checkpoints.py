"""Input identities: what a stage's declared inputs are, byte for byte, right now.

A repository's identity is the digest of its manifest (every non-ignored file's path and
content hash, as git lists them: tracked plus untracked, minus ignored). A stage's
identity maps each repository in its declared scope to that digest. Nothing is trusted
from timestamps: every fresh probe re-reads the bytes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet.checks._errors import ProjectError
from ratchet.store import atomic_write_bytes, canonical_json, sha256_bytes, sha256_file

__all__ = ["Checkpoints", "diff_manifests"]

# A memoised repository digest is reused only while no stage command runs or has run since,
# and only briefly; the end-of-run snapshot always starts fresh.
MEMO_MAX_AGE_SECONDS = 1.0
MISSING_REPOSITORY = "missing-repository"


def _git_files(root: Path) -> list[str] | None:
    proc = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        return None
    names = {n for n in proc.stdout.decode("utf-8", "surrogateescape").split("\0") if n}
    return sorted(names)


def _walk_files(root: Path, exclude: tuple[Path, ...]) -> list[str]:
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if d != ".git" and not any((here / d) == e for e in exclude)
        )
        for f in filenames:
            out.append((here / f).relative_to(root).as_posix())
    return sorted(out)


_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _entry(path: str) -> str:
    """One file's identity: its content hash (and exec bit), a link target, or a marker."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink: its target is its content
            return "link:" + os.readlink(path)
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return "dir"
        if not stat.S_ISREG(st.st_mode):
            return f"special:{stat.S_IFMT(st.st_mode):o}"
        digest = hashlib.sha256()
        size = st.st_size + 1
        while chunk := os.read(fd, size if size < (1 << 20) else (1 << 20)):
            digest.update(chunk)
    finally:
        os.close(fd)
    prefix = "x:" if st.st_mode & stat.S_IXUSR else ""
    return f"{prefix}sha256:{digest.hexdigest()}"


def diff_manifests(old: Mapping[str, str], new: Mapping[str, str]) -> list[dict[str, str]]:
    """The files that differ between two manifests: added, removed or modified."""
    changes = []
    for path in sorted(set(old) | set(new)):
        if path not in old:
            changes.append({"path": path, "change": "added"})
        elif path not in new:
            changes.append({"path": path, "change": "removed"})
        elif old[path] != new[path]:
            changes.append({"path": path, "change": "modified"})
    return changes


class Checkpoints:
    """Probes stages' declared inputs and logs; the runner calls `identity` around each
    execution. `clock` only ages the short-lived memo of repository digests."""

    def __init__(
        self,
        workspace_root: str | os.PathLike[str],
        repositories: Mapping[str, str | os.PathLike[str]],
        state_dir: str | os.PathLike[str] | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.workspace_root = Path(workspace_root)
        self.clock = clock
        self.repositories = {name: Path(p) for name, p in repositories.items()}
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self._exclude = (self.state_dir,) if self.state_dir is not None else ()
        self._guard = threading.Lock()
        self._epoch = 0
        self._active = 0
        self._memo: dict[str, tuple[int, float, str]] = {}

    # --- what the runner tells us -------------------------------------------------------
    def command_started(self) -> None:
        """A stage command starts: nothing probed before may be reused from memory."""
        with self._guard:
            self._active += 1
            self._epoch += 1

    def command_finished(self) -> None:
        with self._guard:
            self._active -= 1
            self._epoch += 1

    def forget(self) -> None:
        """Drop every memoised digest, so the next probe re-reads all bytes."""
        with self._guard:
            self._memo.clear()
            self._epoch += 1

    # --- probes -------------------------------------------------------------------------
    def scope(self, stage: Mapping[str, Any]) -> list[str]:
        """The repository names a stage declares as inputs (absent = the whole workspace)."""
        inputs = stage.get("inputs")
        if inputs is None:
            return sorted(self.repositories)
        names = list(inputs.get("repos") or [])
        for name in names:
            if name not in self.repositories:
                raise ProjectError(
                    f"stage {stage.get('id')!r}: inputs.repos names unknown repository {name!r}"
                )
        return sorted(names)

    def identity(self, stage: Mapping[str, Any]) -> dict[str, str]:
        """The stage's input identity: repository name -> digest of its files' bytes."""
        return {name: self.repository_digest(name) for name in self.scope(stage)}

    def snapshot_identity(self, stage: Mapping[str, Any]) -> dict[str, str]:
        """The same as `identity`, for the end-of-run snapshot (counted apart from probes)."""
        return {name: self.repository_digest(name) for name in self.scope(stage)}

    def source_identity(self) -> dict[str, str]:
        """Every repository's digest: the whole workspace."""
        return {name: self.repository_digest(name) for name in sorted(self.repositories)}

    def log_digest(self, path: str | os.PathLike[str]) -> str:
        """A log's SHA-256, read afresh (OSError, e.g. FileNotFoundError, when it cannot be)."""
        return sha256_file(path)

    def repository_digest(self, name: str) -> str:
        with self._guard:
            epoch, quiet = self._epoch, self._active == 0
            hit = self._memo.get(name)
            if (
                hit is not None
                and quiet
                and hit[0] == epoch
                and self.clock.monotonic() - hit[1] < MEMO_MAX_AGE_SECONDS
            ):
                return hit[2]
        digest, manifest = self._compute(name)
        self._store_manifest(digest, manifest)
        with self._guard:
            if quiet and self._active == 0 and self._epoch == epoch:
                self._memo[name] = (epoch, self.clock.monotonic(), digest)
        return digest

    def manifest(self, name: str) -> dict[str, str]:
        """A repository's current manifest: relative path -> file identity."""
        return self._compute(name)[1]

    def stored_manifest(self, digest: str) -> dict[str, str] | None:
        """A manifest recorded earlier by digest, or None when it was not kept."""
        if self.state_dir is None:
            return None
        path = self.state_dir / "manifests" / f"{digest}.json"
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if sha256_bytes(data) != digest:
            return None
        loaded = json.loads(data)
        return loaded if isinstance(loaded, dict) else None

    def _compute(self, name: str) -> tuple[str, dict[str, str]]:
        root = self.repositories[name]
        if not root.is_dir():
            return MISSING_REPOSITORY, {}
        files = _git_files(root)
        if files is None:
            files = _walk_files(root, self._exclude)
        base = str(root) + os.sep
        manifest = {rel: _entry(base + rel) for rel in files}
        return sha256_bytes(canonical_json(manifest)), manifest

    def _store_manifest(self, digest: str, manifest: dict[str, str]) -> None:
        # Kept only so `explain` can name changed files; content-addressed, written once.
        if self.state_dir is None or digest == MISSING_REPOSITORY:
            return
        path = self.state_dir / "manifests" / f"{digest}.json"
        if not path.exists():
            atomic_write_bytes(path, canonical_json(manifest))
