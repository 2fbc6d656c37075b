"""Embedding models against a real local HTTP server speaking OpenAI's /v1/embeddings and
Ollama's /api/embed, through the official SDKs; and a SIGKILL of `ratchet run` after an
embedding returned: the restart must not ask the server again.

This module is also the agent file the kill test runs (`EmbedAgent`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ratchet import Agent, ConfigError, InputEvent, OutputEvent, RunnerContext, action
from ratchet.agents.chat import (
    ModelCallError,
    OllamaEmbeddingModel,
    OpenAIEmbeddingModel,
    RateLimit,
    RetryPolicy,
    ScriptedEmbeddingModel,
    embed,
)
from ratchet.agents.chat._embeddings import hash_vector
from ratchet.testing import FakeClock

DIMS = 8


class EmbeddingServer:
    """OpenAI's and Ollama's embedding endpoints on 127.0.0.1; vectors are `hash_vector`s.
    Records every request's texts; `fail_next` statuses are served first."""

    def __init__(self, delay: float = 0.0) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_next: list[int] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                status, reply = outer.handle(self.path, body, delay)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def handle(self, path: str, body: dict[str, Any], delay: float) -> tuple[int, Any]:
        with self._lock:
            self.requests.append({"path": path, **body})
            if self.fail_next:
                status = self.fail_next.pop(0)
                return status, {"error": {"message": f"injected {status}", "type": "x"}}
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if delay:
                time.sleep(delay)  # so requests that are allowed to overlap do
            texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
            dims = body.get("dimensions") or DIMS
            vectors = [hash_vector(t, dims) for t in texts]
            tokens = sum(len(t.split()) for t in texts)
            if path == "/v1/embeddings":
                data = [
                    {"object": "embedding", "index": i, "embedding": v}
                    for i, v in enumerate(vectors)
                ]
                data.reverse()  # the API gives an index per vector; order must not matter
                usage = {"prompt_tokens": tokens, "total_tokens": tokens}
                return 200, {"object": "list", "data": data, "model": body["model"], "usage": usage}
            if path == "/api/embed":
                return 200, {
                    "model": body["model"],
                    "embeddings": vectors,
                    "prompt_eval_count": tokens,
                }
            return 404, {"error": f"no route {path}"}
        finally:
            with self._lock:
                self.in_flight -= 1

    def texts(self) -> list[list[str]]:
        return [list(r["input"]) for r in self.requests]

    def __enter__(self) -> EmbeddingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[EmbeddingServer]:
    with EmbeddingServer() as s:
        yield s


async def _no_sleep(delay: float) -> None:
    pass


TEXTS = [f"text number {i}" for i in range(7)]


def test_openai_embeddings_are_batched_and_come_back_in_order(server: EmbeddingServer) -> None:
    model = OpenAIEmbeddingModel(
        "my-embedder", api_key="none", base_url=server.url + "/v1", max_batch_size=3
    )
    assert model.dimensions is None  # unknown model: learned from the first reply
    vectors = asyncio.run(model.embed(TEXTS))
    assert vectors == [hash_vector(t, DIMS) for t in TEXTS]
    assert model.dimensions == DIMS
    assert sorted(server.texts()) == sorted([TEXTS[0:3], TEXTS[3:6], TEXTS[6:7]])
    assert {r["model"] for r in server.requests} == {"my-embedder"}
    assert all("dimensions" not in r for r in server.requests)
    # Known model: dimensions before any call; dimensions= is sent to the API.
    assert OpenAIEmbeddingModel(api_key="none").dimensions == 1536
    short = OpenAIEmbeddingModel(
        "text-embedding-3-small", api_key="none", base_url=server.url + "/v1", dimensions=4
    )
    assert asyncio.run(short.embed(["a"])) == [hash_vector("a", 4)]
    assert server.requests[-1]["dimensions"] == 4


