"""Sources and sinks of the embedded engine: where inputs come from, where outputs go.

Both are bound to the job (DESIGN "A job has an identity"): a file source checkpoints which
file it read (device, inode, digests of the bytes around its position) and refuses another
one; the JSONL sink labels every line with the job id and refuses a file another job wrote.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import fnmatch
import glob
import hashlib
import json
import json.scanner
import logging
import math
import os
import random
import re
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import BadInputError, CodecError, ConfigError, StateError
from ratchet.store import codec
from ratchet.store._files import atomic_json

log = logging.getLogger("ratchet.io")


# How a stop at a bad input is undone: the same engine runs under the CLI and `ratchet.run()`.
SKIP_BAD_INPUT = "pass --on-bad-input skip (from Python: config=EngineConfig(on_bad_input='skip'))"


def stopped_at_bad_input(error: str) -> BadInputError:
    """The error a job stops with before a bad input (one engine, or the coordinator of N)."""
    return BadInputError(
        f"{error}; stopped before admitting it (inputs before it are processed and "
        f"checkpointed; fix the line and run again, or {SKIP_BAD_INPUT})"
    )


@dataclass(slots=True)
class Record:
    """One input read from a source: its key and value, or why it is bad."""

    line: int
    key: Any = None
    value: Any = None
    error: str | None = None
    raw: str | None = None  # a bad line's text, for its dead letter
    # The input's number when a coordinator numbered it (a shard of a multi-process job):
    # the engine admits it under this number, so output ids match a single-process run's.
    seq: int | None = None


class Source:
    """Yields records one at a time, so its position is exact at every checkpoint.

    The connector interface (docs/connectors.md): `open` once the job is known, `restore`
    the checkpointed position, `next_record` without blocking the event loop, `position` at
    every checkpoint, and `acknowledge` once the checkpoint holding that position completed.
    `follow` is read each time `next_record` returns None: True means "nothing now, ask
    again", False means "the input is exhausted" (a property may compute it).
    """

    follow = False

    def open(self, job: JobIdentity | None, *, checkpoint_interval: float) -> None:
        """Called by `Job` once the state directory's job is known, before `restore`;
        `checkpoint_interval` is in seconds (a source that leases inputs checks it)."""

    def acknowledge(self, position: dict[str, Any]) -> None:
        """Called after the checkpoint that holds `position` (a value `position()` returned)
        completed: every input read up to it is durable in ratchet's state, so the source may
        now tell its system (ack a message, prune an inbox). Called on the engine's loop: hand
        slow work to a thread. An exception is logged, and the next checkpoint calls again with
        a later position: acknowledge everything up to `position`, not only what is new."""

    def restore(self, position: dict[str, Any]) -> None:
        raise NotImplementedError

    def position(self) -> dict[str, Any]:
        raise NotImplementedError

    def next_record(self) -> Record | None:
        """The next record, or None when nothing more is available now."""
        raise NotImplementedError

    def unread(self) -> None:
        """Step back over the record just returned (a bad one), so a restart reads it again."""
        raise NotImplementedError

    def close(self) -> None:
        pass


_NO_KEY = object()


def _key_of(value: Any, key_field: str, where: str) -> tuple[Any, str | None]:
    if not isinstance(value, dict):
        return None, f"{where}: expected a JSON object, got {type(value).__name__}"
    if key_field not in value:
        return None, f"{where}: missing key field {key_field!r}"
    key = value[key_field]
    if key is None:  # JSON null, or a NULL in a database row
        return (
            None,
            f"{where}: key field {key_field!r} is null (NULL); keys must be strings or integers",
        )
    if isinstance(key, bool) or not isinstance(key, str | int):
        return None, (
            f"{where}: key field {key_field!r} is {type(key).__name__}; keys must be strings or integers"
        )
    if type(key) is str and not key.isascii() and _lone_surrogate(key):
        return None, (
            f"{where}: key field {key_field!r} holds a lone surrogate ({_lone_surrogate(key)}, "
            f"the JSON escape of half a UTF-16 pair), which no state or output can hold as "
            f"text; write the whole character (both halves of the pair) or another key"
        )
    return key, None


def _text(raw: bytes) -> str:
    return raw[:65536].decode("utf-8", errors="replace")


def _not_json(constant: str) -> Any:
    """NaN, Infinity and -Infinity are Python's extensions, not JSON: such a line is a bad
    input (its policy applies), as it would be to any other JSON reader. Called for those
    tokens only, so it costs the lines that have none nothing."""
    raise ValueError(f"{constant} is not JSON; write null or a string")


# The C scanner `json.loads` ends in, called directly on a line's text (see `_loads`).
# (typeshed types make_scanner's argument as make_scanner itself; it takes a decoder.)
_SCAN: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(
    json.JSONDecoder(parse_constant=_not_json)  # type: ignore[arg-type]
)


def _loads(text: bytes) -> Any:
    """`json.loads(text)` of one stripped line, in about 0.6 of its time: `json.loads` on bytes
    first guesses their encoding (UTF-8, -16 or -32, with or without a BOM) and decodes them
    in Python; JSON Lines are UTF-8, so the scanner gets the text at once. Anything but one
    whole UTF-8 value (a BOM, which the scanner does not take as a value's start; extra data;
    any error) is handed to `json.loads` itself, so every result and every error message is
    the one it gives (tests/runtime/test_input_parse.py), NaN and Infinity refused by both."""
    try:
        s = text.decode("utf-8", "surrogatepass")  # json.loads's own error handler
        value, end = _SCAN(s, 0)
        if end == len(s):
            return value
    except (ValueError, StopIteration):
        pass
    return json.loads(text, parse_constant=_not_json)


# The most arrays and objects an input may nest in each other. The codec stores values at
# most `MAX_DEPTH` deep, and the deepest place ratchet itself puts a value taken from an input
# is six containers down (an output that echoes it, in a run journal in Flink's keyed state;
# a memory write of it is five, a shard frame three). A deeper input is a bad input, so its
# policy applies, instead of an admitted input that no checkpoint can ever store. An action
# that nests it deeper itself gets the codec's own "flatten it" error.
INPUT_MAX_DEPTH = codec.MAX_DEPTH - 6

_TOO_DEEP = (
    f"{{where}}: the input nests more than {INPUT_MAX_DEPTH} arrays or objects in each other, "
    f"deeper than ratchet can store; flatten it (e.g. a list of records with parent ids)"
)

_NESTS = frozenset((dict, list, tuple, set, frozenset))


def _too_deep(value: Any, limit: int = INPUT_MAX_DEPTH) -> bool:
    """Whether the container `value` nests more than `limit` containers (itself included)."""
    return _deeper(value, limit - 1)


def _deeper(v: Any, budget: int) -> bool:
    """Whether the container `v` holds a container more than `budget` levels below it (stops
    at the first; recursion is bounded by `budget`, so a cycle is simply "too deep")."""
    for c in v.values() if type(v) is dict else v:
        if type(c) in _NESTS and (budget == 0 or _deeper(c, budget - 1)):
            return True
    return False


def _key_and_depth(value: Any, key_field: str, where: str) -> tuple[Any, str | None]:
    """`_key_of`, and the depth rule: what the HTTP, NATS and PostgreSQL sources check."""
    key, err = _key_of(value, key_field, where)
    if err is None and _too_deep(value):
        return None, _TOO_DEEP.format(where=where)
    return key, err


def _parse(raw: bytes, line: int, path: object, key_field: str) -> Record | None:
    """One line (number `line`) of the JSONL input `path` as a record; None for a blank line."""
    text = raw.strip()
    if not text:
        return None
    try:
        value = _loads(text)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int over 4,300 digits
        return Record(line, error=f"{path}:{line}: invalid JSON ({exc})", raw=_text(text))
    except RecursionError:
        return Record(
            line,
            error=f"{path}:{line}: invalid JSON (arrays or objects nested too deeply to read)",
            raw=_text(text),
        )
    if type(value) is dict:
        key = value.get(key_field, _NO_KEY)
        if type(key) is int or type(key) is str and (key.isascii() or not _lone_surrogate(key)):
            # Only a line with that many brackets can be that deep: a count costs ~0.1 us.
            if text.count(b"[") + text.count(b"{") > INPUT_MAX_DEPTH and _too_deep(value):
                error = _TOO_DEEP.format(where=f"{path}:{line}")
                return Record(line, error=error, raw=_text(text))
            return Record(line, key=key, value=value)
    _key, err = _key_of(value, key_field, f"{path}:{line}")
    return Record(line, error=err, raw=_text(text))


# -- input files and their identity ----------------------------------------------------------------

# Bytes hashed at each end of what was read: enough to tell two files apart, cheap to re-read
# at every restart (two preads of at most this size, whatever the file's length).
WINDOW = 4096


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _windows(fd: int, offset: int, window: int) -> tuple[str, str]:
    """Digests of the first and of the last `window` bytes before `offset`."""
    head = os.pread(fd, min(window, offset), 0)
    start = max(0, offset - window)
    tail = head[start:offset] if offset <= window else os.pread(fd, offset - start, start)
    return _digest(head), _digest(tail)


class _File:
    """One input file: where it is, which file it is (device, inode, digests of the bytes
    around the position), and how far it has been read."""

    def __init__(self, path: Path, offset: int = 0, line: int = 0) -> None:
        self.path = path
        self.offset = offset
        self.line = line
        self.dev: int | None = None
        self.ino: int | None = None
        self.head: str | None = None
        self.tail: str | None = None
        self.window = WINDOW
        self.done = False
        self.gone = False
        self.fh: IO[bytes] | None = None
        self.seen: tuple[int, int] | None = None  # (size, mtime_ns) at the last scan
        self._digested_at = -1 if offset else 0
        if not offset:
            self.head = self.tail = _digest(b"")

    @classmethod
    def from_position(cls, pos: dict[str, Any], path: Path | None = None) -> _File:
        f = cls(
            Path(pos.get("path") or path or ""), int(pos.get("offset", 0)), int(pos.get("line", 0))
        )
        if path is not None:
            f.path = path
        f.dev = pos.get("dev")
        f.ino = pos.get("ino")
        f.head = pos.get("head")
        f.tail = pos.get("tail")
        f.window = int(pos.get("window", WINDOW))
        f.done = bool(pos.get("done", False))
        f._digested_at = f.offset if f.head is not None else -1
        return f

    def _digest_now(self) -> None:
        if self.fh is not None and self._digested_at != self.offset:
            self.window = WINDOW
            self.head, self.tail = _windows(self.fh.fileno(), self.offset, WINDOW)
            self._digested_at = self.offset

    def position(self) -> dict[str, Any]:
        self._digest_now()
        return {
            "path": str(self.path),
            "offset": self.offset,
            "line": self.line,
            "dev": self.dev,
            "ino": self.ino,
            "head": self.head,
            "tail": self.tail,
            "window": self.window,
        }

    def describe(self) -> str:
        ident = f", device {self.dev} inode {self.ino}" if self.ino is not None else ""
        return f"{self.path} ({self.offset} bytes, {self.line} lines read{ident})"

    def differs(self, fh: IO[bytes], st: os.stat_result) -> str | None:
        """Why the open file `fh` is not this one, or None if it is (as far as can be told)."""
        if st.st_size < self.offset:
            return f"it has {st.st_size} bytes, fewer than the {self.offset} already read"
        if self.head is None or self.tail is None:
            return None  # a position from before identities: only its length can be checked
        head, tail = _windows(fh.fileno(), self.offset, self.window)
        if head != self.head:
            return "its first bytes differ"
        if tail != self.tail:
            return f"the bytes before offset {self.offset} differ"
        return None

    def attach(self, fh: IO[bytes], st: os.stat_result) -> None:
        """Read on from `fh` (already checked to be this file) at the position."""
        self.fh = fh
        self.dev, self.ino = st.st_dev, st.st_ino
        self.seen = (st.st_size, st.st_mtime_ns)
        fh.seek(self.offset)

    def readline(self, partial_ok: bool) -> bytes | None:
        """The next whole line (with its newline), or None at the end. A last line without
        its newline counts as whole only when `partial_ok` (nobody is writing it any more)."""
        assert self.fh is not None
        raw = self.fh.readline()
        if not raw:
            return None
        if not raw.endswith(b"\n") and not partial_ok:
            self.fh.seek(self.offset)  # still being written: read it again once it is whole
            return None
        return raw

    def rewind(self, offset: int, line: int) -> None:
        self.offset, self.line = offset, line
        if self.fh is not None:
            self.fh.seek(offset)

    def close(self) -> None:
        if self.fh is not None:
            self._digest_now()  # the position outlives the handle
            self.fh.close()
            self.fh = None


def check_input_path(value: str | os.PathLike[str]) -> None:
    """Refuse an --input that is a pipe, a device or a socket, before anything is created
    (a file, a folder, a pattern or a missing path are the source's to judge)."""
    try:
        mode = os.stat(value).st_mode
    except (OSError, ValueError):
        return
    _refuse_special(Path(value), mode)


def _refuse_special(path: Path, mode: int) -> None:
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        raise ConfigError(
            f"--input {path} is not a regular file (a pipe, a device or a socket): a job "
            "resumes its input at a byte offset after a crash, which a pipe cannot give "
            "back; write the lines to a file and pass that (with --follow to keep reading "
            "what is appended to it)"
        )


def _open_checked(path: Path) -> tuple[IO[bytes], os.stat_result] | None:
    try:
        mode = os.stat(path).st_mode  # before open(): opening a pipe with no writer blocks
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"--input {path} cannot be read: {exc}") from exc
    _refuse_special(path, mode)
    try:
        fh = open(path, "rb")  # noqa: SIM115 - kept open across reads
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"--input {path} cannot be read: {exc}") from exc
    return fh, os.fstat(fh.fileno())


