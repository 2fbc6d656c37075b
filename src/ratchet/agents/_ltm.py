"""Long-term memory: texts with metadata and embeddings, searched by meaning, per key or shared.

Durable the ratchet way (docs/runtime.md, "Long-term memory"):
- an add embeds its text through a durable call (a crash after the model answered never pays
  for it again) and records the write in the task's ops, so it is journaled with the task and
  written to the state with the checkpoint that completes the run, with the run's memory and
  outputs: never half an add, never two;
- a search or a get is a durable call too: after a crash the journal answers it with what it
  returned the first time, so a replayed run decides exactly as it did.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ratchet._errors import ConfigError, InvalidArgumentError, InvalidTypeError
from ratchet.runtime._memops import LTM_ADD, LTM_DELETE, LTM_OPS
from ratchet.store import codec

if TYPE_CHECKING:
    from ratchet.agents._context import RunnerContext
    from ratchet.runtime._ltm import LongTermIndex

_NOT_AVAILABLE = (
    "ctx.long_term_memory needs `long_term_memory = ratchet.LongTermMemoryConfig("
    "embedding=<an embedding model>)` on the agent class, and the embedded engine (the Flink "
    "engine has no long-term memory yet; docs/flink.md)"
)


class Embedder(Protocol):
    """What long-term memory needs of an embedding model (ratchet.agents.chat has several)."""

    def embed(self, texts: list[str]) -> Awaitable[list[list[float]]]: ...


@dataclass(frozen=True)
class LongTermMemoryConfig:
    """Declares an agent's long-term memory: `long_term_memory = LongTermMemoryConfig(...)`.

    `embedding`: the model that turns texts into vectors (anything with
    `async embed(texts) -> list[list[float]]`). One scope must keep one model: vectors of
    different models are not comparable (a different size is refused).
    """

    embedding: Any

    def __post_init__(self) -> None:
        if not callable(getattr(self.embedding, "embed", None)):
            raise ConfigError(
                f"LongTermMemoryConfig(embedding=...) takes an embedding model with an "
                f"`async embed(texts)` method, not {self.embedding!r}"
            )


@dataclass(frozen=True)
class LtmService:
    """What the embedded engine gives tasks: the committed index and the agent's config."""

    index: LongTermIndex
    config: LongTermMemoryConfig


async def embed_texts(model: Any, texts: list[str]) -> list[list[float]]:
    """The durable call of an add (recorded: a crash after it returned never repeats it)."""
    vectors = await model.embed(texts)
    try:
        out = [[float(x) for x in v] for v in vectors]
    except (TypeError, ValueError) as exc:  # None, strings, nested lists
        raise InvalidArgumentError(
            f"the embedding model {model!r} returned {_shape(vectors)}, not one list of "
            f"numbers per text ({type(exc).__name__}: {exc}); its embed(texts) must return "
            f"list[list[float]]"
        ) from exc
    if len(out) != len(texts):
        raise InvalidArgumentError(
            f"the embedding model returned {len(out)} vector(s) for {len(texts)} text(s)"
        )
    return out


