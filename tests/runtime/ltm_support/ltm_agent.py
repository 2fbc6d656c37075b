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
