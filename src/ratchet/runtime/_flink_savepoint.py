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

import logging
import re
import struct
from pathlib import Path
from urllib.parse import unquote, urlparse

from ratchet._errors import ConfigError
from ratchet.runtime._flink_files import input_files

log = logging.getLogger("ratchet.flink")

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


JOBS_FILE = "_jobs"  # in a local output folder: the id of each job that wrote into it


def note_job(output: str, job_id: str) -> None:
    """Record in a local output folder that job `job_id` writes into it: its savepoints and
    checkpoints are the ones that continue this folder's run (`newest_restore_point`)."""
    folder = local_path(output)
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / JOBS_FILE, "a", encoding="utf-8") as fh:
            fh.write(job_id + "\n")
    except OSError as exc:
        log.warning("could not note job %s in %s: %s", job_id, folder, exc)


def output_jobs(output: str) -> set[str] | None:
    """The ids of the jobs that wrote into a local output folder (None: not recorded, as in
    folders written before ratchet recorded them)."""
    folder = local_path(output)
    try:
        text = (folder / JOBS_FILE).read_text(encoding="utf-8") if folder else None
    except OSError:
        return None
    return None if text is None else {line.strip() for line in text.splitlines() if line.strip()}


_CHECKPOINT_NUMBER = re.compile(r"chk-(\d+)$")


def newest_restore_point(folders: list[str], jobs: set[str] | None = None) -> Path | None:
    """The newest savepoint or retained checkpoint under `folders` (savepoint folders, checkpoint
    folders): a folder with a `_metadata` file, `savepoint-*` in a savepoint folder or
    `<job id>/chk-N` in a checkpoint folder; with `jobs`, only those of these jobs (a shared
    `--checkpoint-dir` holds other runs' too). Newest by time; on equal times, a savepoint
    before a checkpoint, and the checkpoint with the higher N. None if there is none here."""
    found: list[tuple[float, int, int, Path]] = []
    seen: set[Path] = set()
    for location in folders:
        root = local_path(location)
        if root is None or not root.is_dir() or root.resolve() in seen:
            continue
        seen.add(root.resolve())
        for meta in [*root.glob("savepoint-*/_metadata"), *root.glob("*/chk-*/_metadata")]:
            point = meta.parent
            number = _CHECKPOINT_NUMBER.search(point.name)
            if jobs is not None:
                if number is not None:
                    mine = point.parent.name in jobs
                else:  # savepoint-<first 6 characters of the job id>-<random>
                    mine = any(point.name.startswith(f"savepoint-{j[:6]}-") for j in jobs)
                if not mine:
                    continue
            try:
                at = meta.stat().st_mtime
            except OSError:  # a checkpoint Flink was discarding meanwhile
                continue
            kind = 0 if number is not None else 1  # a savepoint wins a tie
            found.append((at, kind, int(number.group(1)) if number else 0, point))
    return max(found)[3] if found else None


def earlier_outputs(output: str) -> int:
    """How many committed output files a local `--output` folder holds (0 for another file
    system, or a folder that does not exist)."""
    path = local_path(output)
    if path is None or not path.is_dir():
        return 0
    try:
        return len(input_files(path))
    except OSError as exc:
        raise ConfigError(f"--output {output} cannot be read ({exc}); fix its permissions") from exc