def _kind_of(position: dict[str, Any]) -> str:
    if "files" in position:
        return f"from files matching {position.get('pattern')!r}"
    if "index" in position:
        return "from a Python iterable"
    if "offset" in position:
        return f"from the file {position.get('path')}"
    # Connectors (ratchet.connectors): named so a refusal says what the state read before.
    if "inbox" in position:
        return "from an HTTP ingestion endpoint (--input http://...)"
    if "after" in position and "table" in position:
        return f"from the PostgreSQL table {position.get('table')}"
    if "pending" in position and "stream" in position:
        return f"from the JetStream stream {position.get('stream')}"
    return "from another kind of source"


class JsonlSource(Source):
    """A JSON Lines file; its byte offset and the file's identity are checkpointed.

    `follow=True` waits for new lines. A restart on another file (a different identity or
    different bytes before the position) is refused, never resumed part-way into it.
    """

    def __init__(
        self, path: str | os.PathLike[str], key_field: str = "key", follow: bool = False
    ) -> None:
        self.path = Path(path)
        self.key_field = key_field
        self.follow = follow
        if not self.path.exists() and not follow:
            raise ConfigError(f"--input {self.path} does not exist")
        self._file = _File(self.path)
        # At the end of a followed file: (start, end, digest) of the last line read, to see
        # whether the file was rewritten in place (copytruncate) when it grows again.
        self._last_line: tuple[int, int, str] | None = None
        self._recorded: _File | None = None  # the restored position, until checked
        self._prev = (0, 0)

    def unread(self) -> None:
        self._file.rewind(*self._prev)

    def restore(self, position: dict[str, Any]) -> None:
        kind = _kind_of(position)
        if position and "offset" not in position:
            raise ConfigError(
                f"this state directory read its inputs {kind}, not from the file {self.path}; "
                f"pass the same input as before, or use a new --state directory for {self.path}"
            )
        if not position:
            return
        self._file = _File.from_position(position, self.path)
        self._recorded = _File.from_position(position)
        self._open()

    def position(self) -> dict[str, Any]:
        return self._file.position()

    def _open(self) -> bool:
        f = self._file
        if f.fh is not None:
            return True
        opened = _open_checked(self.path)
        if opened is None:
            return False
        fh, st = opened
        rec = self._recorded
        if rec is not None:
            try:
                self._check(rec, fh, st)
            except BaseException:
                fh.close()
                raise
            self._recorded = None
        f.attach(fh, st)
        return True

    def _check(self, rec: _File, fh: IO[bytes], st: os.stat_result) -> None:
        why = rec.differs(fh, st)
        same = rec.ino is None or (rec.dev, rec.ino) == (st.st_dev, st.st_ino)
        if why is None:
            if not same or rec.path != self.path:
                log.info("%s is %s, moved or copied: resuming it", self.path, rec.describe())
            return
        if same and st.st_size < rec.offset:
            raise BadInputError(
                f"{self.path} is shorter ({st.st_size} bytes) than the checkpointed read "
                f"position ({rec.offset}); the input file was replaced or truncated. Put its "
                f"first {rec.offset} bytes back to continue the job, or use a new --state "
                f"directory to process this file from its start"
            )
        now = "the same file, changed" if same else f"device {st.st_dev} inode {st.st_ino}"
        if rec.path != self.path:
            fix = (
                f"Pass --input {rec.path} to continue that job, or use a new --state directory "
                f"to process {self.path} from its start"
            )
        else:
            fix = (
                "Put the original file back to continue that job, or use a new --state "
                "directory to process this one from its start"
            )
        raise ConfigError(
            f"--input {self.path} is not the file this state directory read: its position was "
            f"taken in {rec.describe()}, and {self.path} ({now}) differs: {why}; resuming would "
            f"skip its first {rec.offset} bytes. {fix}; for a log rotated by renaming, pass a "
            f"pattern that tracks each file: --input '{rec.path}*'"
        )

    def _prev_span(self) -> tuple[int, int]:
        """The last line read, or its last `WINDOW` bytes (after a restore the line's start is
        not known: it would be the whole file read so far)."""
        end = self._file.offset
        return max(self._prev[0], end - WINDOW), end

    def _span_digest(self) -> str:
        start, end = self._prev_span()
        fh = self._file.fh
        assert fh is not None
        return _digest(os.pread(fh.fileno(), end - start, start))

    def _still_the_same(self) -> None:
        """A followed file grew after its end was reached: the last line read must still be
        where it was, or the file was rewritten in place (copytruncate, `cat new > file`)
        and what follows the position is not what comes after what was read."""
        start, end, seen = self._last_line  # type: ignore[misc]
        fh = self._file.fh
        assert fh is not None
        if _digest(os.pread(fh.fileno(), end - start, start)) == seen:
            self._last_line = None
        else:  # kept: every later read is refused the same way
            f = self._file
            f.rewind(f.offset, f.line)  # the line read is not taken: the position stays
            raise BadInputError(
                f"{self.path} was rewritten in place while it was followed (the line before "
                f"byte {end} changed): it was truncated and written again, so lines after the "
                f"position may be lost to ratchet. Use rotation by renaming, not copytruncate"
            )

    def _rotated(self) -> None:
        """At the end of a followed file: refuse if the path now names another file."""
        f = self._file
        assert f.fh is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return  # renamed away and not created again yet: keep waiting
        if (st.st_dev, st.st_ino) != (f.dev, f.ino):
            raise ConfigError(
                f"--input {self.path} was replaced by another file while it was followed "
                f"(rotated?); everything read from the old one ({f.offset} bytes) is kept. "
                f"To follow a rotated log pass a pattern that tracks each file: "
                f"--input '{self.path}*' (with the same --state, it resumes the old file)"
            )
        if st.st_size < f.offset:
            raise BadInputError(
                f"{self.path} was truncated to {st.st_size} bytes while it was followed "
                f"(at {f.offset}); lines written before the truncation after the position "
                f"are lost to ratchet. Use rotation by renaming, not copytruncate"
            )

    def next_record(self) -> Record | None:
        f = self._file
        while True:
            if not self._open():
                return None
            raw = f.readline(partial_ok=not self.follow)
            if raw is None:
                if self.follow:
                    self._rotated()
                    if self._last_line is None and self._prev[0] < f.offset:
                        self._last_line = (*self._prev_span(), self._span_digest())
                return None
            if self._last_line is not None:
                self._still_the_same()
            self._prev = (f.offset, f.line)
            f.offset += len(raw)
            f.line += 1
            rec = _parse(raw, f.line, self.path, self.key_field)
            if rec is not None:
                return rec

    def close(self) -> None:
        self._file.close()