def test_ollama_embeddings_are_batched_and_retried(server: EmbeddingServer) -> None:
    model = OllamaEmbeddingModel(
        "nomic-embed-text", host=server.url, max_batch_size=2,
        retry=RetryPolicy(max_attempts=2, sleep=_no_sleep),
    )  # fmt: skip
    vectors = asyncio.run(model.embed(TEXTS[:3]))
    assert vectors == [hash_vector(t, DIMS) for t in TEXTS[:3]]
    assert {r["path"] for r in server.requests} == {"/api/embed"}
    assert sorted(server.texts()) == sorted([TEXTS[0:2], TEXTS[2:3]])
    assert model.requests == 2
    server.fail_next = [503]
    assert asyncio.run(model.embed(["again"])) == [hash_vector("again", DIMS)]
    assert model.requests == 4  # the 503 was retried
    server.fail_next = [404]
    with pytest.raises(ModelCallError, match="ollama: HTTP 404") as err:
        asyncio.run(model.embed(["missing model"]))
    assert not err.value.transient


def test_rate_limit_spaces_and_serializes_batches() -> None:
    """requests_per_minute=60 lets one batch go per (virtual) second; concurrency=1 keeps one
    request in flight at the server, though the batches are sent concurrently."""
    clock = FakeClock(autojump=True)
    with EmbeddingServer(delay=0.02) as server:
        model = OpenAIEmbeddingModel(
            "e", api_key="none", base_url=server.url + "/v1", max_batch_size=2,
            rate_limit=RateLimit(requests_per_minute=60, concurrency=1, clock=clock),
        )  # fmt: skip
        start = clock.monotonic()
        vectors = asyncio.run(model.embed(TEXTS))
    assert len(vectors) == len(TEXTS)
    assert len(server.requests) == 4
    assert server.max_in_flight == 1
    assert clock.monotonic() - start == pytest.approx(3.0)  # 4 requests, 1 a second, burst 1


def test_token_rate_limit_counts_the_tokens_the_provider_reports() -> None:
    """tokens_per_minute=60: one token a second. Each batch is estimated at 1 token (5
    characters) but the server reports 3 (words): the limiter charges the 3, so the second and
    third batches wait 3 virtual seconds each, not 1."""
    clock = FakeClock(autojump=True)
    with EmbeddingServer() as server:
        model = OpenAIEmbeddingModel(
            "e", api_key="none", base_url=server.url + "/v1", max_batch_size=1,
            rate_limit=RateLimit(tokens_per_minute=60, concurrency=1, clock=clock),
        )  # fmt: skip
        start = clock.monotonic()
        asyncio.run(model.embed(["a b c", "d e f", "g h i"]))
    assert len(server.requests) == 3
    assert clock.monotonic() - start == pytest.approx(6.0)


def test_transient_errors_are_retried_and_permanent_ones_fail(server: EmbeddingServer) -> None:
    model = OpenAIEmbeddingModel(
        "e", api_key="none", base_url=server.url + "/v1",
        retry=RetryPolicy(max_attempts=3, sleep=_no_sleep),
    )  # fmt: skip
    server.fail_next = [500, 429]
    assert asyncio.run(model.embed(["x"])) == [hash_vector("x", DIMS)]
    assert len(server.requests) == 3
    server.fail_next = [400]
    with pytest.raises(ModelCallError, match="HTTP 400") as err:
        asyncio.run(model.embed(["y"]))
    assert not err.value.transient
    assert len(server.requests) == 4  # not retried
    wrong = OpenAIEmbeddingModel("e", api_key="none", base_url=server.url + "/v1", dimensions=5)
    server.fail_next = []
    wrong._send_dimensions = None  # the server then returns 8: a model that lies about its size
    with pytest.raises(ModelCallError, match="8 dimensions, expected 5"):
        asyncio.run(wrong.embed(["z"]))


