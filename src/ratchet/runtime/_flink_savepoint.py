"""What `ratchet flink run --from-savepoint` reads from a savepoint's bytes, without Flink: the
execution mode it was taken in, and which input files its job had read.

A job's keyed state is laid out for its mode (process: byte arrays; thread: STRING state under
other names, docs/flink.md), and Flink refuses a savepoint restored in the other mode with a
page of Java stack trace. The state names are in the savepoint's files: Flink writes each
registered state's name (Java's `writeUTF`: a two-byte length, then the bytes) in the keyed
state's meta data, inline in `_metadata` for small state and at the head of each state file
otherwise; PyFlink's process mode prefixes the names with ``python-state-``. No PyFlink import.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from urllib.parse import unquote, urlparse

from ratchet.runtime._flink_files import input_files

MODES = ("process", "thread")
MODE_ENV = "RATCHET_FLINK_EXECUTION_MODE"  # a default for a whole test suite or benchmark

# The agent operator's keyed state, by mode (`_function.py` registers these names).
PROCESS_STATES = ("ratchet-key", "ratchet-inputs", "ratchet-run", "ratchet-calls", "ratchet-wake")
THREAD_STATES = ("ratchet-key-t", "ratchet-inputs-t", "ratchet-run-t", "ratchet-calls-t")
_PROCESS_PREFIX = "python-state-"  # what PyFlink's process mode stores a state's name under

_HEAD = 1 << 20  # bytes read from each state file (its meta data comes first)
_FILES = 2000  # files looked at, at most


def _tokens(names: tuple[str, ...], prefix: str = "") -> list[bytes]:
    out = []
    for name in names:
        raw = (prefix + name).encode()
        out.append(struct.pack(">H", len(raw)) + raw)
    return out


_PATTERNS = {
    "process": re.compile(b"|".join(map(re.escape, _tokens(PROCESS_STATES, _PROCESS_PREFIX)))),
    "thread": re.compile(b"|".join(map(re.escape, _tokens(THREAD_STATES)))),
}


def local_path(location: str) -> Path | None:
    """A savepoint location as a local path: a plain path or a `file:` URI; None for another
    file system (s3://, hdfs://), which this process cannot read."""
    if "://" not in location and not location.startswith("file:"):
        return Path(location)
    url = urlparse(location)
    if url.scheme != "file":
        return None
    return Path(unquote(url.path))


def _folder(location: str) -> Path | None:
    """The local folder of the savepoint at `location` (the folder itself, or its `_metadata`
    file); None if it is not a local folder."""
    path = local_path(location)
    if path is None:
        return None
    if path.is_file():
        path = path.parent
    return path if path.is_dir() else None


def _contents(location: str) -> list[bytes] | None:
    """All of `_metadata` (where small state is inline) and the head of every other file of the
    savepoint at `location`; None if it is not a readable local folder (or its `_metadata`)."""
    path = _folder(location)
    if path is None:
        return None
    out = []
    for f in sorted(path.iterdir(), key=lambda p: p.name != "_metadata")[:_FILES]:
        try:
            with f.open("rb") as fh:
                out.append(fh.read(-1 if f.name == "_metadata" else _HEAD))
        except OSError:
            continue
    return out


def savepoint_mode(location: str) -> str | None:
    """ "process" or "thread": the mode whose state names the savepoint at `location` holds;
    None when that cannot be told (not a local path, not readable, no ratchet keyed state,
    or the names of both modes)."""
    found: set[str] = set()
    for head in _contents(location) or []:
        for mode, pattern in _PATTERNS.items():
            if pattern.search(head):
                found.add(mode)
    return found.pop() if len(found) == 1 else None


MARKER = "ratchet-run.json"  # what `ratchet flink run` adds to the savepoint that ends a run


def unread_inputs(location: str, input_path: str) -> list[Path]:
    """The files of `input_path` that the savepoint's source state does not name (Flink keeps
    the URI of every file its FileSource has read or is reading). A bounded job restored from
    the savepoint would never read them: Flink restores a bounded FileSource from its pending
    splits alone. Empty when the savepoint cannot be read here (a remote file system)."""
    contents = _contents(location)
    if contents is None:
        return []
    files = input_files(Path(input_path).resolve())
    follows = re.compile(rb"[A-Za-z0-9._/~%+=,@-]")  # a byte that would continue the path
    unread = []
    for f in files:
        uri = ("file:" + str(f)).encode()
        named = False
        for head in contents:
            at = head.find(uri)
            while at >= 0:
                end = at + len(uri)
                if end >= len(head) or not follows.match(head, end):
                    named = True
                    break
                at = head.find(uri, at + 1)
            if named:
                break
        if not named:
            unread.append(f)
    return unread


def read_marker(location: str) -> dict[str, object] | None:
    """The marker `ratchet flink run` wrote into a savepoint it took at the end of a run to
    completion; None if there is none (or it cannot be read here)."""
    import json

    path = _folder(location)
    if path is None:
        return None
    try:
        data = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(location: str, info: dict[str, object]) -> None:
    """Say in the savepoint's folder that a continuously watching file source took it (so it
    names every input file its job read): a later run to completion may restore it."""
    import json

    path = _folder(location)
    if path is not None:
        (path / MARKER).write_text(json.dumps(info))


def newest_restore_point(folders: list[str]) -> Path | None:
    """The newest savepoint or retained checkpoint under `folders` (savepoint folders, checkpoint
    folders): a folder with a `_metadata` file, `savepoint-*` in a savepoint folder or
    `<job id>/chk-N` in a checkpoint folder. None if there is none here."""
    found: list[tuple[float, Path]] = []
    for location in folders:
        root = local_path(location)
        if root is None or not root.is_dir():
            continue
        for meta in [*root.glob("savepoint-*/_metadata"), *root.glob("*/chk-*/_metadata")]:
            try:
                found.append((meta.stat().st_mtime, meta.parent))
            except OSError:  # a checkpoint Flink was discarding meanwhile
                continue
    return max(found)[1] if found else None


def earlier_outputs(output: str) -> int:
    """How many committed output files a local `--output` folder holds (0 for another file
    system, or a folder that does not exist)."""
    path = local_path(output)
    if path is None or not path.is_dir():
        return 0
    return len(input_files(path))
