"""Input identities: what a stage's declared inputs are, byte for byte, right now.

A repository's identity is the digest of its manifest (every non-ignored file's path and
content hash, as git lists them: tracked plus untracked, minus ignored). A stage's
identity maps each repository in its declared scope to that digest. A file's bytes are
re-read unless `StatCache` holds its identity for exactly the same device, inode, size,
mtime_ns and ctime_ns, recorded when the file had been still for `RACY_SECONDS`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import json
import operator
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from ratchet._clock import SYSTEM_CLOCK
from ratchet.checks._errors import ProjectError
from ratchet.checks._spawn import Child, output_of
from ratchet.checks._threads import map_threads
from ratchet.store import (
    atomic_write_bytes,
    canonical_json,
    sha256_bytes,
    sha256_file,
)
from ratchet.store._digest import compare_digest, hmac_sha256_hex, sha256, sha256_hex

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any

    from ratchet._clock import Clock

__all__ = [
    "WORKSPACE_REST",
    "Checkpoints",
    "diff_manifests",
    "outputs_manifest",
    "open_stat_cache",
    "runtime_identity",
    "seal_stat_cache",
]

# A memoised repository digest is reused only while no stage command runs or has run since
# (one input snapshot per run while nothing writes); `forget` starts afresh.
MISSING_REPOSITORY = "missing-repository"
_NOT_LISTED: Any = object()
STAT_CACHE_VERSION = 2
RACY_SECONDS = 2.0
RUNTIME_INPUT_TIMEOUT_SECONDS = 120.0
# The pseudo-repository of a default-scope stage: workspace files outside every repository.
WORKSPACE_REST = "<workspace-root>"


def _ls_files_argv(root: Path) -> list[str]:
    return ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]


def _listing(returncode: int, stdout: bytes) -> list[str] | None:
    if returncode != 0:
        return None
    return _parse_listing(stdout)


def _parse_listing(stdout: bytes) -> list[str]:
    # Names are bytes; surrogateescape keeps a non-UTF-8 name openable (see `_key`).
    names = {n for n in stdout.decode("utf-8", "surrogateescape").split("\0") if n}
    return sorted(names)


def _git_files(root: Path) -> list[str] | None:
    return _listing(*output_of(_ls_files_argv(root)))


def _git_raw(root: Path) -> bytes | None:
    """`git ls-files`'s raw output for `root` (None when git cannot list it)."""
    returncode, stdout = output_of(_ls_files_argv(root))
    return stdout if returncode == 0 else None


def _start_listing(root: Path) -> Child:
    """`git ls-files` of `root`, started; `_finish_listing` collects it."""
    return Child(_ls_files_argv(root))


def _finish_listing(child: Child) -> bytes | None:
    try:
        returncode, stdout = child.output()
    except BaseException:
        child.stop()
        raise
    return stdout if returncode == 0 else None


def _walk_files(root: Path, exclude: tuple[Path, ...]) -> list[str]:
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if d != ".git" and not any((here / d) == e for e in exclude)
        )
        for f in filenames:
            out.append((here / f).relative_to(root).as_posix())
        if not filenames and not dirnames and here != root:
            out.append((here).relative_to(root).as_posix() + "/")  # an empty directory
    return sorted(out)


def _key(rel: str) -> str:
    """A manifest key for a relative path; a non-UTF-8 name (surrogate-escaped by the OS
    layer) becomes its bytes with backslash escapes and a marker, so JSON can hold it."""
    if rel.isascii():
        return rel
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raw = rel.encode("utf-8", "surrogateescape")
        return raw.decode("utf-8", "backslashreplace") + " [non-UTF-8 name]"
    return rel