def test_scripted_embeddings_are_deterministic_and_mistakes_are_clear() -> None:
    model = ScriptedEmbeddingModel(dimensions=6, max_batch_size=2)
    first = asyncio.run(model.embed(["a", "b", "a"]))
    assert first[0] == first[2] != first[1]
    assert len(first[0]) == 6 and abs(sum(x * x for x in first[0]) - 1.0) < 1e-9
    assert sorted(model.calls) == [["a"], ["a", "b"]]
    assert asyncio.run(ScriptedEmbeddingModel(dimensions=6).embed(["a"])) == [first[0]]
    custom = ScriptedEmbeddingModel(dimensions=2, fn=lambda t: [len(t), 1.0])
    assert asyncio.run(custom.embed(["abc"])) == [[3.0, 1.0]]
    with pytest.raises(ConfigError, match=r"max_batch_size=\) takes an int >= 1"):
        ScriptedEmbeddingModel(max_batch_size=0)
    with pytest.raises(ConfigError, match=r"rate_limit= takes a ratchet.agents.chat.RateLimit"):
        OpenAIEmbeddingModel(api_key="none", rate_limit={"requests_per_minute": 5})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"embed\(\) takes a list of str"):
        asyncio.run(model.embed("one text"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs an API key: set the OPENAI_API_KEY"):
        OpenAIEmbeddingModel(api_key="")


# -- durable: SIGKILL of `ratchet run` ---------------------------------------------------------


class EmbedAgent(Agent):
    """Embeds each input durably, then (while $EMBED_HOLD exists) waits in a second durable
    call: the test kills the process there."""

    @action(InputEvent)
    @staticmethod
    async def on_input(event: InputEvent, ctx: RunnerContext) -> None:
        model = OpenAIEmbeddingModel(
            "e", api_key="none", base_url=os.environ["EMBED_URL"] + "/v1", max_batch_size=1
        )
        vectors = await embed(ctx, model, [event.input["text"], event.input["text"] + "!"])
        await ctx.durable_execute_async(_hold)
        ctx.send_event(OutputEvent(output={"head": [v[:2] for v in vectors]}))


def _hold() -> None:  # a sync durable call runs in a thread
    while Path(os.environ["EMBED_HOLD"]).exists():
        time.sleep(0.02)


def _embed_recorded(db: Path) -> bool:
    if not db.exists():
        return False
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
        try:
            rows = con.execute("SELECT fn, status FROM calls").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return False
    return any(fn.endswith("EmbeddingModel.embed") and s == "ok" for fn, s in rows)


@pytest.mark.kill
def test_an_embedding_that_returned_is_not_requested_again_after_sigkill(
    server: EmbeddingServer, tmp_path: Path
) -> None:
    (tmp_path / "in.jsonl").write_text(json.dumps({"key": "k", "text": "hello"}) + "\n")
    hold = tmp_path / "hold"
    hold.touch()
    env = {**os.environ, "EMBED_URL": server.url, "EMBED_HOLD": str(hold)}
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", f"{__file__}:EmbedAgent",
        "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
        "--state", str(tmp_path / "state"), "--checkpoint-interval", "50",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not _embed_recorded(tmp_path / "state" / "ratchet.db"):
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        if time.monotonic() > deadline:
            proc.kill()
            proc.communicate()
            raise AssertionError("the embedding call was not recorded")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert sorted(server.texts()) == [["hello"], ["hello!"]]  # two batches of one

    hold.unlink()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert len(server.requests) == 2  # the recorded vectors came from the journal
    [out] = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out["output"]["head"] == [
        hash_vector("hello", DIMS)[:2],
        hash_vector("hello!", DIMS)[:2],
    ]


class _FlinkEmbedder(Agent):
    """`model.embed` in a plain durable call: `embed(ctx, ...)` passes `resource=`, which the
    Flink core does not support yet (docs/flink.md)."""

    def __init__(self, model: ScriptedEmbeddingModel) -> None:
        self.model = model

    @action(InputEvent)
    async def on_input(self, event: InputEvent, ctx: RunnerContext) -> None:
        vectors = await ctx.durable_execute_async(self.model.embed, [event.input["text"]])
        ctx.send_event(OutputEvent(output=vectors[0]))


def test_embeddings_in_a_durable_call_run_on_the_flink_core() -> None:
    # Imported here: `ratchet run` loads this module as the kill test's agent file.
    from support.engines import per_key, run_flink_core

    model = ScriptedEmbeddingModel(dimensions=4)
    outputs, _ = run_flink_core(_FlinkEmbedder(model), [{"key": "a", "text": "x"}])
    assert per_key(outputs) == {"a": [hash_vector("x", 4)]}
    assert model.calls == [["x"]]
