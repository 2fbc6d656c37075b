"""Small helpers shared by the checks runner: JSON files, resource locks, the state root."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ratchet._errors import InvalidArgumentError
from ratchet.store import atomic_json as _store_atomic_json
from ratchet.store import read_json as _store_read_json

__all__ = ["atomic_json", "read_json", "resource_lock", "state_root"]

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")

# flock() conflicts between two open file descriptions even in one process, but a set of
# held names makes the in-process case independent of the platform's lock semantics.
_HELD: set[str] = set()
_HELD_GUARD = threading.Lock()


def atomic_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Write JSON atomically: readers see the old file or the whole new one, never a mix."""
    _store_atomic_json(path, payload)


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file; a broken file raises ValueError naming the path."""
    return _store_read_json(path)


def state_root(workspace_root: str | os.PathLike[str]) -> Path:
    """The folder holding one workspace's runs, logs and locks.

    It lives under ``$XDG_STATE_HOME`` (default ``~/.local/state``), outside the workspace,
    so writing state never changes a stage's inputs. One folder per resolved workspace path.
    """
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    resolved = Path(workspace_root).resolve()
    digest = hashlib.sha256(str(resolved).encode("utf-8")).hexdigest()[:16]
    label = _SAFE_NAME.sub("_", resolved.name) or "root"
    return Path(base) / "ratchet" / "checks" / f"{label}-{digest}"


def _lock_file_name(name: str) -> str:
    if not name or not isinstance(name, str):
        raise InvalidArgumentError(f"resource name must be a non-empty string, got {name!r}")
    safe = _SAFE_NAME.sub("_", name)
    if safe != name:
        safe = f"{safe}-{hashlib.sha256(name.encode('utf-8')).hexdigest()[:8]}"
    return f"{safe}.lock"


@contextlib.contextmanager
def resource_lock(locks_dir: str | os.PathLike[str], name: str) -> Iterator[Path]:
    """Hold the exclusive lock `name` for the block, across processes and threads.

    It never waits: a lock already held (by another process, or even by this one) raises
    RuntimeError saying it is busy. The kernel drops the lock when its holder dies, so a
    `kill -9` never leaves a resource locked.
    """
    directory = Path(locks_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / _lock_file_name(name)
    key = str(path)
    with _HELD_GUARD:
        if key in _HELD:
            raise RuntimeError(f"resource {name!r} is busy (held by this process; lock {path})")
        _HELD.add(key)
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise RuntimeError(
                f"resource {name!r} is busy (held by another process; lock {path})"
            ) from exc
        try:
            yield path
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        if fd >= 0:
            os.close(fd)
        with _HELD_GUARD:
            _HELD.discard(key)
