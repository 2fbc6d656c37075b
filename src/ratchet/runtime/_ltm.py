"""The embedded engine's long-term memory index: committed memories by scope, searchable.

Memories live in the state database (table `ltm`, written with the checkpoint that completes the
run that added them). This index holds each scope the job has searched in memory as unit-length
float32 vectors, loaded on first use and kept current from the writer thread right after each
checkpoint commits, so a search never sees half a checkpoint. The search is exact (cosine
similarity over every vector of the scope, numpy); sqlite-vec would need SQLite extension
loading, which Python's `sqlite3` module is often built without (it is here), so ratchet does
not depend on it. Ties are broken by id: the same state and query give the same answer.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ratchet._errors import ConfigError, InvalidArgumentError
from ratchet.runtime._memops import LTM_ADD, LTM_DELETE
from ratchet.store import codec

log = logging.getLogger("ratchet.ltm")

NUMPY_MISSING = "long-term memory needs numpy for its vector search: pip install 'ratchet[memory]'"


def numpy() -> Any:
    try:
        import numpy as np
    except ImportError as exc:  # pragma: no cover - numpy is in the dev extra
        raise ConfigError(NUMPY_MISSING) from exc
    return np


def unit_vector(values: Iterable[float]) -> Any:
    """A float32 vector scaled to length 1 (cosine similarity is then a dot product)."""
    np = numpy()
    v = np.asarray(list(values), dtype=np.float32)
    if v.ndim != 1 or v.size == 0:
        raise InvalidArgumentError("an embedding must be a non-empty list of numbers")
    if not np.all(np.isfinite(v)):
        raise InvalidArgumentError("an embedding holds NaN or infinite values")
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


@dataclass
class _Scope:
    dims: int | None = None
    ids: list[str] = field(default_factory=list)
    pos: dict[str, int] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)
    metas: list[dict[str, Any]] = field(default_factory=list)
    at: list[float] = field(default_factory=list)
    alive: list[bool] = field(default_factory=list)
    matrix: Any = None  # float32 rows; capacity doubles, rows past len(ids) unused
    dead: int = 0

    def put(self, ltm_id: str, text: str, meta: dict[str, Any], vector: Any, at: float) -> None:
        np = numpy()
        if self.dims is None:
            self.dims = int(vector.shape[0])
            self.matrix = np.zeros((64, self.dims), dtype=np.float32)
        if vector.shape[0] != self.dims:
            raise InvalidArgumentError(
                f"an embedding of {vector.shape[0]} dimensions in a long-term memory of "
                f"{self.dims}: one scope takes one embedding model"
            )
        i = self.pos.get(ltm_id)
        if i is None:
            i = len(self.ids)
            if i == self.matrix.shape[0]:
                grown = np.zeros((2 * i, self.dims), dtype=np.float32)
                grown[:i] = self.matrix
                self.matrix = grown
            self.ids.append(ltm_id)
            self.texts.append(text)
            self.metas.append(meta)
            self.at.append(at)
            self.alive.append(True)
            self.pos[ltm_id] = i
        else:
            if not self.alive[i]:
                self.dead -= 1
            self.texts[i], self.metas[i], self.at[i], self.alive[i] = text, meta, at, True
        self.matrix[i] = vector

    def drop(self, ltm_id: str) -> None:
        i = self.pos.get(ltm_id)
        if i is not None and self.alive[i]:
            self.alive[i] = False
            self.dead += 1


def _apply(s: _Scope, op: tuple[Any, ...]) -> None:
    if op[0] == LTM_ADD:
        s.put(op[2], op[3], op[4], numpy().frombuffer(op[5], numpy().float32), op[6])
    elif op[0] == LTM_DELETE:
        s.drop(op[2])


def item(ltm_id: str, text: str, meta: dict[str, Any], at: float) -> dict[str, Any]:
    # A copy of the metadata: a caller changing what it got must not change the index.
    return {"id": ltm_id, "text": text, "metadata": copy.deepcopy(meta), "added_at": at}


def _apply_or_skip(s: _Scope, op: tuple[Any, ...], scope: str) -> None:
    """Apply a committed write; one the scope cannot hold (a vector of another size, from
    before adds checked it) is left out with a warning rather than failing every read."""
    try:
        _apply(s, op)
    except InvalidArgumentError as exc:
        log.warning("long-term memory %r: memory %s left out: %s", scope, op[2], exc)


def _matches(meta: dict[str, Any], where: dict[str, Any] | None) -> bool:
    return where is None or all(k in meta and meta[k] == v for k, v in where.items())


class LongTermIndex:
    """Committed long-term memories, by scope (see the module doc). Thread-safe."""

    def __init__(
        self,
        load: Callable[[str], list[tuple[str, str, bytes, bytes, float]]],
        submit: Callable[[Callable[[], Any]], Future[Any]],
    ) -> None:
        # `load` runs through `submit` in the writer thread: the thread that applies commits.
        self._load = load
        self._submit = submit
        self._scopes: dict[str, _Scope] = {}
        self._lock = threading.Lock()
        # Writes of completed runs whose checkpoint has not committed yet, in completion order:
        # searched already (a completed run's writes are visible to the runs after it, as its
        # memory is), and laid over a scope when it is loaded from the database.
        self._overlay: collections.deque[tuple[Any, ...]] = collections.deque()

    # -- the writer thread ------------------------------------------------------------------

    def _ensure(self, scope: str) -> _Scope:
        """In the writer thread: the scope, loaded from the database on first use."""
        with self._lock:
            found = self._scopes.get(scope)
        if found is not None:
            return found
        loaded = _Scope()
        for ltm_id, text, meta, vector, at in self._load(scope):
            # A stored row is applied as the add it was committed by.
            _apply_or_skip(
                loaded, (LTM_ADD, scope, ltm_id, text, codec.decode(meta), vector, at), scope
            )
        with self._lock:
            found = self._scopes.get(scope)
            if found is not None:
                return found
            for op in self._overlay:
                if op[1] == scope:
                    _apply_or_skip(loaded, op, scope)
            self._scopes[scope] = loaded
            return loaded

    def committed(self, count: int) -> None:
        """In the writer thread, right after a checkpoint holding the oldest `count` writes
        of the overlay committed: the database has them now."""
        with self._lock:
            for _ in range(min(count, len(self._overlay))):
                self._overlay.popleft()

    # -- the event loop's thread ------------------------------------------------------------

    def completed(self, ops: list[tuple[Any, ...]]) -> None:
        """Runs completed with these writes (LTM_ADD / LTM_DELETE ops), in order."""
        with self._lock:
            self._overlay.extend(ops)
            for op in ops:
                s = self._scopes.get(op[1])
                if s is not None:  # a scope not loaded yet gets it from the overlay
                    _apply_or_skip(s, op, op[1])

    # -- any thread -------------------------------------------------------------------------

    def scope(self, scope: str) -> _Scope:
        found: _Scope = self._submit(lambda: self._ensure(scope)).result()
        return found

    def dims(self, scope: str) -> int | None:
        """The size of the scope's embeddings (None: it holds none yet)."""
        s = self.scope(scope)
        with self._lock:
            return s.dims

    def search(
        self,
        scope: str,
        query: Any,
        k: int,
        where: dict[str, Any] | None,
        pending: list[tuple[Any, ...]],
    ) -> list[dict[str, Any]]:
        """The k memories of `scope` nearest to the unit vector `query` (highest cosine
        similarity first, ties by id), committed ones overlaid with this run's `pending`
        writes (LTM ops not committed yet)."""
        np = numpy()
        s = self.scope(scope)
        mine: dict[str, tuple[str, dict[str, Any], Any, float] | None] = {}
        for op in pending:
            if op[1] != scope:
                continue
            if op[0] == LTM_ADD:
                mine[op[2]] = (op[3], op[4], np.frombuffer(op[5], np.float32), op[6])
            elif op[0] == LTM_DELETE:
                mine[op[2]] = None
        scored: list[tuple[float, str, str, dict[str, Any], float]] = []
        with self._lock:
            n = len(s.ids)
            if n and s.dims is not None:
                if query.shape[0] != s.dims:
                    raise InvalidArgumentError(
                        f"a query embedding of {query.shape[0]} dimensions against a long-term "
                        f"memory of {s.dims}: one scope takes one embedding model"
                    )
                scores = s.matrix[:n] @ query
                mask = np.asarray(s.alive, dtype=bool)
                if where is not None or mine:
                    for i in range(n):
                        if mask[i] and (s.ids[i] in mine or not _matches(s.metas[i], where)):
                            mask[i] = False
                candidates = np.flatnonzero(mask)
                if candidates.size > k:
                    # Ties at the cut must resolve by id, so take every row scoring as high
                    # as the k-th, then sort those exactly.
                    part = scores[candidates]
                    kth = np.partition(part, part.size - k)[part.size - k]
                    candidates = candidates[part >= kth]
                for i in candidates.tolist():
                    scored.append((float(scores[i]), s.ids[i], s.texts[i], s.metas[i], s.at[i]))
        for ltm_id, entry in mine.items():
            if entry is not None and _matches(entry[1], where):
                text, meta, vector, at = entry
                if vector.shape[0] != query.shape[0]:
                    raise InvalidArgumentError(
                        "a query embedding and a memory of different dimensions: one scope "
                        "takes one embedding model"
                    )
                scored.append((float(vector @ query), ltm_id, text, meta, at))
        scored.sort(key=lambda r: (-r[0], r[1]))
        return [item(i, t, m, a) | {"score": sc} for sc, i, t, m, a in scored[:k]]

    def get(self, scope: str, ltm_id: str, pending: list[tuple[Any, ...]]) -> dict[str, Any] | None:
        for op in reversed(pending):
            if op[1] == scope and op[2] == ltm_id:
                return item(ltm_id, op[3], op[4], op[6]) if op[0] == LTM_ADD else None
        s = self.scope(scope)
        with self._lock:
            i = s.pos.get(ltm_id)
            if i is None or not s.alive[i]:
                return None
            return item(ltm_id, s.texts[i], s.metas[i], s.at[i])

    def count(self, scope: str, pending: list[tuple[Any, ...]]) -> int:
        s = self.scope(scope)
        present: dict[str, bool] = {}  # this run's last word on each id it wrote
        for op in pending:
            if op[1] == scope:
                present[op[2]] = op[0] == LTM_ADD
        with self._lock:
            n = len(s.ids) - s.dead
            for ltm_id, now in present.items():
                i = s.pos.get(ltm_id)
                was = i is not None and s.alive[i]
                n += int(now) - int(was)
        return n
