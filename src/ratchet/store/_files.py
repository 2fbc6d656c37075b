"""Atomic file writes, content hashes and seals, shared by the agent store and `checks`."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

from ratchet._errors import CorruptDataError, StateWriteError
from ratchet.store._digest import compare_digest, hmac_sha256_hex, sha256, sha256_hex

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

SEAL_FIELD = "seal"
SEAL_ALGORITHM = "sha256"


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# A disk (or a quota, or a file size limit) with no room left for the write.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_CHECK_DISK = (
    "check the disk holding {} (free space, quotas, a file size limit such as `ulimit -f`, I/O "
    "errors in the system log)"
)


def disk_fault(exc: BaseException) -> str | None:
    """'full' if `exc` says a disk had no room for a write (SQLITE_FULL; ENOSPC, EDQUOT, EFBIG),
    'io' if it failed an I/O operation (SQLITE_IOERR and its extended codes, which a file size
    limit also gives; EIO), else None. Neither damages a SQLite database (a failed write is
    rolled back), so neither may be reported as damage, whose advice is to restore a backup."""
    name = getattr(exc, "sqlite_errorname", None)
    if isinstance(name, str):
        if name == "SQLITE_FULL":
            return "full"
        return "io" if name.startswith("SQLITE_IOERR") else None
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.errno in _FULL_ERRNOS:
            return "full"
        return "io" if exc.errno == errno.EIO else None
    return None


def state_write_error(
    state_dir: str | os.PathLike[str], exc: BaseException, doing: str = "written"
) -> StateWriteError | None:
    """The one line for a state directory whose disk is full or failed (`disk_fault`), naming
    the directory and the fix: the disk's, then the same command. None for any other error."""
    kind = disk_fault(exc)
    if kind is None:
        return None
    kept = "a write that fails is rolled back, so nothing committed is lost"
    named = f"the state directory {state_dir}".rstrip()  # "": a command's that is not known
    if kind == "full":
        return StateWriteError(
            f"the disk holding {named} is full ({exc})",
            f"free space there (or lift the quota or file size limit in the way) and run the "
            f"same command again; {kept}",
            state_dir=str(state_dir),
            disk_full=True,
        )
    return StateWriteError(
        f"{named} could not be {doing} ({exc})",
        f"{_CHECK_DISK.format('it')} and run the same command again; {kept}",
        state_dir=str(state_dir),
        disk_full=False,
    )


def resume_after(exc: BaseException) -> tuple[str, str]:
    """(what failed, what to do) for a job stopped by writes of its state that failed with
    `exc` (the last completed checkpoint is intact): a full disk needs room before the same
    command can resume, which a plain "restart" would not say."""
    resume = "then run the same command to resume from it (nothing committed is lost)"
    if isinstance(exc, StateWriteError):
        if exc.disk_full:
            return exc.problem, f"free space there, {resume}"
        return exc.problem, f"{_CHECK_DISK.format('the state')}, {resume}"
    what = f"{type(exc).__name__}: {exc}"
    kind = disk_fault(exc)
    where = getattr(exc, "filename", None) or "the state"
    if kind == "full":
        return what, f"free space on the disk holding {where}, {resume}"
    if kind == "io":
        return what, f"{_CHECK_DISK.format(where)}, {resume}"
    return what, "restart to resume from it"


_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def _temp_beside(target: Path) -> tuple[int, str]:
    """A new file next to `target`, private to its creator (what `tempfile.mkstemp` does,
    without importing `tempfile`, `shutil` and `random` at every command's start-up)."""
    for _ in range(100):
        tmp = str(target.parent / f".{target.name}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(tmp, _TEMP_FLAGS, 0o600), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file beside {target}")


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` so that readers see either the old file or the whole new one, never a mix.

    The bytes go to a temporary file in the same directory, are fsynced, and replace the
    target with a rename; a failure at any step leaves the previous file intact.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(target)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def canonical_json(payload: Any) -> bytes:
    """One byte string per value: sorted keys, no whitespace, UTF-8, no NaN."""
    return json.dumps(
        payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def atomic_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Atomically write `payload` as indented JSON (readable by people, stable for diffs)."""
    data = json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, data.encode("utf-8"))


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file; a broken file raises ValueError naming the path."""
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CorruptDataError(f"{p}: not valid JSON ({exc})") from exc


def sha256_bytes(data: bytes) -> str:
    return sha256_hex(data)


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hash a file's bytes in chunks, so large logs do not load into memory."""
    with open(path, "rb") as handle:
        digest = sha256(size=os.fstat(handle.fileno()).st_size)  # a small log: no OpenSSL
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def compute_seal(payload: dict[str, Any], key: bytes | None = None) -> str:
    """The seal of a dict: a digest of its canonical JSON without the seal field itself.

    Without a key it is a plain SHA-256 (detects corruption and edits by anyone who does not
    recompute it); with a key it is an HMAC, so only a holder of the key can forge one.
    """
    body = {k: v for k, v in payload.items() if k != SEAL_FIELD}
    data = canonical_json(body)
    if key is None:
        return f"{SEAL_ALGORITHM}:{sha256_hex(data)}"
    return f"hmac-{SEAL_ALGORITHM}:{hmac_sha256_hex(key, data)}"


def seal(payload: dict[str, Any], key: bytes | None = None) -> dict[str, Any]:
    """Return a copy of `payload` with its seal set."""
    sealed = {k: v for k, v in payload.items() if k != SEAL_FIELD}
    sealed[SEAL_FIELD] = compute_seal(sealed, key)
    return sealed


def verify_seal(payload: dict[str, Any], key: bytes | None = None) -> bool:
    """True only if the payload carries a seal and it matches its content."""
    recorded = payload.get(SEAL_FIELD)
    if not isinstance(recorded, str):
        return False
    return compare_digest(recorded, compute_seal(payload, key))
