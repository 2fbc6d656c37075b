"""Plain asyncio, no durability: the floor. The same steps as the others, per key in input
order, outputs appended to a JSONL file. After a kill it can only start again from the top."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c  # noqa: E402


async def per_key(inputs: list[dict[str, Any]], step: Any, limit: int) -> None:
    """Each key's inputs in order; at most `limit` inputs (of different keys) at once."""
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for inp in inputs:
        by_key[inp["key"]].append(inp)
    sem = asyncio.Semaphore(limit)

    async def one_key(items: list[dict[str, Any]]) -> None:
        for inp in items:
            async with sem:
                await step(inp)

    await asyncio.gather(*(one_key(v) for v in by_key.values()))


def main() -> None:
    a = c.peer_args()
    wd: Path = a.workdir
    wd.mkdir(parents=True, exist_ok=True)
    memory: dict[str, dict[str, Any]] = defaultdict(dict)
    out = open(wd / "out.jsonl", "a")

    def emit(payload: dict[str, Any]) -> None:
        out.write(json.dumps(payload) + "\n")
        out.flush()

    if a.workload == "w1":
        n = a.n or c.W1_INPUTS

        async def three_steps(inp: dict[str, Any]) -> None:
            mid = inp["v"]  # step 1: an event
            memory[inp["key"]]["v"] = mid  # step 2: a memory write
            emit({"id": inp["id"], "v": mid})  # step 3: an output

        async def main_w1() -> None:
            for inp in c.w1_inputs(n):
                await three_steps(inp)

        t = time.perf_counter()
        asyncio.run(main_w1())
        c.emit({"inputs": n, "steps": 3 * n, "wall_s": time.perf_counter() - t, "state_bytes": 0})
    elif a.workload == "w2":
        n = a.n or c.W2_INPUTS

        async def slow(inp: dict[str, Any]) -> None:
            await asyncio.sleep(c.W2_DELAY)
            memory[inp["key"]]["n"] = memory[inp["key"]].get("n", 0) + 1
            emit({"id": inp["id"]})

        t = time.perf_counter()
        asyncio.run(per_key(c.w2_inputs(n), slow, c.CONCURRENCY))
        c.emit({"inputs": n, "wall_s": time.perf_counter() - t})
    elif a.workload == "w3":

        async def main_w3() -> None:
            ask = c.AsyncModelClient(a.url).call

            async def two_calls(inp: dict[str, Any]) -> None:
                first = await ask(inp["id"], 1)
                second = await ask(inp["id"], 2)
                emit({"id": inp["id"], "answers": [first, second]})

            await per_key(c.w3_inputs(a.n or c.W3_INPUTS), two_calls, c.CONCURRENCY)

        asyncio.run(main_w3())
    else:
        c.emit({"skipped": "no state survives a restart"})


if __name__ == "__main__":
    main()
