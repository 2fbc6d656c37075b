"""Embedding models: text to vectors, batched and rate-limited, for long-term memory and search.

`embed` on a model is a plain call (it records nothing); make it durable with
`await ratchet.agents.chat.embed(ctx, model, texts)`, which goes through
`ctx.durable_execute_async`, so vectors that came back before a crash are not paid for again.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ratchet._errors import ConfigError
from ratchet.agents._resource import Resource
from ratchet.agents.chat._errors import ModelCallError
from ratchet.agents.chat._model import RetryPolicy, with_retries
from ratchet.agents.chat._providers._common import require_key, require_sdk, sdk_error
from ratchet.agents.chat._ratelimit import RateLimit

if TYPE_CHECKING:
    from ratchet.agents._context import RunnerContext

# Dimensions of OpenAI's embedding models, so `dimensions` is known before the first call.
_OPENAI_DIMENSIONS = {
    "text-embedding-3-small": 1536,
    "text-embedding-3-large": 3072,
    "text-embedding-ada-002": 1536,
}


def _estimate(texts: Sequence[str]) -> int:
    """Tokens of a batch, estimated as chat calls are: one per 4 characters, at least one."""
    return sum(max(1, len(t) // 4) for t in texts)


class EmbeddingModel(ABC):
    """Turns texts into vectors: `await model.embed(texts)` returns one `list[float]` per text,
    in order, each `dimensions` long.

    Subclasses implement `_embed_once(batch)` for one request of at most `max_batch_size`
    texts, raising `ModelCallError` (with `transient` set) on failure; `embed` splits the
    texts into batches, sends each through `rate_limit` (a `RateLimit`: requests, tokens and
    concurrency, as for chat models) and retries transient failures per `retry`.
    `dimensions` is given, known for the model, or learned from the first reply (None until
    then); a reply of another length is an error. `embed` records nothing: call it through
    `ratchet.agents.chat.embed(ctx, model, texts)` (or your own durable call) in an action.
    """

    provider: str = "embedding"

    def __init__(
        self,
        *,
        model: str | None = None,
        dimensions: int | None = None,
        max_batch_size: int = 64,
        retry: RetryPolicy | None = None,
        rate_limit: RateLimit | None = None,
        resource_name: str | None = None,
    ) -> None:
        if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
            raise ConfigError(
                f"{type(self).__name__}(dimensions=) takes an int >= 1, got {dimensions!r}"
            )
        if type(max_batch_size) is not int or max_batch_size < 1:
            raise ConfigError(
                f"{type(self).__name__}(max_batch_size=) takes an int >= 1 (texts per request), "
                f"got {max_batch_size!r}"
            )
        if rate_limit is not None and not isinstance(rate_limit, RateLimit):
            raise ConfigError(
                f"rate_limit= takes a ratchet.agents.chat.RateLimit(requests_per_minute=..., "
                f"tokens_per_minute=..., concurrency=...), got {rate_limit!r}"
            )
        if resource_name is not None and (not isinstance(resource_name, str) or not resource_name):
            raise ConfigError(f"resource_name= takes a non-empty str, got {resource_name!r}")
        self.model = model
        self.dimensions = dimensions
        self.max_batch_size = max_batch_size
        self.retry = retry or RetryPolicy()
        self.rate_limit = rate_limit
        self._resource_name = resource_name
        self.requests = 0  # requests sent by this process (batches, with retries)

    def endpoint(self) -> str:
        """Where requests go; names the resource."""
        return self.model or type(self).__name__

    @property
    def resource(self) -> Resource:
        """The `ratchet.Resource` durable embedding calls wait on while the provider is down:
        `resource_name=` or `embedding:<provider>:<endpoint>`."""
        return Resource(self._resource_name or f"embedding:{self.provider}:{self.endpoint()}")

    @abstractmethod
    async def _embed_once(self, texts: list[str]) -> tuple[list[list[float]], int | None]:
        """One request: (vectors in order, tokens the provider reports or None)."""

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """The vectors of `texts`, in order (batched, rate-limited, retried; not recorded)."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise ConfigError(f"embed() takes a list of str, got {texts!r:.200}")
        texts = list(texts)
        if not texts:
            return []
        size = self.max_batch_size
        batches = [texts[i : i + size] for i in range(0, len(texts), size)]
        results = await asyncio.gather(*(self._batch(b) for b in batches))
        return [v for batch in results for v in batch]

    async def _batch(self, texts: list[str]) -> list[list[float]]:
        vectors = await with_retries(self.retry, self.rate_limit, lambda: self._limited(texts))
        return self._checked(texts, vectors)

    async def _limited(self, texts: list[str]) -> list[list[float]]:
        self.requests += 1
        if self.rate_limit is None:
            vectors, _ = await self._embed_once(texts)
            return vectors
        estimate = _estimate(texts)
        async with self.rate_limit.slot(estimate) as usage:
            vectors, used = await self._embed_once(texts)
            usage.used = used or estimate
            return vectors

    def _checked(self, texts: list[str], vectors: list[list[float]]) -> list[list[float]]:
        if len(vectors) != len(texts):
            raise ModelCallError(
                f"{self.provider}: asked for {len(texts)} embeddings, got {len(vectors)}",
                provider=self.provider,
            )
        out = []
        for v in vectors:
            vec = [float(x) for x in v]
            if self.dimensions is None:
                self.dimensions = len(vec)
            if len(vec) != self.dimensions:
                raise ModelCallError(
                    f"{self.provider}: an embedding of {len(vec)} dimensions, expected "
                    f"{self.dimensions} (set dimensions= to what model {self.model!r} returns)",
                    provider=self.provider,
                )
            out.append(vec)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model!r}, dimensions={self.dimensions})"


