"""Agents of the long-term memory tests, in process and in `ratchet run` subprocesses.

`WordEmbedding` is a deterministic bag-of-words model: each word adds 1 to the dimension its
hash picks, so texts sharing words are near. With `LTM_MARKS` set, every embed call appends a
line (the texts) to that file, so a test counts calls across processes. With `LTM_SLOW` (seconds)
the `Notebook` action sleeps after its add, which gives a killer time to hit mid-run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from typing import Any

from ratchet import Agent, Event, InputEvent, LongTermMemoryConfig, OutputEvent, action

DIMS = 32


class WordEmbedding:
    dimensions = DIMS

    async def embed(self, texts: list[str]) -> list[list[float]]:
        marks = os.environ.get("LTM_MARKS")
        if marks:
            with open(marks, "a") as fh:  # noqa: ASYNC230 - a test counter, tiny
                fh.write(json.dumps(texts) + "\n")
        out = []
        for text in texts:
            v = [0.0] * DIMS
            for word in text.lower().replace(",", " ").split():
                v[int(hashlib.sha256(word.encode()).hexdigest(), 16) % DIMS] += 1.0
            out.append(v)
        return out


class Noted(Event):
    note_id: str


class Notebook(Agent):
    """`note`: add it (with `tag`), then output the top hits of `note` itself; `q`: search
    (`filter` by tag, `k`); `forget`: delete that id; `shared`: the same in the shared memory."""

    long_term_memory = LongTermMemoryConfig(embedding=WordEmbedding())

    @action(InputEvent)
    async def on_input(self, event: InputEvent, ctx: Any) -> None:
        data = event.input
        ltm = ctx.long_term_memory.shared("team") if data.get("shared") else ctx.long_term_memory
        if "note" in data:
            note_id = await ltm.add(data["note"], {"tag": data.get("tag", "none"), "n": data["n"]})
            slow = float(os.environ.get("LTM_SLOW", "0"))
            if slow:
                await asyncio.sleep(slow)
            ctx.send_event(Noted(note_id=note_id))
        elif "forget" in data:
            await ltm.delete(data["forget"])
            ctx.send_event(
                OutputEvent(output={"forgot": data["forget"], "count": await ltm.count()})
            )
        else:
            where = {"tag": data["tag"]} if "tag" in data else None
            hits = await ltm.search(data["q"], k=data.get("k", 3), filter=where)
            slow = float(os.environ.get("LTM_SLOW", "0"))
            if slow:
                await asyncio.sleep(slow)
            ctx.send_event(
                OutputEvent(
                    output={
                        "q": data["q"],
                        "hits": [h["text"] for h in hits],
                        "scores": [h["score"] for h in hits],
                        "count": await ltm.count(),
                    }
                )
            )

    @action(Noted)
    async def after_add(self, event: Noted, ctx: Any) -> None:
        # A later task of the same run sees the add (not committed yet) by id and by search.
        got = await ctx.long_term_memory.get(event.note_id)
        shared = await ctx.long_term_memory.shared("team").get(event.note_id)
        ctx.send_event(
            OutputEvent(output={"added": event.note_id, "text": (got or shared or {}).get("text")})
        )


class NoConfig(Agent):
    @action(InputEvent)
    async def on_input(self, event: InputEvent, ctx: Any) -> None:
        await ctx.long_term_memory.add("anything")


class SizedEmbedding:
    """Vectors of `dims` numbers (another model, for the one-size-per-scope rule)."""

    def __init__(self, dims: int) -> None:
        self.dims = dims

    async def embed(self, texts: list[str]) -> list[list[float]]:
        return [[1.0 + i] * self.dims for i, _ in enumerate(texts)]


class BrokenEmbedding:
    """Returns what an embedding model must not: strings instead of numbers."""

    async def embed(self, texts: list[str]) -> list[list[float]]:
        return [["x"] for _ in texts]  # type: ignore[list-item]


class Misuse(Agent):
    """Each input names one thing to try; the output says what happened."""

    long_term_memory = LongTermMemoryConfig(
        embedding=SizedEmbedding(int(os.environ.get("LTM_DIMS", "16")))
    )

    @action(InputEvent)
    async def on_input(self, event: InputEvent, ctx: Any) -> None:
        data = event.input
        ltm = ctx.long_term_memory
        if data["try"] == "add":
            await ltm.add(data["text"], {"tag": "orig"})
            ctx.send_event(OutputEvent(output={"count": await ltm.count()}))
        elif data["try"] == "mutate":
            meta = {"tag": "orig"}
            await ltm.add("kept as given", meta)
            meta["tag"] = "changed after add"
            (hit,) = await ltm.search("kept as given", k=1)
            hit["metadata"]["tag"] = "changed by a reader"
            ctx.send_event(OutputEvent(output={"done": True}))
        elif data["try"] == "read":
            (hit,) = await ltm.search("kept as given", k=1)
            ctx.send_event(OutputEvent(output={"tag": hit["metadata"]["tag"]}))


class Secrets(Agent):
    """`add`: remember `text`; `search`: output what this key's memory finds for `q`."""

    long_term_memory = LongTermMemoryConfig(embedding=WordEmbedding())

    @action(InputEvent)
    async def on_input(self, event: InputEvent, ctx: Any) -> None:
        data = event.input
        if "text" in data:
            await ctx.long_term_memory.add(data["text"])
            ctx.send_event(OutputEvent(output={"added": data["text"]}))
        else:
            hits = await ctx.long_term_memory.search(data["q"], k=5)
            ctx.send_event(OutputEvent(output={"found": sorted(h["text"] for h in hits)}))