def files_pattern(text: str) -> str:
    """The glob pattern of an `--input` naming a folder (every file in it) or a pattern."""
    return str(Path(text) / "*") if Path(text).is_dir() else text


class JsonlFilesSource(Source):
    """The JSON Lines files matching a glob pattern (a directory means every file in it), read
    one after another: for logs that are rotated by renaming.

    Each file is tracked by identity (device and inode, checked against the digests of the
    bytes around its position), so a renamed file keeps its place and its position. Order:
    tracked files keep theirs (it is checkpointed); files found later go after them, oldest
    modification time first, then by name. A file is finished once it was read to its end and
    a later file exists; lines appended to a finished file afterwards are still read, next.
    """

    def __init__(
        self, pattern: str | os.PathLike[str], key_field: str = "key", follow: bool = False
    ) -> None:
        text = str(pattern)
        self.pattern = files_pattern(text)
        self.key_field = key_field
        self.follow = follow
        if not follow and not glob.glob(self.pattern):
            raise ConfigError(
                f"--input {text!r} matches no file; name a file, a directory or a glob pattern "
                f"of existing files, or pass --follow to wait for them"
            )
        self._files: list[_File] = []
        self._undo: Callable[[], None] | None = None
        self._scanned = False
        self._cur: int | None = None  # the first unfinished file, until the list changes

    # -- position --------------------------------------------------------------------------

    def position(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "files": [{**f.position(), "done": f.done} for f in self._files],
        }

    def restore(self, position: dict[str, Any]) -> None:
        if not position:
            return
        if "files" in position:
            if position.get("pattern") != self.pattern:
                log.info(
                    "input pattern %r was %r: tracked files are found by identity",
                    self.pattern,
                    position.get("pattern"),
                )
            self._files = [_File.from_position(p) for p in position["files"]]
        elif "offset" in position:
            self._files = [_File.from_position(position)]  # a single file's, taken over
        else:
            raise ConfigError(
                f"this state directory read its inputs {_kind_of(position)}, not from files "
                f"matching {self.pattern!r}; pass the same input as before, or use a new --state "
                f"directory"
            )
        self._scan()  # every tracked file is checked against what is on disk now

    # -- finding files ---------------------------------------------------------------------

    def _scan(self) -> bool:
        """Match the files on disk to the tracked ones and track new ones; True if there is
        something new to read (a new file, a finished one that grew, one that is gone)."""
        self._scanned = True
        self._cur = None
        found: dict[tuple[int, int], tuple[Path, os.stat_result]] = {}
        for name in sorted(glob.glob(self.pattern)):
            try:
                st = os.stat(name)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found[(st.st_dev, st.st_ino)] = (Path(name), st)
        changed = False
        kept: list[_File] = []
        for f in self._files:
            hit = found.get((f.dev, f.ino)) if f.dev is not None and f.ino is not None else None
            if hit is None and f.ino is None:  # a position from before identities: by path
                hit = next((h for h in found.values() if h[0] == f.path), None)
            if hit is not None and not self._same(f, *hit):
                hit = None  # its inode was freed and reused: another file
            if hit is None:
                if f.fh is not None:
                    kept.append(f)  # renamed out of the pattern: read on through the handle
                elif f.done:
                    log.info("finished input %s is gone", f.describe())
                else:
                    changed = changed or not f.gone
                    f.gone = True
                    kept.append(f)
                continue
            path, st = hit
            del found[(st.st_dev, st.st_ino)]
            if path != f.path:
                log.info("input %s was renamed to %s", f.path, path)
                f.path = path
            f.dev, f.ino, f.gone = st.st_dev, st.st_ino, False
            f.seen = (st.st_size, st.st_mtime_ns)
            if f.done and st.st_size > f.offset:
                log.warning("%s grew after a later file appeared; reading it again", f.describe())
                f.done = False
                changed = True
            kept.append(f)
        for path, st in sorted(found.values(), key=lambda h: (h[1].st_mtime_ns, str(h[0]))):
            f = _File(path)
            f.dev, f.ino = st.st_dev, st.st_ino
            f.seen = (st.st_size, st.st_mtime_ns)
            kept.append(f)
            changed = True
        self._files = kept
        return changed

    def _same(self, f: _File, path: Path, st: os.stat_result) -> bool:
        """Whether the file at `path` is the tracked `f`; re-checked whenever it changed."""
        if f.fh is not None or f.offset == 0:
            return True  # held open (its inode cannot be reused), or nothing read from it yet
        if f.seen == (st.st_size, st.st_mtime_ns) and path == f.path:
            return True
        opened = _open_checked(path)
        if opened is None:
            return False
        fh, now = opened
        try:
            return f.differs(fh, now) is None
        finally:
            fh.close()

    # -- reading ---------------------------------------------------------------------------

    def _gone(self, i: int) -> Record:
        f = self._files.pop(i)
        self._cur = None

        def undo() -> None:
            self._files.insert(i, f)
            self._cur = None

        self._undo = undo
        return Record(
            f.line,
            error=(
                f"input file {f.describe()} is gone or no longer matches {self.pattern!r}, and "
                f"it was not read to its end; its remaining lines cannot be read. Make the "
                f"pattern match rotated names too (e.g. 'logs/app.jsonl*') and run again, or "
                f"{SKIP_BAD_INPUT} to go on without them"
            ),
        )

    def next_record(self) -> Record | None:
        if not self._scanned:
            self._scan()
        while True:
            i = self._cur
            if i is None or self._files[i].done:
                i = self._cur = next((i for i, f in enumerate(self._files) if not f.done), None)
            if i is None:
                if self._scan():
                    continue
                return None
            f = self._files[i]
            if f.gone:
                return self._gone(i)
            last = i == len(self._files) - 1
            if f.fh is None:
                opened = _open_checked(f.path)
                if opened is None or not self._same(f, f.path, opened[1]):
                    if opened is not None:
                        opened[0].close()
                    self._scan()  # moved (found again by identity) or gone
                    continue
                f.attach(*opened)
            raw = f.readline(partial_ok=not self.follow or not last)
            if raw is None:
                if not last:
                    f.done = True
                    f.close()
                    continue
                if self._scan():
                    continue
                return None
            start, line = f.offset, f.line
            f.offset += len(raw)
            f.line += 1
            rec = _parse(raw, f.line, f.path, self.key_field)
            if rec is not None:
                self._undo = lambda f=f, start=start, line=line: f.rewind(start, line)
                return rec

    def unread(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def close(self) -> None:
        for f in self._files:
            f.close()


def _item_digest(value: Any) -> str:
    """Names one input item of an iterable, to tell the same list from an edited one: the
    same in every process (canonical bytes: a set's order does not depend on the hash seed)."""
    try:
        raw = codec.encode_canonical(value)
    except (CodecError, TypeError, ValueError, RecursionError):  # a bad item: by its type
        raw = f"unstorable {type(value).__module__}.{type(value).__qualname__}".encode()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


class IterableSource(Source):
    """A Python iterable of dicts. It must yield the same items in the same order on restart:
    the position names the first and the last item taken (digests), and a restart whose
    iterable differs there is refused (an edited list was taken for the one it replaced)."""

    def __init__(self, items: Iterable[Any], key_field: str = "key") -> None:
        self._items = items
        self._it: Iterator[Any] | None = None
        self.key_field = key_field
        self._index = 0
        self._first: str | None = None  # the first item's digest, made when it is read
        self._last: Any = _END  # the last two items taken (`unread` steps back)
        self._before_last: Any = _END
        self._expect: dict[str, str] = {}

    def restore(self, position: dict[str, Any]) -> None:
        if position and "index" not in position:
            raise ConfigError(
                f"this state directory read its inputs {_kind_of(position)}, not from a Python "
                f"iterable; pass the same input as before, or use a new state_dir"
            )
        self._index = int(position.get("index", 0))
        self._expect = {k: v for k, v in position.items() if k in ("first", "last")}

    def unread(self) -> None:
        # The iterator cannot step back; the position can, so a restart yields the item again.
        self._index -= 1
        self._last = self._before_last

    def position(self) -> dict[str, Any]:
        pos: dict[str, Any] = {"index": self._index}
        if self._index and self._first is not None and self._last is not _END:
            pos["first"] = self._first
            pos["last"] = _item_digest(self._last)  # at a checkpoint, not per item
        return pos

    def _changed(self, which: str, number: int, digest: str) -> None:
        if which in self._expect and digest != self._expect[which]:
            raise ConfigError(
                f"the inputs differ from the ones this state read: item {number} is not the "
                f"item it took there ({self._index} were taken); pass the same items first and "
                f"append new ones after them, or use a new state_dir"
            )

    def next_record(self) -> Record | None:
        if self._it is None:
            self._it = iter(self._items)
            for n in range(self._index):
                value = next(self._it, _END)
                if value is _END:
                    raise BadInputError(
                        f"the input iterable has fewer items than the checkpointed position {self._index}"
                    )
                if n == 0:
                    self._first = _item_digest(value)
                    self._changed("first", 1, self._first)
                if n == self._index - 1:
                    self._last = value
                    self._changed("last", self._index, _item_digest(value))
        value = next(self._it, _END)
        if value is _END:
            return None
        self._index += 1
        if self._first is None:
            self._first = _item_digest(value)
        self._before_last, self._last = self._last, value
        where = f"input item {self._index}"
        key, err = _key_of(value, self.key_field, where)
        if err:
            return Record(self._index, error=err)
        try:
            # A JSONL line is JSON, always storable; a Python object in an iterable may not be:
            # bad input here, named, not a checkpoint that fails until the job stops.
            codec.check_admissible(value, where)
        except CodecError as exc:
            return Record(self._index, error=str(exc))
        if _too_deep(value):
            return Record(self._index, error=_TOO_DEEP.format(where=where))
        return Record(self._index, key=key, value=value)


_END = object()


# -- the job ---------------------------------------------------------------------------------------

JOB_FILE = "job.json"
_JOB_FORMAT = 1


@dataclass(frozen=True, slots=True)
class JobIdentity:
    """The job a state directory belongs to: made once, with the state, kept in `job.json`.

    `legacy_outputs`: the state is older than job ids, so output lines without a job id are
    this job's own (a state created with its id never claims them).
    """

    id: str
    state_dir: Path
    legacy_outputs: bool = False


def job_identity(
    state_dir: str | os.PathLike[str],
    *,
    has_history: bool,
    clock: Clock = SYSTEM_CLOCK,
    rng: random.Random | None = None,
) -> JobIdentity:
    """The job of `state_dir`; made (and written atomically) if it has none yet.

    `has_history`: the state already completed checkpoints, so it was made by a ratchet
    without job ids (its outputs carry none).
    """
    sdir = Path(state_dir)
    path = sdir / JOB_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        ident = f"{rng.getrandbits(64):016x}" if rng is not None else os.urandom(8).hex()
        job = JobIdentity(ident, sdir, legacy_outputs=has_history)
        atomic_json(
            path,
            {
                "format": _JOB_FORMAT,
                "job": job.id,
                "created": clock.now(),
                "legacy_outputs": job.legacy_outputs,
            },
        )
        return job
    except (OSError, ValueError) as exc:
        raise StateError(
            f'{path} is not a ratchet job file ({exc}); restore it (its job id is the "job" '
            f"field of this job's output lines), or use a new --state directory"
        ) from exc
    newer = newer_job_format(data)
    if newer is not None:
        raise StateError(f"{path} {newer}")
    if (
        not isinstance(data, dict)
        or data.get("format") != _JOB_FORMAT
        or not isinstance(data.get("job"), str)
        or not data["job"]
        or not isinstance(data.get("legacy_outputs"), bool)
    ):
        raise StateError(
            f'{path} is not a ratchet job file (format {_JOB_FORMAT} with a "job" id and '
            f'"legacy_outputs"); restore it, or use a new --state directory'
        )
    return JobIdentity(data["job"], sdir, data["legacy_outputs"])


def newer_job_format(data: Any) -> str | None:
    """What to say of a job file written by a newer ratchet (a format above this one's), or
    None: not damage to restore, but a state this version must not run or copy."""
    if not isinstance(data, dict):
        return None
    fmt = data.get("format")
    if type(fmt) is not int or fmt <= _JOB_FORMAT:
        return None
    return (
        f"was written by a newer ratchet (job file format {fmt}; this version reads format "
        f"{_JOB_FORMAT}): use that ratchet version (or newer) with this state directory"
    )


# -- outputs ---------------------------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, _dt.datetime | _dt.date | _dt.time):
        return value.isoformat()
    if isinstance(value, _dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return repr(value)


# What json.dumps(record, default=_json_default, ensure_ascii=False, separators=(",", ":"),
# allow_nan=False) builds for every call, made once (an encoder keeps no state between calls).
# NaN and Infinity are refused: written as they are they are not JSON, and a standard reader
# of the output fails on the line (`_json_problem` says where the value is).
_ENCODER = json.JSONEncoder(
    default=_json_default, ensure_ascii=False, separators=(",", ":"), allow_nan=False
)


def to_json_line(record: dict[str, Any]) -> str:
    """One output as one JSON line; bytes become {"$bytes": base64}, sets become lists.

    A str holding a lone surrogate (what a JSON input's "\\ud800" escape gives) has no UTF-8
    form: refused here (UnicodeEncodeError), so a sink's `validate` puts an error record in
    its place, instead of a write that fails at every release and holds back every output."""
    line: str = _ENCODER.encode(record)
    if not line.isascii():
        line.encode("utf-8")
    return line


_ASCII_ENCODER = json.JSONEncoder(
    default=_json_default, ensure_ascii=True, separators=(",", ":"), allow_nan=False
)


def to_json_text(record: dict[str, Any]) -> str:
    """`to_json_line` for what a command prints (`inspect --json`): a lone surrogate, which
    has no UTF-8 form, is printed as its JSON escape (the value is shown, not refused)."""
    try:
        return to_json_line(record)
    except UnicodeEncodeError:
        text: str = _ASCII_ENCODER.encode(record)
        return text


_JSON_KEYS = (str, int, float, bool, type(None))


def _json_problem(record: dict[str, Any], exc: BaseException) -> str:
    """Where a record that `to_json_line` refused goes wrong, in words."""
    if isinstance(exc, RecursionError):
        return "the output is nested too deeply to write as JSON; flatten it"
    stack: list[tuple[str, Any, frozenset[int]]] = [("output", record.get("output"), frozenset())]
    while stack:
        where, value, outer = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return (
                f"{where} is {value!r}, and JSON has no NaN or Infinity; write None or a "
                f"string (e.g. 'NaN') instead"
            )
        if isinstance(value, str) and _lone_surrogate(value):
            return (
                f"{where} holds a lone surrogate ({_lone_surrogate(value)}, as a JSON input's "
                f"\\u escape of half a pair gives), which UTF-8 cannot hold; pass text, or "
                f"bytes for binary data"
            )
        if not isinstance(value, dict | list | tuple):
            continue
        if id(value) in outer:
            return f"{where} contains itself (a circular reference); JSON cannot hold that"
        inner = outer | {id(value)}
        if isinstance(value, dict):
            for k in value:
                if isinstance(k, str) and _lone_surrogate(k):
                    return (
                        f"{where} has a key holding a lone surrogate ({_lone_surrogate(k)}), "
                        f"which UTF-8 cannot hold"
                    )
                if not isinstance(k, _JSON_KEYS):
                    return (
                        f"{where} has a key {k!r} of type {type(k).__name__}; JSON object keys "
                        f"must be str, int, float, bool or None (use a string key, or a list "
                        f"of pairs)"
                    )
            stack.extend((f"{where}[{k!r}]", v, inner) for k, v in reversed(value.items()))
        else:
            stack.extend((f"{where}[{i}]", v, inner) for i, v in reversed(list(enumerate(value))))
    return f"it cannot be written as JSON: {type(exc).__name__}: {exc}"


def _lone_surrogate(text: str) -> str | None:
    """The first lone surrogate in `text` as an escape (e.g. '\\ud800'), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"\\u{ord(text[exc.start]):04x}"
    return None


_CODEC_ERROR = f"{CodecError.__module__}.{CodecError.__qualname__}"


def unwritable_record(record: dict[str, Any], problem: str) -> dict[str, Any]:
    """What is written in place of an output the sink cannot write: an error record with the
    same id (so it is deterministic, and deduplicated like any output)."""
    task = record.get("task")
    action = task.rsplit(">", 1)[-1] if isinstance(task, str) and ">" in task else None
    return {
        "id": record["id"],
        "key": record.get("key"),
        "seq": record.get("seq"),
        "task": task,
        "output": None,
        "error": {
            "action": action,
            "type": _CODEC_ERROR,
            "message": f"the output was not written: {problem}",
            "event_type": None,
        },
    }


def _error_in_place(
    record: dict[str, Any], problem: str, can_write: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """The error record written instead of an output that cannot be (its key as text if even
    the key cannot be written)."""
    log.warning("output %s cannot be written: %s", record.get("id"), problem)
    error = unwritable_record(record, problem)
    key = error["key"]
    for text in (str(key), repr(key)):  # `a`, not `'a'`; repr escapes what str cannot hold
        if can_write(error):
            break
        error["key"] = text
    return error


def _json_ok(record: dict[str, Any]) -> bool:
    try:
        to_json_line(record)
    except Exception:  # noqa: BLE001 - whatever fails, the record cannot be written
        return False
    return True


def json_line_or_error(record: dict[str, Any]) -> str:
    """The output's JSON line, or, for one JSON cannot hold, the line of its error record:
    what an engine that writes lines itself (the Flink engine's file sink) emits."""
    try:
        return to_json_line(record)
    except Exception as exc:  # noqa: BLE001 - whatever fails (a __repr__ too) is the reason
        return to_json_line(_error_in_place(record, _json_problem(record, exc), _json_ok))


def writable(sink: Sink, records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """`records` as `sink` is given them: each one it cannot write replaced, in its place, by
    an error record; and the keys of those replaced. The same records give the same result,
    so outputs restored from the outbox after a crash are replaced in the same way."""
    checked: list[dict[str, Any]] = []
    refused: list[Any] = []
    for rec in records:
        problem = sink.validate(rec)
        if problem is not None:
            refused.append(rec.get("key"))
            rec = _error_in_place(rec, problem, lambda r: sink.validate(r) is None)
        checked.append(rec)
    return checked, refused


_ID_PREFIX = '{"id":'
_JOB_NEXT = ',"job":'
_KEY_NEXT = ',"key":'
_decoder = json.JSONDecoder()
# A whole output line as ratchet writes it: an id and a job id without escapes or control
# characters (then their text is the bytes between the quotes), then the rest of the record.
_PLAIN_LINE = re.compile(
    rb'^\{"id":"([^"\\\x00-\x1f]*)","job":"([^"\\\x00-\x1f]*)",[^\n]*\n', re.MULTILINE
)
_RECOVER_BLOCK = 1 << 22


def _torn_line(tail: bytes) -> bool:
    """Whether an unterminated last line is the start of a ratchet output line that a crash
    cut short: it begins as ratchet begins every line (or is a start of that) and is not
    a whole JSON value; or it is only NUL bytes (what a file system may show of a write
    that was not synced when the machine stopped)."""
    if not tail.strip(b"\0"):
        return True  # a crash between a write and its fsync can leave the new end zeroed
    start = b'{"id":"'
    if not (tail.startswith(start) or start.startswith(tail)):
        return False
    try:
        json.loads(tail)
    except ValueError:
        return True
    return False


def _cut_id(tail: bytes) -> tuple[str, bool]:
    """The id a cut last line begins with (unescaped, as the outbox holds it), and whether
    all of it is there."""
    body = tail[len(b'{"id":"') :]
    end = _ID_END.search(body)
    raw = body[: end.end() - 1] if end is not None else _whole_escapes(body)
    raw = raw.decode("utf-8", "ignore").encode()  # a character cut in its bytes: gone
    try:
        text = json.loads(b'"' + raw + b'"')
    except ValueError:
        text = raw.decode("utf-8", "replace")
    return str(text), end is not None


def _whole_escapes(raw: bytes) -> bytes:
    """`raw` without an escape cut short at its end (a lone backslash, or `\\u` and fewer
    than four hex digits after an unescaped backslash)."""
    m = _PART_ESCAPE.search(raw)
    return raw if m is None else raw[: m.start(1)]


# The closing quote of a JSON string (an unescaped one: after an even number of backslashes),
# and an escape cut short at the end of a cut line (group 1).
_ID_END = re.compile(rb'(?<!\\)(?:\\\\)*"')
_PART_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*(\\(?:u[0-9a-fA-F]{0,3})?)$")


def _line_id(raw: bytes) -> tuple[str, str | None]:
    """The id and job id of an output line. ratchet writes them first, so only those two
    strings are decoded; a line written some other way is read whole."""
    text = raw.decode("utf-8")
    if text.startswith(_ID_PREFIX):
        try:
            value, end = _decoder.raw_decode(text, len(_ID_PREFIX))
            if isinstance(value, str):
                if text.startswith(_JOB_NEXT, end):
                    at = end + len(_JOB_NEXT)
                    close = text.find('"', at + 1)
                    if text[at] == '"' and close > at and "\\" not in text[at:close]:
                        return value, text[at + 1 : close]  # a job id is plain hex
                    job, _ = _decoder.raw_decode(text, at)
                    if isinstance(job, str):
                        return value, job
                elif text.startswith(_KEY_NEXT, end):
                    return value, None
        except ValueError:
            pass  # not laid out as ratchet writes it: read it whole
    whole = json.loads(text)
    job = whole.get("job")
    return str(whole["id"]), job if isinstance(job, str) else None


def check_output_path(output: str | os.PathLike[str]) -> None:
    """Refuse an output path that cannot be a writable file (a directory, a path under a file,
    a place that cannot be written), creating nothing."""
    path = Path(output)
    where = f"--output {path}"
    try:
        if path.is_dir():
            raise ConfigError(
                f"{where} is a directory; name a file in it, e.g. {path / 'out.jsonl'}"
            )
        if path.exists():
            if not path.is_file():
                raise ConfigError(f"{where} is not a regular file; name a JSON Lines file")
            with open(path, "ab"):
                return
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise ConfigError(f"{where} cannot be created: {parent} is a file, not a directory")
        with tempfile.TemporaryFile(dir=parent):
            return
    except OSError as exc:
        raise ConfigError(
            f"{where} cannot be written ({exc.strerror or exc}); choose a file in a place "
            f"you can write to"
        ) from exc


def refuse_output_read_as_input(inputs: Any, output: Any) -> None:
    """An output file that the input also reads feeds every output back in as a new input:
    each run (or, with --follow, each output) adds more work, billed calls included.
    `inputs` and `output` as given to `ratchet run` (anything but paths passes)."""
    if not isinstance(inputs, str | os.PathLike) or not isinstance(output, str | os.PathLike):
        return
    text = os.fspath(inputs)
    if "://" in text or "://" in os.fspath(output):
        return  # a connector's URI
    out = Path(output)
    path = Path(text)
    if path.is_dir() or (glob.has_magic(text) and not path.is_file()):
        hit, also = _glob_matches(files_pattern(text), out), "is one of the files it matches"
    else:
        hit, also = _same_path(out, path), "is that same file"
    if hit:
        raise ConfigError(
            f"--output {os.fspath(output)} {also} (--input {text}): every output would be "
            f"read back as a new input. Write the output outside the input's files (another "
            f"directory, or a name the pattern does not match)"
        )


def _same_path(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return os.path.abspath(a) == os.path.abspath(b)


def _real_pattern_parts(pattern: str) -> tuple[str, ...]:
    """A pattern's parts with its literal folders resolved (symlinks, `..`), the wildcard
    parts kept as they are."""
    parts = Path(os.path.abspath(pattern)).parts
    first = next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))
    literal = os.path.realpath(os.path.join(*parts[:first])) if first else os.sep
    return Path(literal).parts + parts[first:]


def _glob_matches(pattern: str, path: Path) -> bool:
    """Whether `glob.glob(pattern)` lists `path`, also before `path` exists (one component at
    a time, as glob matches: a wildcard does not match a leading dot, nor a '/')."""
    if path.exists():
        try:
            st = os.stat(path)
            for name in glob.glob(pattern):
                if os.path.samefile(name, path) or os.stat(name) == st:
                    return True
        except OSError:
            pass
    pat = _real_pattern_parts(pattern)
    have = Path(os.path.realpath(path)).parts  # symlinked folders by what they point at
    if len(pat) != len(have):
        return False
    for p, name in zip(pat, have, strict=True):
        if not glob.has_magic(p):
            if p != name:
                return False
        elif (name.startswith(".") and not p.startswith(".")) or not fnmatch.fnmatchcase(name, p):
            return False
    return True


class Sink:
    """Receives outputs after the checkpoint holding them completed."""

    def holds_outputs_of(self, job: JobIdentity) -> bool | None:
        """Whether the sink holds outputs `job` wrote, after `open`; None: it cannot tell.
        A state that has completed no checkpoint cannot have released any."""
        return None

    def holds_outputs_where(self, job: JobIdentity, keep: Callable[[str], bool]) -> bool | None:
        """Whether the sink holds an output of `job` whose id `keep` accepts (a sharded job
        asks about the outputs of one shard's keys); None: it cannot tell."""
        return None

    def describe(self) -> str:
        return type(self).__name__

    def open(self, job: JobIdentity | None) -> None:
        """Called by `Job` before the first write, with the job of the state directory."""

    def validate(self, record: dict[str, Any]) -> str | None:
        """None if this sink can write `record`; otherwise why not, in words. The engine
        writes an error record in its place, so one bad output never holds back others."""
        return None

    def write(self, records: list[dict[str, Any]]) -> int | None:
        """Write `records`; return how many it wrote now, those it already held (an id sent
        again after a crash) left out, so the engine counts each output once. None: this
        sink cannot tell, and every record given is counted."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def output_line(record: dict[str, Any], job: str | None) -> str:
    """One output as the JSONL sink writes it: "id", then "job" (when bound to one) first."""
    if job is not None:
        record = {"id": record["id"], "job": job, **record}
    return to_json_line(record) + "\n"


def line_problem(record: dict[str, Any], exc: Exception) -> str:
    """Why `output_line` failed for `record`, as the JSONL sink's `validate` says it."""
    return _json_problem(record, exc)


class JsonlSink(Sink):
    """Appends one line per output and never writes an id twice, even after a crash.

    Each line carries the job id ("job", after "id"). A file that holds another job's
    outputs is refused unless `append=True` (`--append-output`): a new job repeats the ids
    of the earlier one, and its outputs must not be dropped as duplicates, nor mixed in
    unnoticed. Opened (read, checked, repaired) by `open()`; the constructor only checks
    that the path can be a writable file, creating nothing.
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self.path = Path(path)
        self.append = append
        check_output_path(self.path)
        self._ids: set[str] = set()
        self._job: str | None = None
        self._identity: JobIdentity | None = None
        self._fh: IO[bytes] | None = None
        self._checked: dict[str, tuple[dict[str, Any], str]] = {}
        self._cut_back: int | None = None  # a failed append's start, not yet cut back to

    def open(self, job: JobIdentity | None) -> None:
        if self._fh is not None:
            return
        self._identity = job
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(self.path, "ab")  # noqa: SIM115 - the sink's lifetime
        except OSError as exc:
            raise ConfigError(f"--output {self.path} cannot be written: {exc}") from exc
        try:
            _hold_exclusively(fh, self.path)
            self._recover(job)
        except OSError as exc:
            fh.close()
            raise ConfigError(f"--output {self.path} cannot be written: {exc}") from exc
        except BaseException:
            fh.close()
            raise
        self._fh = fh
        self._job = job.id if job is not None else None

    def holds_outputs_of(self, job: JobIdentity) -> bool | None:
        return bool(self._ids) and self._job == job.id

    def holds_outputs_where(self, job: JobIdentity, keep: Callable[[str], bool]) -> bool | None:
        return self._job == job.id and any(keep(i) for i in self._ids)

    def describe(self) -> str:
        return f"--output {self.path}"

    # The id (and whether it is whole) of the cut last line `_recover` dropped: the engine
    # tells whether its output is still to be written (a crash cut it) or was lost.
    cut: tuple[str, bool] | None = None

    def _recover(self, job: JobIdentity | None) -> None:
        if not self.path.exists():
            return
        keep = mine = 0
        others: dict[str | None, int] = {}
        tail = b""
        with open(self.path, "rb") as fh:
            while block := fh.read(_RECOVER_BLOCK):
                data = tail + block
                end = data.rfind(b"\n") + 1
                tail = data[end:]  # what follows the last newline: see below
                if end:
                    keep += end
                    mine += self._read_lines(data[:end], job, others)
        # A last line without its newline is a ratchet line a crash cut (dropped: its job
        # writes it again), or a whole line that only lacks the newline (kept, and ended).
        # Anything else is not ratchet's to cut: refused, as any other foreign line is.
        end_it = bool(tail) and not _torn_line(tail)
        if tail and not end_it and tail.strip(b"\0"):
            self.cut = _cut_id(tail)
        if end_it:
            mine += self._read_lines(tail + b"\n", job, others)  # refuses a foreign line
            keep += len(tail)
        if others and not mine and not self.append:
            assert job is not None
            raise ConfigError(self._refusal(job, others))
        if end_it:
            with open(self.path, "ab") as fh:
                fh.write(b"\n")
        elif keep != self.path.stat().st_size:
            with open(self.path, "r+b") as fh:
                fh.truncate(keep)

    def _read_lines(
        self, lines: bytes, job: JobIdentity | None, others: dict[str | None, int]
    ) -> int:
        """Take the ids of whole lines into `_ids` (this job's) or `others`; how many were
        this job's. Lines laid out as ratchet writes them (id, then a plain job id) are read
        by one regular expression over the block (a restart reads every line of the output
        file: at 10,000 lines, a line at a time was most of the sink's start); a block with
        any other line is read a line at a time."""
        found = _PLAIN_LINE.findall(lines)
        if found and len(found) == lines.count(b"\n"):
            try:
                # One decode per block, not one per line (opening a 10,000-line file: 5.7 ->
                # 5.2 ms): no id holds a newline (the pattern takes no control character),
                # so joining them with one and splitting gives each back, and the joined
                # bytes decode exactly when every id does.
                ids = b"\n".join([i for i, _j in found]).decode("utf-8").split("\n")
                jobs = b"\n".join([j for _i, j in found]).decode("ascii").split("\n")
            except UnicodeDecodeError:
                pass  # the line-by-line reading below names the line's problem
            else:
                if job is None:
                    self._ids.update(ids)
                    return len(ids)
                mine = [i for i, j in zip(ids, jobs) if j == job.id]
                self._ids.update(mine)
                if len(mine) < len(ids):
                    for j in jobs:
                        if j != job.id:
                            others[j] = others.get(j, 0) + 1
                return len(mine)
        mine_n = 0
        for raw in lines.split(b"\n")[:-1]:
            try:
                out_id, line_job = _line_id(raw)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ConfigError(
                    f"--output {self.path} has a line that is not a ratchet output ({exc}); "
                    f"use a new output file"
                ) from exc
            if job is None or line_job == job.id or (line_job is None and job.legacy_outputs):
                self._ids.add(out_id)
                mine_n += 1
            else:
                others[line_job] = others.get(line_job, 0) + 1
        return mine_n

    def _refusal(self, job: JobIdentity, others: dict[str | None, int]) -> str:
        held = ", ".join(
            f"{n} output(s) of job {j}"
            if j is not None
            else f"{n} output(s) of an earlier job (lines without a job id, written by a "
            f"ratchet older than job ids)"
            for j, n in others.items()
        )
        resume = next(
            (f"the --state directory of job {j} to resume that job" for j in others if j),
            "the state directory that wrote them",
        )
        return (
            f"--output {self.path} holds {held}, and the state directory {job.state_dir} is job "
            f"{job.id}: a new job repeats the earlier one's output ids, so its outputs would be "
            f"taken for duplicates or mixed in unnoticed. Write to a new --output file, pass "
            f"--append-output (append_output=True) to add this job's outputs after them (each "
            f'line\'s "job" tells them apart), or pass {resume}'
        )

    @property
    def job_id(self) -> str | None:
        """The job id its lines carry (known once opened)."""
        return self._job

    def _line(self, record: dict[str, Any]) -> str:
        return output_line(record, self._job)

    def write_lines(self, lines: list[tuple[str, str]]) -> int:
        """(id, line) pairs rendered elsewhere by `output_line` for this job (by the shard
        workers of a job run with --workers N, so the coordinator does not decode and encode
        every output): written as `write` writes records, each id once; returns how many
        lines it appended."""
        if self._fh is None:
            self.open(self._identity)
        assert self._fh is not None
        new = [(i, line) for i, line in lines if i not in self._ids]
        if not new:
            return 0
        self._append("".join(line for _i, line in new).encode("utf-8"))
        self._ids.update(i for i, _line in new)
        return len(new)

    def validate(self, record: dict[str, Any]) -> str | None:
        try:
            line = self._line(record)
        except Exception as exc:  # noqa: BLE001 - whatever fails (a __repr__ too) is the reason
            return _json_problem(record, exc)
        self._checked[record["id"]] = (record, line)  # so write() does not encode it again
        return None

    def write(self, records: list[dict[str, Any]]) -> int:
        if self._fh is None:
            # Without a Job (an Engine built by hand) it is bound to none; after a failed
            # reopen (`_follow_the_path`), to the job it was opened for.
            self.open(self._identity)
        assert self._fh is not None
        checked, self._checked = self._checked, {}
        lines = []
        for rec in records:
            if rec["id"] in self._ids:
                continue  # in the file already: written before a crash, released again
            hit = checked.get(rec["id"])
            lines.append(hit[1] if hit is not None and hit[0] is rec else self._line(rec))
        if not lines:
            return 0
        self._append("".join(lines).encode("utf-8"))
        for rec in records:
            self._ids.add(rec["id"])
        return len(lines)

    def _append(self, data: bytes) -> None:
        """Append `data` and sync it, whole or not at all. A write that fails part way (a
        full disk) leaves lines and part of one in the file, which the release's retry would
        follow with the whole batch again: ids twice and a broken line. So the file is cut
        back to where the write began, before the error goes on (or before the next write,
        if even the cut failed). A file moved away or deleted since the last write (a
        rotated output) is followed by a new one at the path, not written on unseen."""
        self._follow_the_path()
        assert self._fh is not None
        fd = self._fh.fileno()
        if self._cut_back is not None:
            os.ftruncate(fd, self._cut_back)  # raises while it cannot: nothing is appended
            self._cut_back = None
        start = os.fstat(fd).st_size  # the only writer: the file is locked
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            self._cut_back = start
            try:
                os.ftruncate(fd, start)
                self._cut_back = None
            except OSError as exc:
                log.warning("--output %s: could not cut a failed write back: %s", self.path, exc)
            raise

    def _follow_the_path(self) -> None:
        """Reopen the output when its path no longer names the open file: it was moved away
        or deleted (log rotation, a cleanup) while the job ran. Outputs written to the open
        file would be lost unseen; they go to a new file at the path (checked as at start:
        a file put there that holds another job's outputs is refused)."""
        assert self._fh is not None
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            at_path = None
        here = os.fstat(self._fh.fileno())
        if at_path is not None and (at_path.st_dev, at_path.st_ino) == (here.st_dev, here.st_ino):
            return
        log.warning(
            "--output %s was %s while the job ran; writing on in %s",
            self.path, "deleted or moved away" if at_path is None else "replaced",
            "a new file there" if at_path is None else "the file now there",
        )  # fmt: skip
        self._fh.close()
        self._fh = None
        self._ids = set()
        self._cut_back = None
        self.open(self._identity)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _hold_exclusively(fh: IO[bytes], path: Path) -> None:
    """Lock the output file for as long as `fh` is open (released by the OS when the process
    ends, `kill -9` too): one job at a time writes an output file. A second writer would
    interleave with the first, and its opening repair (cutting a line a crash left half
    written) could cut a line the first is writing. Where the file system has no such lock
    (some network file systems), the file is used without one."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _flock_holder(fh.fileno())
        raise ConfigError(
            f"--output {path} is being written by another running job"
            + (f" (process {holder})" if holder else "")
            + ": one job at a time writes an output file. Wait for it to end, stop it, or "
            "write to another --output file"
        ) from None
    except OSError as exc:
        log.debug("--output %s: no file lock on this file system (%s)", path, exc)


_PROC_LOCKS = "/proc/locks"


def _flock_holder(fd: int) -> int | None:
    """The process holding a `flock` on the file open as `fd` (Linux: `/proc/locks`, then
    that process's open files). `/proc/locks` prints the file system's device, which on btrfs
    is not the one `stat` gives, so a line is matched by its inode and confirmed by a
    descriptor of its process that is the same file."""
    st = os.fstat(fd)
    pids: list[int] = []
    try:
        with open(_PROC_LOCKS) as f:
            for line in f:  # "1: FLOCK  ADVISORY  WRITE 12345 fe:00:2163861 0 EOF"
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5].endswith(f":{st.st_ino}"):
                    pids.append(int(parts[4]))
    except (OSError, ValueError):
        return None
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                other = os.stat(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                return pid
    return pids[0] if len(pids) == 1 else None


class CallbackSink(Sink):
    """Calls `fn(record)` per output. After a crash an output may be delivered again with the
    same `id`; deduplicate on it if the callback's effect must happen once. Any value is
    accepted: the callback gets the output as the agent emitted it."""

    def __init__(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self._fn = fn

    def write(self, records: list[dict[str, Any]]) -> int:
        for rec in records:
            self._fn(rec)
        return len(records)  # no de-duplication: a redelivery is delivered, and counted