def _shape(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _resource_of(model: Any) -> Any:
    """The model's `ratchet.Resource` (ratchet's embedding models have one): an outage pauses
    the stream instead of failing the run (docs/runtime.md, "Pause, don't burn")."""
    from ratchet.agents._resource import Resource

    resource = getattr(model, "resource", None)
    return resource if isinstance(resource, Resource) else None


def _check_text(text: Any, what: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgumentError(f"{what} must be a non-empty string, not {text!r}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: no UTF-8 text can hold it
        raise InvalidArgumentError(
            f"{what} holds {text[exc.start]!r} at position {exc.start}, a lone surrogate no "
            f"UTF-8 text can hold; decode its source with errors='replace'"
        ) from None
    return text


def _check_filter(where: Any) -> dict[str, Any] | None:
    if where is None:
        return None
    if not isinstance(where, dict) or not all(isinstance(k, str) for k in where):
        raise InvalidTypeError(
            f"filter= takes a dict of metadata field -> value (all must match), not {where!r}"
        )
    codec.check_admissible(where)
    return where


class LongTermMemory:
    """`ctx.long_term_memory`: the key's long-term memory (`.shared(name)`: one for all keys).

    Every method is a coroutine: call them from an async action.
    """

    __slots__ = ("_ctx", "_scope")

    def __init__(self, ctx: RunnerContext, scope: str) -> None:
        self._ctx = ctx
        self._scope = scope

    @property
    def scope(self) -> str:
        """`key:<text>` for a string key's own memory, `key#<type>:<text>` for another key's
        (`ratchet.store._base.ltm_key_scope`), `shared:<name>` for a shared one."""
        return self._scope

    def shared(self, name: str) -> LongTermMemory:
        """A long-term memory every key's runs read and add to (writes of one run become
        visible to others when that run completes)."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"a shared long-term memory needs a name, not {name!r}")
        return LongTermMemory(self._ctx, f"shared:{name}")

    def _service(self) -> LtmService:
        service = self._ctx._calls.ltm
        if service is None:
            raise ConfigError(_NOT_AVAILABLE)
        assert isinstance(service, LtmService)
        return service

    def _pending(self) -> list[tuple[Any, ...]]:
        """This run's writes not committed yet: its committed tasks', then this task's."""
        ops = [
            op for entry in self._ctx._task.run.journal for op in entry.stm_ops if op[0] in LTM_OPS
        ]
        ops.extend(op for op in self._ctx._stm.ops if op[0] in LTM_OPS)
        return ops

    def _new_id(self, text: str) -> str:
        """Stable across a replay: the run, the task, the text and its occurrence in the task
        (not the order of adds, which gathered coroutines may change)."""
        ctx = self._ctx
        seen = ctx._ltm_texts  # occurrences of each (scope, text) added by this task
        n = seen.get((self._scope, text), 0)
        seen[(self._scope, text)] = n + 1
        raw = f"{self._scope}|{ctx.seq}|{ctx.task_id}|{n}|{text}"
        return hashlib.blake2b(raw.encode(), digest_size=12).hexdigest()

    async def add(self, text: str, metadata: dict[str, Any] | None = None) -> str:
        """Remember `text` (with `metadata`: a dict of stored values, used by `filter=`);
        returns its id. Searchable by this run at once, by other runs once this one completes."""
        from ratchet.runtime._ltm import unit_vector

        _check_text(text, "a long-term memory's text")
        meta = {} if metadata is None else metadata
        if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
            raise InvalidTypeError(f"metadata= takes a dict with string keys, not {metadata!r}")
        codec.check_admissible(meta)
        meta = copy.deepcopy(meta)  # stored as it is now: the caller may change its dict
        service = self._service()
        ltm_id = self._new_id(text)
        model = service.config.embedding
        [vector] = await self._ctx.durable_execute_async(
            embed_texts, model, [text], resource=_resource_of(model)
        )
        unit = unit_vector(vector)
        # One scope keeps one size: a vector of another size committed would break every
        # later read of the scope, so it is refused here, failing this run alone.
        dims = [
            len(op[5]) // 4 for op in self._pending() if op[0] == LTM_ADD and op[1] == self._scope
        ]
        have = dims[0] if dims else await asyncio.to_thread(service.index.dims, self._scope)
        if have is not None and have != unit.shape[0]:
            raise InvalidArgumentError(
                f"an embedding of {unit.shape[0]} dimensions for long-term memory {self._scope!r}, "
                f"which holds embeddings of {have}: one scope takes one embedding model (a new "
                f"model needs a new scope, e.g. ctx.long_term_memory.shared('name-v2'))"
            )
        blob = unit.tobytes()
        self._ctx._stm.ops.append(
            (LTM_ADD, self._scope, ltm_id, text, meta, blob, self._ctx._now())
        )
        return ltm_id

    async def delete(self, ltm_id: str) -> None:
        """Forget a memory (committed with the run, like an add)."""
        _check_text(ltm_id, "a long-term memory id")
        self._service()
        self._ctx._stm.ops.append((LTM_DELETE, self._scope, ltm_id))

    async def search(
        self, query: str, k: int = 5, filter: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """The `k` memories most similar in meaning to `query`, best first: dicts with `id`,
        `text`, `metadata`, `added_at` and `score` (cosine similarity). `filter`: only memories
        whose metadata has these values. Answered from the journal on a replay."""
        from ratchet.runtime._ltm import unit_vector

        _check_text(query, "a search query")
        if type(k) is not int or k < 1:
            raise InvalidArgumentError(f"k must be an int >= 1, not {k!r}")
        where = _check_filter(filter)
        service = self._service()
        pending = self._pending()
        model = service.config.embedding

        async def search(scope: str, query: str, k: int, where: Any) -> list[dict[str, Any]]:
            [vector] = await embed_texts(model, [query])
            found: list[dict[str, Any]] = await asyncio.to_thread(
                service.index.search, scope, unit_vector(vector), k, where, pending
            )
            return found

        return await self._ctx.durable_execute_async(
            search, self._scope, query, k, where, resource=_resource_of(model)
        )

    async def get(self, ltm_id: str) -> dict[str, Any] | None:
        """One memory by id (`id`, `text`, `metadata`, `added_at`), or None."""
        _check_text(ltm_id, "a long-term memory id")
        found: dict[str, Any] | None = await self._read(
            lambda index, pending: index.get(self._scope, ltm_id, pending), "get", ltm_id
        )
        return found

    async def count(self) -> int:
        """How many memories the scope holds (as this run sees it)."""
        n: int = await self._read(lambda index, pending: index.count(self._scope, pending), "count")
        return n

    async def _read(self, fn: Callable[[LongTermIndex, list[Any]], Any], *args: Any) -> Any:
        service = self._service()
        pending = self._pending()

        async def read(scope: str, *args: Any) -> Any:
            return await asyncio.to_thread(fn, service.index, pending)

        return await self._ctx.durable_execute_async(read, self._scope, *args)