_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _entry(path: str, root: str | None = None) -> str:
    """One file's identity: its content hash (and exec bit), a link target, or a marker.

    A symlink is identified by its target text while the target stays inside `root` (the
    target is then an input of its own); a link leaving `root` is followed and its
    target's bytes are hashed, since nothing else would notice them change.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except (FileNotFoundError, NotADirectoryError):  # no such path (or one through a file)
        return "missing"
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink: its target is its content
            return _link_entry(path, root)
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return "dir"
        if not stat.S_ISREG(st.st_mode):
            return f"special:{stat.S_IFMT(st.st_mode):o}"
        digest = sha256(size=st.st_size)
        size = st.st_size + 1
        while chunk := os.read(fd, size if size < (1 << 20) else (1 << 20)):
            digest.update(chunk)
    finally:
        os.close(fd)
    prefix = "x:" if st.st_mode & stat.S_IXUSR else ""
    return f"{prefix}sha256:{digest.hexdigest()}"


def _link_entry(path: str, root: str | None) -> str:
    target = os.readlink(path)
    label = "link:" + _key(target)
    if root is None:
        return label
    resolved = os.path.realpath(path)
    if _inside(resolved, os.path.realpath(root)):
        return label
    if os.path.isdir(resolved):
        tree = _manifest(Path(resolved), (), use_git=False)
        return f"{label}->tree:{sha256_bytes(canonical_json(tree))}"
    try:
        return f"{label}->{_entry(resolved)}"
    except OSError as exc:
        return f"{label}->unreadable:{exc.strerror or exc}"


def _skipped(root: Path, exclude: tuple[Path, ...]) -> list[str]:
    """The paths under `root` (relative, POSIX) that `exclude` leaves out."""
    skip = []
    for e in exclude:
        with contextlib.suppress(ValueError):
            skip.append(e.relative_to(root).as_posix())
    return [p for p in skip if p != "."]


def _manifest(
    root: Path,
    exclude: tuple[Path, ...],
    *,
    use_git: bool = True,
    depth: int = 0,
    entry_of: Callable[[str, str], str] | None = None,
    git_listing: tuple[list[str] | None] | None = None,
    entries_of: Callable[[list[str], str], list[str]] | None = None,
) -> dict[str, str]:
    """Relative path -> identity for every file under `root`.

    git lists the files when `root` is in a git work tree (ignored files are left out); a
    directory git lists as one entry (a submodule, a nested repository) is expanded with its
    own listing; when git lists nothing (the folder is ignored by an enclosing repository)
    or `root` is not in a work tree, every file is walked and hashed. `entries_of`
    identifies many files at once (the stat cache's fast path), else `entry_of` one by one.
    """
    files: list[str] | set[str] | None = None
    if git_listing is not None:  # `git ls-files` already ran (see `source_identity`)
        files = git_listing[0]
    elif use_git:
        files = _git_files(root)
    if not files:
        files = _walk_files(root, exclude)
    root_text = str(root)
    base = root_text + os.sep
    listed = set(files)
    identify = entry_of or _entry
    skip = _skipped(root, exclude)
    plain: list[str] = []
    dirs: list[str] = []
    for rel in files if isinstance(files, list) else sorted(listed):  # lists come sorted
        rel = rel.rstrip("/")
        if skip and any(rel == p or rel.startswith(p + "/") for p in skip):
            continue  # excluded (a repository of its own, the state folder): never read
        (dirs if rel + "/" in listed else plain).append(rel)
    fulls = [base + rel for rel in plain]
    if entries_of is not None:
        identities = entries_of(fulls, root_text)
    else:
        identities = [identify(full, root_text) for full in fulls]
    out: dict[str, str] = {}
    for rel, entry in zip(plain, identities, strict=True):
        if entry == "dir":
            dirs.append(rel)
        else:
            out[_key(rel)] = entry
    for rel in dirs:
        sub_root = Path(base + rel)
        if depth > 32 or any(sub_root == e for e in exclude):
            out[_key(rel) + "/"] = "dir"
            continue
        sub = _manifest(
            sub_root,
            exclude,
            use_git=use_git,
            depth=depth + 1,
            entry_of=entry_of,
            entries_of=entries_of,
        )
        if not sub:
            out[_key(rel) + "/"] = "dir:empty"
        for k, v in sub.items():
            out[_key(rel) + "/" + k] = v
    return out


class StatCache:
    """File identities remembered by what `lstat` says about the file (device, inode,
    size, mtime_ns, ctime_ns), so an unchanged file is not read again.

    Fail closed, as git does with its index: a file whose mtime or ctime is less than
    `RACY_SECONDS` older than the moment it was hashed may still be changing within the
    timestamp's granularity, so it is never remembered and is re-hashed every time. Only
    regular files are remembered. The cache is kept in the state folder sealed like a
    receipt (signed when a signing key is configured); one that does not verify is
    dropped, never trusted.
    """

    def __init__(self, path: Path | None, clock: Clock) -> None:
        self.path = path
        self.clock = clock
        self._guard = threading.Lock()
        self._saving = threading.Lock()
        self._entries: dict[str, str] = {}
        self._dirty = False
        self._loaded = False

    def _load(self) -> None:
        self._loaded = True
        if self.path is None:
            return
        try:
            data = self.path.read_bytes()
        except OSError:
            return
        from ratchet.checks._signing import signing_key

        entries = open_stat_cache(data, signing_key())
        if entries is not None:
            self._entries = entries

    def entries(
        self, paths: list[str], root: str, observed: dict[str, _Sig] | None = None
    ) -> list[str]:
        """`entry` of many files: the unchanged ones (the common case) in one tight loop.

        With `observed`, each file whose identity can be trusted for its lstat signature
        (a regular file, settled, unchanged while it was read) gets that signature there:
        what `TreeCache` records."""
        if not self._loaded:
            with self._guard:
                if not self._loaded:
                    self._load()
        known, lstat, is_reg = self._entries.get, os.lstat, stat.S_ISREG
        out: list[str] = []
        for path in paths:
            try:
                st = lstat(path)
            except OSError:
                out.append(self.entry(path, root, observed))
                continue
            if is_reg(st.st_mode):
                sig = f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} "
                hit = known(path)
                if isinstance(hit, str) and hit.startswith(sig):
                    out.append(hit[len(sig) :])
                    if observed is not None:
                        observed[path] = _SIG(st)
                    continue
            out.append(self.entry(path, root, observed))
        return out

    def entry(self, path: str, root: str, observed: dict[str, _Sig] | None = None) -> str:
        if not self._loaded:
            with self._guard:
                if not self._loaded:
                    self._load()
        try:
            st = os.lstat(path)
        except OSError:
            return _entry(path, root)
        if not stat.S_ISREG(st.st_mode):
            return _entry(path, root)
        # One string per file, "dev ino size mtime_ns ctime_ns identity": cheap to load
        # and to compare for tens of thousands of files.
        sig = f"{st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} "
        hit = self._entries.get(path)
        if isinstance(hit, str) and hit.startswith(sig):
            if observed is not None:
                observed[path] = _SIG(st)
            return hit[len(sig) :]
        now = self.clock.now()
        identity = _entry(path, root)
        settled = max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 < now - RACY_SECONDS
        try:
            again = os.lstat(path)
        except OSError:
            return identity
        same = (
            f"{again.st_dev} {again.st_ino} {again.st_size} {again.st_mtime_ns} "
            f"{again.st_ctime_ns} "
        ) == sig and again.st_mode == st.st_mode
        if settled and same and " " not in identity:
            if observed is not None:
                observed[path] = _SIG(st)
            with self._guard:
                self._entries[path] = sig + identity
                self._dirty = True
        return identity

    def save(self) -> None:
        """Write the cache if it learned anything (best effort: it is only a speed-up)."""
        if self.path is None:
            return
        from ratchet.checks._signing import signing_key

        # One save at a time (repositories are probed on threads of their own): a slower
        # save of an older copy never replaces a newer one.
        with self._saving:
            with self._guard:
                if not self._dirty:
                    return
                self._dirty = False
                entries = dict(self._entries)
            try:
                atomic_write_bytes(self.path, seal_stat_cache(entries, signing_key()))
            except (OSError, ValueError):
                pass


# A file's lstat signature as `TreeCache` compares it: (mode, device, inode, size,
# mtime_ns, ctime_ns), taken in C for a whole listing at once.
_Sig = tuple[int, int, int, int, int, int]
_SIG: Callable[[os.stat_result], _Sig] = operator.attrgetter(
    "st_mode", "st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns"
)
_SIG_PACK = struct.Struct("<QQQQqq").pack
TREE_CACHE_VERSION = 1


def _listing_names(listing: bytes) -> list[bytes]:
    names = listing.split(b"\0")
    if names and not names[-1]:
        names.pop()
    return names


def _stats_digest(sigs: Iterable[_Sig]) -> str | None:
    try:
        packed = b"".join(itertools.starmap(_SIG_PACK, sigs))
    except struct.error:  # a value out of range: never remembered, never matched
        return None
    return sha256_hex(packed)


def tree_stats(root: str, listing: bytes) -> str | None:
    """The digest of every listed file's lstat signature, in listing order (None when one
    cannot be stat'ed). The loop runs in C (`map`, `attrgetter`, `starmap`): no Python
    bytecode per file, which is what makes a no-op probe of 50,000 files cheap."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        stats = map(functools.partial(os.lstat, dir_fd=fd), _listing_names(listing))
        return _stats_digest(map(_SIG, stats))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


class TreeCache:
    """Whole-repository digests remembered by the repository's `git ls-files` listing and
    the lstat signature of every listed file, so a no-op probe is one listing, one lstat
    per file and one hash, without building the manifest.

    A record is written only when every listed file is a regular file whose identity was
    trusted (settled for `RACY_SECONDS`, unchanged while read: the stat cache's rules), so
    it fails closed exactly as the stat cache does: any change to the listing or to any
    file's mode, device, inode, size, mtime_ns or ctime_ns misses, and the manifest is
    built again. Records are sealed like the stat cache (signed under a signing key); one
    that does not verify is ignored.
    """

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        # One repository's lstat pass at a time. Each `os.lstat` releases the GIL and takes
        # it back, so two threads stat'ing at once hand the GIL to each other at every call
        # (a futex wake and a context switch each time): measured slower in wall time and
        # CPU than the same calls one pass after the other (`source_identity` still runs
        # the listings and the rest of each probe side by side).
        self._turn = threading.Lock()

    def _path(self, root: str) -> Path | None:
        if self.folder is None:
            return None
        name = sha256_hex(root.encode("utf-8", "surrogateescape"))[:32]
        return self.folder / f"{name}.json"

    @staticmethod
    def _body(root: str, listing_digest: str, stats: str, digest: str) -> bytes:
        return canonical_json(
            {
                "version": TREE_CACHE_VERSION,
                "root": _key(root),
                "listing": listing_digest,
                "stats": stats,
                "digest": digest,
            }
        )

    def lookup(self, root: str, listing: bytes) -> str | None:
        """The remembered digest of `root` when its listing and every file's signature are
        the ones recorded, else None."""
        path = self._path(root)
        if path is None:
            return None
        try:
            head_bytes, _, body = path.read_bytes().partition(b"\n")
            head = json.loads(head_bytes)
            record = json.loads(body)
        except (OSError, ValueError):
            return None
        if not isinstance(head, dict) or not isinstance(record, dict):
            return None
        from ratchet.checks._signing import signing_key

        recorded = head.get("seal")
        if not isinstance(recorded, str):
            return None
        if not compare_digest(recorded, _body_seal(body, signing_key())):
            return None
        if record.get("version") != TREE_CACHE_VERSION or record.get("root") != _key(root):
            return None
        if record.get("listing") != sha256_hex(listing):
            return None
        with self._turn:
            stats = tree_stats(root, listing)
        digest = record.get("digest")
        if stats is None or stats != record.get("stats") or not isinstance(digest, str):
            return None
        return digest

    def remember(
        self, root: str, listing: bytes, observed: Mapping[str, _Sig], digest: str
    ) -> None:
        """Record `digest` for `root` if every listed file has a trusted signature in
        `observed` (full path -> signature, as the stat cache saw it before reading the
        file); best effort, as it is only a speed-up."""
        path = self._path(root)
        if path is None:
            return
        base = root + os.sep
        sigs = []
        for name in listing.decode("utf-8", "surrogateescape").split("\0"):
            if not name:
                continue
            sig = observed.get(base + name)
            if sig is None:
                return  # a racy, non-regular or unread file: nothing to trust
            sigs.append(sig)
        stats = _stats_digest(sigs)
        if stats is None:
            return
        from ratchet.checks._signing import signing_key

        body = self._body(root, sha256_hex(listing), stats, digest)
        head = canonical_json({"seal": _body_seal(body, signing_key())})
        with contextlib.suppress(OSError, ValueError):
            atomic_write_bytes(path, head + b"\n" + body)


def _body_seal(body: bytes, key: bytes | None) -> str:
    if key is None:
        return "sha256:" + sha256_hex(body)
    return "hmac-sha256:" + hmac_sha256_hex(key, body)


def seal_stat_cache(entries: Mapping[str, str], key: bytes | None) -> bytes:
    """A stat cache file: a header line (version, and the seal of the body: a SHA-256, or
    an HMAC under `key`), then the entries as canonical JSON. The seal covers the body's
    bytes as stored, so checking it costs one hash, not a re-encoding of every entry."""
    body = canonical_json(dict(entries))
    head = canonical_json({"version": STAT_CACHE_VERSION, "seal": _body_seal(body, key)})
    return head + b"\n" + body


def open_stat_cache(data: bytes, key: bytes | None) -> dict[str, str] | None:
    """The entries of a stat cache file, or None when it is not one this version wrote or
    its seal does not verify under `key` (it is then dropped, never trusted)."""
    head_bytes, sep, body = data.partition(b"\n")
    try:
        head = json.loads(head_bytes) if sep else None
    except ValueError:
        return None
    if not isinstance(head, dict) or head.get("version") != STAT_CACHE_VERSION:
        return None
    recorded = head.get("seal")
    if not isinstance(recorded, str) or not compare_digest(recorded, _body_seal(body, key)):
        return None
    try:
        entries = json.loads(body)
    except ValueError:
        return None
    return entries if isinstance(entries, dict) else None


def outputs_manifest(workspace_root: str | os.PathLike[str], patterns: list[str]) -> dict[str, str]:
    """Declared outputs as they are on disk: workspace-relative path -> identity, for every
    file a pattern (a path or a glob; `**` recurses) matches; a matched directory counts
    with every file under it."""
    import glob  # only stages that declare outputs need it, not every start-up

    root = Path(workspace_root)
    out: dict[str, str] = {}
    for pattern in patterns:
        for rel in sorted(glob.glob(pattern, root_dir=root, recursive=True)):
            full = root / rel
            rel_key = _key(Path(rel).as_posix())
            if full.is_dir() and not full.is_symlink():
                for k, v in _manifest(full, (), use_git=False).items():
                    out[f"{rel_key}/{k}"] = v
            else:
                out[rel_key] = _entry(str(full), str(root))
    return out


def declared_output(rel: str, patterns: list[str]) -> bool:
    """Whether `outputs_manifest` could list `rel` for `patterns`: a plain relative path that
    a pattern matches, or that lies in a folder a pattern matches. What a cache entry names
    outside this is not the stage's to restore (an entry's writer could name any file)."""
    import fnmatch

    # An empty folder's key ends with "/"; the pattern "." (the whole workspace) lists "./x".
    parts = rel.removeprefix("./").rstrip("/").split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return False

    def match(pat: tuple[str, ...], at: int) -> bool:
        if not pat:
            return True  # matched a folder the rest lies in (or the path itself)
        if at == len(parts):
            return all(p == "**" for p in pat)
        if pat[0] == "**":
            return match(pat[1:], at) or match(pat, at + 1)
        return fnmatch.fnmatchcase(parts[at], pat[0]) and match(pat[1:], at + 1)

    return any(match(_pattern_parts(p), 0) for p in patterns)


def _pattern_parts(pattern: str) -> tuple[str, ...]:
    return tuple(p for p in pattern.split("/") if p not in ("", "."))


def runtime_identity(
    items: list[dict[str, Any]],
    *,
    workspace_root: Path,
    cwd: Path,
    env: Mapping[str, str],
    timeout: float = RUNTIME_INPUT_TIMEOUT_SECONDS,
) -> dict[str, str]:
    """Declared runtime inputs: label -> digest. A `path` is hashed like an input (a file,
    or every file of a folder, ignored or not); an `argv` is run and its exit code, stdout
    and stderr are hashed (`python --version`). A command that cannot run raises OSError."""
    import subprocess  # only stages with runtime inputs run commands here

    out: dict[str, str] = {}
    for item in items:
        if "path" in item:
            full = workspace_root / item["path"]
            if full.is_dir():
                value = "tree:" + sha256_bytes(canonical_json(_manifest(full, (), use_git=False)))
            else:
                value = _entry(str(full), str(workspace_root))
            out[f"path:{item['path']}"] = value
            continue
        argv = list(item["argv"])
        try:
            proc = subprocess.run(
                argv,
                cwd=cwd,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise OSError(f"runtime input {argv!r} did not finish in {timeout:g} s") from exc
        except OSError as exc:
            raise OSError(f"runtime input {argv!r} could not run: {exc}") from exc
        out["argv:" + canonical_json(argv).decode("utf-8")] = sha256_bytes(
            canonical_json(
                {
                    "exit": proc.returncode,
                    "stdout": sha256_bytes(proc.stdout),
                    "stderr": sha256_bytes(proc.stderr),
                }
            )
        )
    return out


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
        self._exclude_files: list[Path] = []
        # Listings `source_identity` fetched side by side, each used once, right after.
        self._listings: dict[Path, bytes | None] = {}
        stat_path = self.state_dir / "stat-cache.json" if self.state_dir is not None else None
        self.stat_cache = StatCache(stat_path, clock)
        # The workspace root's few own files have a cache of their own, so probing them
        # never loads the repositories' (possibly 50,000-entry) one.
        rest_path = self.state_dir / "stat-cache-workspace.json" if self.state_dir else None
        self.rest_stat_cache = StatCache(rest_path, clock)
        self.tree_cache = TreeCache(self.state_dir / "tree-cache" if self.state_dir else None)
        # The workspace root's own files are an input unless a repository is the root.
        root = self.workspace_root.resolve()
        self._has_rest = all(p.resolve() != root for p in self.repositories.values())

    def exclude_from_workspace(self, path: str | os.PathLike[str]) -> None:
        """Leave `path` (the project file: its checks are keyed one by one) out of the
        workspace root's files."""
        self._exclude_files.append(Path(path))

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
            rest = [WORKSPACE_REST] if self._has_rest else []
            return sorted([*self.repositories, *rest])
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
        """Every repository's digest: the whole workspace.

        Every repository's `git ls-files` starts at once, and each repository is probed on
        a thread of its own as soon as its listing is in: one repository's lstat calls
        (which release the GIL) overlap the others' and their listings."""
        rest = [WORKSPACE_REST] if self._has_rest else []
        names = sorted([*self.repositories, *rest])
        started: dict[Path, Child] = {}
        try:
            for root in self.repositories.values():
                if root.is_dir() and root not in started:
                    started[root] = _start_listing(root)
        except BaseException:
            for child in started.values():
                child.stop()  # no listing left running when one cannot start
            raise

        finished: dict[Path, bytes | None] = {}
        once = {root: threading.Lock() for root in started}  # two names may share a folder

        def probe(name: str) -> str:
            root = self.repositories.get(name)
            if root is not None and root in started:
                with once[root]:
                    if root not in finished:
                        finished[root] = _finish_listing(started[root])
                with self._guard:
                    self._listings[root] = finished[root]
            return self.repository_digest(name)

        try:
            return dict(zip(names, map_threads(probe, names, max_workers=4), strict=True))
        finally:
            for child in started.values():
                child.stop()  # a no-op for a listing already collected
            with self._guard:
                self._listings = {}  # never used later, when it may be out of date

    def log_digest(self, path: str | os.PathLike[str]) -> str:
        """A log's SHA-256, read afresh (OSError, e.g. FileNotFoundError, when it cannot be)."""
        return sha256_file(path)

    def repository_digest(self, name: str) -> str:
        with self._guard:
            epoch, quiet = self._epoch, self._active == 0
            hit = self._memo.get(name)
            if hit is not None and quiet and hit[0] == epoch:
                return hit[2]
        digest, manifest = self._compute(name)
        if manifest is not None:  # else it was stored when the tree cache learned `digest`
            self._store_manifest(digest, manifest)
        with self._guard:
            if quiet and self._active == 0 and self._epoch == epoch:
                self._memo[name] = (epoch, self.clock.monotonic(), digest)
        return digest

    def manifest(self, name: str) -> dict[str, str]:
        """A repository's current manifest: relative path -> file identity."""
        manifest = self._build(name, fast=False)[1]
        assert manifest is not None
        return manifest

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

    def _compute(self, name: str) -> tuple[str, dict[str, str] | None]:
        """(digest, manifest) of a repository; the manifest is None when the tree cache
        answered for the digest (nothing listed changed since it learned it)."""
        return self._build(name, fast=True)

    def _build(self, name: str, *, fast: bool) -> tuple[str, dict[str, str] | None]:
        if name == WORKSPACE_REST:
            manifest = self._workspace_rest()
            return sha256_bytes(canonical_json(manifest)), manifest
        root = self.repositories[name]
        if not root.is_dir():
            # Hashed as one constant, a missing folder would keep its stages' results valid
            # forever, whatever the commands now do: the same mistake as an empty one.
            what = "is not a folder" if root.exists() else "does not exist"
            raise ProjectError(
                f"repository {name!r} at {root} {what}: its checks would have no input to "
                "invalidate them; fix its path in the project file's repositories, or check "
                "it out there"
            )
        with self._guard:
            raw = self._listings.pop(root, _NOT_LISTED)
        if raw is _NOT_LISTED:
            raw = _git_raw(root)
        root_text = str(root)
        # The tree cache applies only where git lists something (else every file is walked)
        # and nothing listed is left out of the manifest.
        whole = bool(raw) and not _skipped(root, self._exclude)
        if fast and whole and raw:
            remembered = self.tree_cache.lookup(root_text, raw)
            if remembered is not None:
                return remembered, None
        observed: dict[str, _Sig] | None = {} if whole else None
        manifest = _manifest(
            root,
            self._exclude,
            entry_of=self.stat_cache.entry,
            entries_of=functools.partial(self.stat_cache.entries, observed=observed),
            git_listing=(None if raw is None else _parse_listing(raw),),
        )
        self.stat_cache.save()
        for project in self._exclude_files:
            # The project file, inside this repository: each check is keyed by its own
            # definition, so editing another check must not change this one's inputs.
            try:
                manifest.pop(project.resolve().relative_to(root.resolve()).as_posix(), None)
            except ValueError:
                pass
        if not manifest:
            raise ProjectError(
                f"repository {name!r} at {root} has no files to hash: an empty input set "
                "would never invalidate anything; add its files, or remove it from the "
                "project's repositories"
            )
        digest = sha256_bytes(canonical_json(manifest))
        if observed and raw:
            self._store_manifest(digest, manifest)  # before the record that names it
            self.tree_cache.remember(root_text, raw, observed, digest)
        return digest, manifest

    def _workspace_rest(self) -> dict[str, str]:
        """Files at the workspace root outside every declared repository (a `tools/ci.py`
        a check runs): git's listing when the root is a work tree, else a walk."""
        root = self.workspace_root
        skip = tuple(p for p in self.repositories.values()) + self._exclude
        skip += tuple(self._exclude_files)
        cache = self.rest_stat_cache
        full = _manifest(root, skip, entry_of=cache.entry, entries_of=cache.entries)
        cache.save()
        prefixes = []
        for p in skip:
            try:
                rel = p.relative_to(root).as_posix()
            except ValueError:
                continue
            prefixes.append(rel)
        return {
            k: v
            for k, v in full.items()
            if not any(k == pre or k.startswith(pre.rstrip("/") + "/") for pre in prefixes)
        }

    def keep_manifest(self, digest: str, manifest: dict[str, str]) -> None:
        """Record a manifest by digest (declared outputs), so `explain` can name files."""
        self._store_manifest(digest, manifest)

    def _store_manifest(self, digest: str, manifest: dict[str, str]) -> None:
        # Kept only so `explain` can name changed files; content-addressed, written once.
        if self.state_dir is None or digest == MISSING_REPOSITORY:
            return
        path = self.state_dir / "manifests" / f"{digest}.json"
        if not path.exists():
            atomic_write_bytes(path, canonical_json(manifest))