class OpenAIEmbeddingModel(EmbeddingModel):
    """OpenAI's embeddings API, or any server speaking it (vLLM, llama.cpp, LM Studio, ...),
    through the official `openai` SDK (extra `openai`).

    The key comes from `api_key` or `OPENAI_API_KEY` (checked here; `api_key="none"` for a
    local server that needs none); `base_url` (or `OPENAI_BASE_URL`) points it elsewhere.
    `dimensions`, if given, is also sent (text-embedding-3 models shorten their vectors to
    it). The SDK's own retries are off: `retry` decides.
    """

    provider = "openai"

    def __init__(
        self,
        model: str = "text-embedding-3-small",
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        dimensions: int | None = None,
        max_batch_size: int = 256,
        timeout: float = 60.0,
        retry: RetryPolicy | None = None,
        rate_limit: RateLimit | None = None,
        resource_name: str | None = None,
    ) -> None:
        super().__init__(
            model=model,
            dimensions=dimensions if dimensions is not None else _OPENAI_DIMENSIONS.get(model),
            max_batch_size=max_batch_size,
            retry=retry,
            rate_limit=rate_limit,
            resource_name=resource_name,
        )
        self._send_dimensions = dimensions
        openai = require_sdk("openai", "openai")
        self._sdk = openai
        self.client = openai.AsyncOpenAI(
            api_key=require_key(api_key, "OPENAI_API_KEY", type(self).__name__),
            base_url=base_url,
            timeout=timeout,
            max_retries=0,
        )

    def endpoint(self) -> str:
        return str(self.client.base_url).rstrip("/")

    async def _embed_once(self, texts: list[str]) -> tuple[list[list[float]], int | None]:
        kwargs: dict[str, Any] = {}
        if self._send_dimensions is not None:
            kwargs["dimensions"] = self._send_dimensions
        try:
            resp = await self.client.embeddings.create(
                model=self.model or "", input=texts, encoding_format="float", **kwargs
            )
            ordered = sorted(resp.data, key=lambda d: d.index)
            vectors = [list(d.embedding) for d in ordered]
        except self._sdk.OpenAIError as exc:
            raise sdk_error(self._sdk, "openai", exc, (408, 409, 429)) from exc
        except (ValueError, TypeError, AttributeError) as exc:
            raise sdk_error(self._sdk, "openai", exc) from exc
        used = getattr(resp.usage, "total_tokens", None) if resp.usage is not None else None
        return vectors, used


