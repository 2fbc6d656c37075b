"""What a Flink job of ratchet reads and leaves in its folders, without PyFlink: the files a
file source reads, the committed output records of a file sink, and the memory side output
(`--memory-output`)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from ratchet._errors import ConfigError
from ratchet.runtime._journal import decode_memory


def input_files(path: Path) -> list[Path]:
    """The files Flink's FileSource reads under `path`: the file itself, or every file below
    the folder with no part of its path starting with '.' or '_' (Flink skips those as
    hidden; a file sink's in-progress files and ratchet's `_bad-input` and `_progress` folders
    are such)."""
    if path.is_file():
        return [path]
    out = []

    # Hidden folders are not entered (a run's `_checkpoints` can be large, and Flink deletes
    # subsumed checkpoints while this walks); what vanishes meanwhile is not an output, and a
    # folder that cannot be read is an error (OSError), not an empty one.
    def unreadable(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):  # a folder that vanished holds nothing
            raise exc

    for top, dirs, files in os.walk(path, onerror=unreadable):
        dirs[:] = [d for d in dirs if d[:1] not in (".", "_")]
        for name in files:
            f = Path(top, name)
            if name[:1] not in (".", "_") and f.is_file():
                out.append(f)
    return sorted(out)


def read_output_dir(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every committed output record in a file-sink directory (hidden in-progress files and
    folders starting with `_` or `.`, such as `_bad-input`, skipped)."""
    out: list[dict[str, Any]] = []
    root = Path(directory)
    if not root.is_dir():
        return out
    for path in input_files(root):
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def decode_memory_line(record: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A memory side-output record to (key, memory), every value with its exact type."""
    return record["key"], decode_memory(base64.b64decode(record["memory"]))


def latest_memory_records(directory: str | os.PathLike[str]) -> dict[Any, bytes]:
    """Each key's encoded memory (`encode_memory`) from a memory side-output folder. A folder
    written by several runs of a job (a resume from a savepoint emits every key again) holds a
    key more than once: the record that had admitted the most inputs (`inputs`) is the latest."""
    best: dict[Any, tuple[int, str]] = {}
    root = Path(directory)
    for path in input_files(root) if root.is_dir() else []:
        for line in path.read_bytes().splitlines():
            if line.strip():
                rec = _memory_record(directory, path, line)
                key = rec["key"]
                n = int(rec.get("inputs", -1))
                if key not in best or n >= best[key][0]:
                    best[key] = (n, rec["memory"])
    return {key: base64.b64decode(text) for key, (_n, text) in best.items()}


def _memory_record(directory: str | os.PathLike[str], path: Path, line: bytes) -> dict[str, Any]:
    # The output folder, a savepoint, any folder of files: not a traceback, but which it is.
    try:
        rec = json.loads(line)
    except ValueError:
        rec = None
    if not (isinstance(rec, dict) and "key" in rec and isinstance(rec.get("memory"), str)):
        raise ConfigError(
            f"{directory} holds no memory records ({path} is not one): only the folder a "
            "job's --memory-output names can be read"
        )
    return rec


def latest_memories(directory: str | os.PathLike[str]) -> dict[Any, dict[str, Any]]:
    """Each key's memory from a memory side-output folder (see `latest_memory_records`)."""
    return {key: decode_memory(raw) for key, raw in latest_memory_records(directory).items()}
