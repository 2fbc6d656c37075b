"""Small helpers shared by the checks runner: JSON files, resource locks, the state root."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from ratchet._errors import InvalidArgumentError
from ratchet.store import atomic_write_bytes
from ratchet.store import read_json as _store_read_json
from ratchet.store._digest import sha256_hex

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "LOCK_DIR_ENV",
    "LOCK_SCOPE_ENV",
    "atomic_json",
    "machine_lock_dir",
    "printable",
    "read_json",
    "readable_json",
    "resource_lock",
    "safe_file_name",
    "scope_lock_dir",
    "state_root",
]

# Where the machine-wide resource locks live, and which project's locks a run takes.
LOCK_DIR_ENV = "RATCHET_CHECKS_LOCK_DIR"
LOCK_SCOPE_ENV = "RATCHET_CHECKS_LOCK_SCOPE"

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")

# flock() conflicts between two open file descriptions even in one process, but a set of
# held names makes the in-process case independent of the platform's lock semantics.
_HELD: set[str] = set()
_HELD_GUARD = threading.Lock()


def printable(text: str) -> str:
    """`text` for a terminal: each character that is not printable (ESC, a newline, a bidi
    override) escaped as `repr` writes it (`\\x1b`, `\\n`), so a check id or file name
    cannot colour the terminal, move its cursor or split a line of a table."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def atomic_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Write JSON atomically: readers see the old file or the whole new one, never a mix."""
    atomic_write_bytes(path, readable_json(payload))


def readable_json(payload: Any, *, ensure_ascii: bool = False) -> bytes:
    """JSON with one top-level key per line and one item of a top-level list (a receipt's
    stages) per line: as easy to read and diff as an indented file, but made by the C
    encoder (`indent` makes `json` fall back to pure Python, several times slower, which
    a no-op run of 500 stages pays twice)."""

    def _one_line(value: Any) -> str:
        return json.dumps(value, sort_keys=True, ensure_ascii=ensure_ascii)

    if not isinstance(payload, dict) or not payload:
        return (_one_line(payload) + "\n").encode("utf-8")
    lines = []
    for key in sorted(payload):
        value = payload[key]
        if isinstance(value, list) and value:
            items = ",\n".join("    " + _one_line(item) for item in value)
            text = f"[\n{items}\n  ]"
        else:
            text = _one_line(value)
        lines.append(f"  {_one_line(str(key))}: {text}")
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode("utf-8")


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
    digest = sha256_hex(str(resolved).encode("utf-8"))[:16]
    label = _SAFE_NAME.sub("_", resolved.name) or "root"
    return Path(base) / "ratchet" / "checks" / f"{label}-{digest}"


def machine_lock_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The folder of resource locks every clone of a workspace on this machine shares.

    `override` (`--lock-dir`), else ``$RATCHET_CHECKS_LOCK_DIR``, else
    ``$XDG_RUNTIME_DIR/ratchet/checks-locks`` (a per-user folder on most Linux systems),
    else ``ratchet-checks-locks-<uid>`` in ``$TMPDIR`` (default ``/tmp``). Unlike the state
    folder it does not depend on the workspace's path, which is what makes two clones (two
    worktrees, two checkouts) exclude each other. The default folder in a shared temporary
    directory must be a real folder owned by this user, so no one else can pre-create it
    and hold or replace the locks: InvalidArgumentError otherwise.
    """
    chosen = override or os.environ.get(LOCK_DIR_ENV)
    if chosen:
        return Path(chosen)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return Path(runtime) / "ratchet" / "checks-locks"
    path = Path(os.environ.get("TMPDIR") or "/tmp") / f"ratchet-checks-locks-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise InvalidArgumentError(
            f"resource lock folder {path} is not a folder that only you can write (someone "
            f"else may hold or replace its locks); choose one with --lock-dir DIR or "
            f"{LOCK_DIR_ENV}"
        )
    return path


def scope_lock_dir(lock_dir: str | os.PathLike[str], scope: str) -> Path:
    """The folder of one project's resource locks inside `lock_dir`: runs of the same
    project (by default its project file's `name`, the same in every clone) exclude each
    other on a resource name; unrelated projects on the machine do not."""
    if not scope or not isinstance(scope, str):
        raise InvalidArgumentError(f"lock scope must be a non-empty string, got {scope!r}")
    digest = sha256_hex(scope.encode("utf-8", "surrogateescape"))[:16]
    return Path(lock_dir) / f"{_SAFE_NAME.sub('_', scope)[:64]}-{digest}"


# The most characters of a user's name (a check id, a resource) a file name keeps: file
# systems take 255 bytes, and a longer name failed its stage with "File name too long".
NAME_CAP = 64


def safe_file_name(name: str, suffix: str) -> str:
    """`name` as a file name ending in `suffix`. Characters other than `A-Za-z0-9._-`
    become `_`; a name changed that way, or longer than `NAME_CAP`, keeps its first
    `NAME_CAP` characters and gets a short digest of the whole name (`../x` ->
    `.._x-d6b96a97.log`), so two names do not share a file and none is too long."""
    safe = _SAFE_NAME.sub("_", name)
    if safe != name or len(safe) > NAME_CAP:
        digest = sha256_hex(name.encode("utf-8", "surrogatepass"))[:8]
        safe = f"{safe[:NAME_CAP]}-{digest}"
    return safe + suffix


def _lock_file_name(name: str) -> str:
    if not name or not isinstance(name, str):
        raise InvalidArgumentError(f"resource name must be a non-empty string, got {name!r}")
    return safe_file_name(name, ".lock")


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