class OllamaEmbeddingModel(EmbeddingModel):
    """A model served by Ollama (`/api/embed`) through the official `ollama` SDK (extra
    `ollama`). No key; `host` defaults to `OLLAMA_HOST` or http://127.0.0.1:11434."""

    provider = "ollama"

    def __init__(
        self,
        model: str = "nomic-embed-text",
        *,
        host: str | None = None,
        dimensions: int | None = None,
        max_batch_size: int = 64,
        timeout: float = 120.0,
        retry: RetryPolicy | None = None,
        rate_limit: RateLimit | None = None,
        resource_name: str | None = None,
        truncate: bool | None = None,
    ) -> None:
        super().__init__(
            model=model,
            dimensions=dimensions,
            max_batch_size=max_batch_size,
            retry=retry,
            rate_limit=rate_limit,
            resource_name=resource_name,
        )
        ollama = require_sdk("ollama", "ollama")
        self._sdk = ollama
        self._send_dimensions = dimensions
        self._truncate = truncate
        self.client = ollama.AsyncClient(host=host, timeout=timeout)

    def endpoint(self) -> str:
        return str(self.client._client.base_url).rstrip("/")

    async def _embed_once(self, texts: list[str]) -> tuple[list[list[float]], int | None]:
        sdk = self._sdk
        try:
            resp = await self.client.embed(
                model=self.model or "",
                input=texts,
                truncate=self._truncate,
                dimensions=self._send_dimensions,
            )
            vectors = [list(v) for v in resp.embeddings]
        except sdk.ResponseError as exc:
            status = exc.status_code
            raise ModelCallError(
                f"ollama: HTTP {status}: {exc.error}",
                provider="ollama",
                status=status,
                transient=status in (408, 429) or status >= 500,
            ) from exc
        except Exception as exc:
            name = {k.__name__ for k in type(exc).__mro__}
            if isinstance(exc, ConnectionError | TimeoutError) or "TransportError" in name:
                raise ModelCallError(
                    f"ollama: connection failed: {exc}", provider="ollama", transient=True
                ) from exc
            raise ModelCallError(
                f"ollama: malformed response ({type(exc).__name__}: {exc})", provider="ollama"
            ) from exc
        return vectors, resp.prompt_eval_count


def hash_vector(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for `text` (the same in every process), from SHA-256."""
    raw = b""
    counter = 0
    while len(raw) < 4 * dimensions:
        raw += hashlib.sha256(f"{counter}\x00{text}".encode()).digest()
        counter += 1
    ints = struct.unpack(f"<{dimensions}I", raw[: 4 * dimensions])
    vec = [i / 2**31 - 1.0 for i in ints]
    norm = math.sqrt(sum(x * x for x in vec)) or 1.0
    return [x / norm for x in vec]


class ScriptedEmbeddingModel(EmbeddingModel):
    """Deterministic vectors with no network, for tests and demos: by default a unit vector
    from a hash of the text (equal texts, equal vectors, in every process), or
    `fn(text) -> list[float]`. `calls` lists every batch it was asked for."""

    provider = "scripted"

    def __init__(
        self,
        dimensions: int = 16,
        fn: Callable[[str], Sequence[float]] | None = None,
        *,
        max_batch_size: int = 64,
        rate_limit: RateLimit | None = None,
        model: str = "scripted-embedding",
    ) -> None:
        super().__init__(
            model=model,
            dimensions=dimensions,
            max_batch_size=max_batch_size,
            rate_limit=rate_limit,
        )
        if fn is not None and not callable(fn):
            raise ConfigError(f"ScriptedEmbeddingModel(fn=) takes a function of the text: {fn!r}")
        self._fn = fn
        self.calls: list[list[str]] = []

    async def _embed_once(self, texts: list[str]) -> tuple[list[list[float]], int | None]:
        self.calls.append(list(texts))
        dims = self.dimensions or 16
        if self._fn is None:
            return [hash_vector(t, dims) for t in texts], None
        return [list(self._fn(t)) for t in texts], None


async def embed(
    ctx: RunnerContext, model: EmbeddingModel, texts: Sequence[str]
) -> list[list[float]]:
    """`model.embed(texts)` as a durable call of this action: after a crash, vectors that came
    back before it are answered from the journal (the provider is not asked again); a call in
    flight is sent again. A provider down past its retries pauses the stream (`model.resource`).
    """
    if not isinstance(model, EmbeddingModel):
        raise ConfigError(
            f"embed(ctx, model, texts) takes an EmbeddingModel as model, got {model!r}"
        )
    if isinstance(texts, str):
        raise ConfigError("embed(ctx, model, texts) takes a list of str; wrap one text in [...]")
    return await ctx.durable_execute_async(model.embed, list(texts), resource=model.resource)
