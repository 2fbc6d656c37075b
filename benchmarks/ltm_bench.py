"""Long-term memory at 100,000 memories per job, beside its baselines, in one run.

(a) adds: a job whose one async action adds one memory per input (a 384-dimension embedding
    from a scripted model, recorded as a durable call, written with the checkpoint), beside
    the same job that only sets a short-term memory value; adds/s and the ratio.
(b) searches: a job of searches over the 100,000 memories of one shared scope, one run at a
    time (each search a durable call: embed the query, exact cosine search, top 5; the first
    one loads the scope from the state), latency measured around `ltm.search` inside the action, beside a plain numpy search of the same vectors with no
    durability; the ratio of medians.

    .venv/bin/python benchmarks/ltm_bench.py [--memories 100000] [--searches 200]

Pinned to one core. Needs numpy (`pip install 'ratchet[memory]'`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ratchet import Agent, EngineConfig, InputEvent, LongTermMemoryConfig, OutputEvent, action, run

DIMS = 384


def vector_of(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).standard_normal(DIMS).astype(np.float32)


class ScriptedEmbedding:
    dimensions = DIMS

    async def embed(self, texts: list[str]) -> list[list[float]]:
        return [vector_of(t).tolist() for t in texts]


class Memories(Agent):
    """An input with `text` adds it; one with `q` searches (and times the search)."""

    long_term_memory = LongTermMemoryConfig(embedding=ScriptedEmbedding())

    @action(InputEvent)
    async def handle(self, event: InputEvent, ctx: Any) -> None:
        memory = ctx.long_term_memory.shared("all")
        if "text" in event.input:
            await memory.add(event.input["text"], {"n": event.input["n"]})
            ctx.send_event(OutputEvent(output=event.input["n"]))
            return
        t = time.perf_counter()
        hits = await memory.search(event.input["q"], k=5)
        took = time.perf_counter() - t
        ctx.send_event(
            OutputEvent(output={"s": took, "q": event.input["q"], "top": hits[0]["text"]})
        )


class Setter(Agent):
    @action(InputEvent)
    async def handle(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("last", event.input["text"])
        ctx.send_event(OutputEvent(output=event.input["n"]))


def timed_run(
    agent: Agent,
    inputs: list[dict[str, Any]],
    state: Path,
    out: Path,
    new: int | None = None,
    config: EngineConfig | None = None,
) -> float:
    """Run `inputs` (the whole stream: a state resumes where it was), `new` of them fresh."""
    t = time.perf_counter()
    res = run(agent, inputs=inputs, output=out, state_dir=state, config=config or EngineConfig())
    took = time.perf_counter() - t
    assert res.runs_completed == (len(inputs) if new is None else new), res
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memories", type=int, default=100_000)
    ap.add_argument("--searches", type=int, default=200)
    args = ap.parse_args()
    try:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        pinned = "pinned to one core"
    except (AttributeError, OSError):
        pinned = "not pinned"
    n = args.memories
    texts = [f"memory {i} about topic {i % 97} and item {i % 1013}" for i in range(n)]
    adds = [{"key": f"k{i % 1000}", "n": i, "text": t} for i, t in enumerate(texts)]
    print(f"long-term memory: {n:,} memories of {DIMS} dimensions, {pinned}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base = timed_run(Setter(), adds, tmp / "base", tmp / "base.jsonl")
        ours = timed_run(Memories(), adds, tmp / "ltm", tmp / "ltm.jsonl")
        db_mb = (tmp / "ltm" / "ratchet.db").stat().st_size / 1e6
        print(
            f"(a) adds: {n / ours:,.0f} adds/s ({ours / n * 1e6:,.0f} us each, state {db_mb:,.0f} "
            f"MB) beside {n / base:,.0f} memory sets/s: {base / ours:.2f}x"
        )
        queries = [
            {"key": f"q{i}", "n": n + i, "q": texts[(i * 7919) % n]} for i in range(args.searches)
        ]
        # One search at a time: the latency of a search, not of a queue of them.
        serial = EngineConfig(max_concurrent_runs=1)
        timed_run(
            Memories(), [*adds, *queries], tmp / "ltm", tmp / "ltm.jsonl", len(queries), serial
        )
        lines = (tmp / "ltm.jsonl").read_text().splitlines()[-args.searches :]
        results = [json.loads(x)["output"] for x in lines]
        assert all(r["top"] == r["q"] for r in results)  # a memory's own text finds it first
        ratchet_s = [r["s"] for r in results]
        # The baseline: the same vectors in one numpy matrix, exact top 5 by cosine similarity.
        matrix = np.stack([vector_of(t) for t in texts])
        matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
        plain_s = []
        for q in queries:
            t = time.perf_counter()
            v = vector_of(q["q"])
            v /= np.linalg.norm(v)
            scores = matrix @ v
            top = np.argpartition(scores, -5)[-5:]
            top[np.argsort(-scores[top])]
            plain_s.append(time.perf_counter() - t)
        r_med, p_med = statistics.median(ratchet_s), statistics.median(plain_s)
        print(
            f"(b) search over {n:,}: median {r_med * 1e3:.2f} ms (p95 "
            f"{sorted(ratchet_s)[int(0.95 * len(ratchet_s))] * 1e3:.2f} ms) beside plain numpy "
            f"{p_med * 1e3:.2f} ms: {p_med / r_med:.2f}x"
        )


if __name__ == "__main__":
    main()
