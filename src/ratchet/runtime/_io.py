"""Sources and sinks of the embedded engine: where inputs come from, where outputs go."""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import json
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ratchet._errors import BadInputError, ConfigError


@dataclass(slots=True)
class Record:
    """One input read from a source: its key and value, or why it is bad."""

    line: int
    key: Any = None
    value: Any = None
    error: str | None = None


class Source:
    """Yields records one at a time, so its position is exact at every checkpoint."""

    follow = False

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


def _key_of(value: Any, key_field: str, where: str) -> tuple[Any, str | None]:
    if not isinstance(value, dict):
        return None, f"{where}: expected a JSON object, got {type(value).__name__}"
    if key_field not in value:
        return None, f"{where}: missing key field {key_field!r}"
    key = value[key_field]
    if isinstance(key, bool) or not isinstance(key, str | int):
        return None, (
            f"{where}: key field {key_field!r} is {type(key).__name__}; keys must be strings or integers"
        )
    return key, None


class JsonlSource(Source):
    """A JSON Lines file; its byte offset is checkpointed. `follow=True` waits for new lines."""

    def __init__(
        self, path: str | os.PathLike[str], key_field: str = "key", follow: bool = False
    ) -> None:
        self.path = Path(path)
        self.key_field = key_field
        self.follow = follow
        if not self.path.exists() and not follow:
            raise ConfigError(f"--input {self.path} does not exist")
        self._fh: Any = None
        self._offset = 0
        self._line = 0
        self._prev = (0, 0)

    def unread(self) -> None:
        self._offset, self._line = self._prev
        if self._fh is not None:
            self._fh.seek(self._offset)

    def restore(self, position: dict[str, Any]) -> None:
        self._offset = int(position.get("offset", 0))
        self._line = int(position.get("line", 0))
        if self.path.exists() and self.path.stat().st_size < self._offset:
            raise BadInputError(
                f"{self.path} is shorter ({self.path.stat().st_size} bytes) than the checkpointed "
                f"read position ({self._offset}); the input file was replaced or truncated"
            )

    def position(self) -> dict[str, Any]:
        return {"offset": self._offset, "line": self._line, "path": str(self.path)}

    def _open(self) -> bool:
        if self._fh is None:
            if not self.path.exists():
                return False
            self._fh = open(self.path, "rb")  # noqa: SIM115 - kept open across reads
            self._fh.seek(self._offset)
        return True

    def next_record(self) -> Record | None:
        while True:
            if not self._open():
                return None
            fh = self._fh
            raw = fh.readline()
            if not raw:
                return None
            if not raw.endswith(b"\n"):
                if self.follow:
                    # A line still being written: read it again once it is whole.
                    fh.seek(self._offset)
                    return None
                if fh.read(1):
                    raise BadInputError(f"{self.path}: unexpected read state")
            self._prev = (self._offset, self._line)
            self._offset += len(raw)
            self._line += 1
            text = raw.strip()
            if not text:
                continue
            where = f"{self.path}:{self._line}"
            try:
                value = json.loads(text)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                return Record(self._line, error=f"{where}: invalid JSON ({exc})")
            key, err = _key_of(value, self.key_field, where)
            if err:
                return Record(self._line, error=err)
            return Record(self._line, key=key, value=value)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class IterableSource(Source):
    """A Python iterable of dicts. It must yield the same items in the same order on restart."""

    def __init__(self, items: Iterable[Any], key_field: str = "key") -> None:
        self._items = items
        self._it: Iterator[Any] | None = None
        self.key_field = key_field
        self._index = 0

    def restore(self, position: dict[str, Any]) -> None:
        self._index = int(position.get("index", 0))

    def unread(self) -> None:
        # The iterator cannot step back; the position can, so a restart yields the item again.
        self._index -= 1

    def position(self) -> dict[str, Any]:
        return {"index": self._index}

    def next_record(self) -> Record | None:
        if self._it is None:
            self._it = iter(self._items)
            for _ in range(self._index):
                if next(self._it, _END) is _END:
                    raise BadInputError(
                        f"the input iterable has fewer items than the checkpointed position {self._index}"
                    )
        value = next(self._it, _END)
        if value is _END:
            return None
        self._index += 1
        self._last = value
        key, err = _key_of(value, self.key_field, f"input item {self._index}")
        if err:
            return Record(self._index, error=err)
        return Record(self._index, key=key, value=value)


_END = object()


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


def to_json_line(record: dict[str, Any]) -> str:
    """One output as one JSON line; bytes become {"$bytes": base64}, sets become lists."""
    return json.dumps(record, default=_json_default, ensure_ascii=False, separators=(",", ":"))


_ID_PREFIX = b'{"id":'
_decoder = json.JSONDecoder()


def _line_id(raw: bytes) -> str:
    """The id of an output line; ratchet writes it first, so only that string is decoded."""
    if raw.startswith(_ID_PREFIX):
        value, _ = _decoder.raw_decode(raw.decode("utf-8"), len(_ID_PREFIX))
        if isinstance(value, str):
            return value
    return str(json.loads(raw)["id"])  # a line written some other way: read it whole


class Sink:
    """Receives outputs after the checkpoint holding them completed."""

    def write(self, records: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class JsonlSink(Sink):
    """Appends one line per output and never writes an id twice, even after a crash."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._ids: set[str] = set()
        self._recover()
        self._fh = open(self.path, "ab")  # noqa: SIM115 - the sink's lifetime

    def _recover(self) -> None:
        if not self.path.exists():
            return
        keep = 0
        with open(self.path, "rb") as fh:
            for raw in fh:
                if not raw.endswith(b"\n"):
                    break  # a line cut by a crash: dropped below and written again
                keep += len(raw)
                try:
                    self._ids.add(_line_id(raw))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ConfigError(
                        f"--output {self.path} has a line that is not a ratchet output ({exc}); "
                        f"use a new output file"
                    ) from exc
        if keep != self.path.stat().st_size:
            with open(self.path, "r+b") as fh:
                fh.truncate(keep)

    def write(self, records: list[dict[str, Any]]) -> None:
        lines = []
        for rec in records:
            if rec["id"] in self._ids:
                continue
            lines.append(to_json_line(rec) + "\n")
        if not lines:
            return
        self._fh.write("".join(lines).encode("utf-8"))
        self._fh.flush()
        os.fsync(self._fh.fileno())
        for rec in records:
            self._ids.add(rec["id"])

    def close(self) -> None:
        self._fh.close()


class CallbackSink(Sink):
    """Calls `fn(record)` per output. After a crash an output may be delivered again with the
    same `id`; deduplicate on it if the callback's effect must happen once."""

    def __init__(self, fn: Callable[[dict[str, Any]], None]) -> None:
        self._fn = fn

    def write(self, records: list[dict[str, Any]]) -> None:
        for rec in records:
            self._fn(rec)
