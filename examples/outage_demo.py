"""Pause, don't burn: a chat model provider goes down in the middle of a stream, and the
stream waits for it instead of turning its inputs into errors.

A local fake OpenAI-compatible server (on 127.0.0.1, started here) answers through the real
`openai` SDK (`pip install 'ratchet[openai]'`). After 40 answers it goes down for 3 seconds
(every request gets a 503). The model connection retries per its RetryPolicy, then its
calls wait for the provider: the engine stops admitting new inputs, one call probes at
growing intervals, and when the provider answers again the stream goes on. Every question
is answered exactly once, none becomes an error. See docs/chat.md, "When the provider is
down: pause, don't burn".

    python examples/outage_demo.py
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import ratchet
from ratchet import InputEvent, OutputEvent, RunnerContext, action
from ratchet.agents.chat import (
    ChatAgent,
    ChatMessage,
    ChatRequestEvent,
    ChatResponseEvent,
    OpenAIChatModel,
    RateLimit,
    RetryPolicy,
)

QUESTIONS = 120
DOWN_AFTER = 40  # answers before the outage
OUTAGE = 3.0  # seconds


class FlakyProvider:
    """A chat completions endpoint that answers "A: <question>", except for `OUTAGE` seconds
    after its `DOWN_AFTER`th answer, when it answers 503 Service Unavailable."""

    def __init__(self) -> None:
        self.answered = 0
        self.refused = 0
        self.down_since: float | None = None
        self.lock = threading.Lock()
        me = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                status, reply = me.answer(body["messages"][-1]["content"])
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, question: str) -> tuple[int, dict[str, Any]]:
        with self.lock:
            if self.down_since is None and self.answered >= DOWN_AFTER:
                self.down_since = time.monotonic()
                print(f"[provider] down for {OUTAGE:g} s (503 to every request)")
            if self.down_since is not None and time.monotonic() - self.down_since < OUTAGE:
                self.refused += 1
                return 503, {"error": {"message": "service unavailable", "type": "outage"}}
            self.answered += 1
        message = {"role": "assistant", "content": f"A: {question}"}
        return 200, {
            "id": "demo", "object": "chat.completion", "created": 0, "model": "demo",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12},
        }  # fmt: skip

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def connection(url: str) -> OpenAIChatModel:
    """The model connection: its calls wait for the provider (`chat:openai:<url>`) when it is
    down past 2 attempts, probing after 0.25 s, then 0.5, 1, 2, 2, ... s."""
    return OpenAIChatModel(
        "demo",
        api_key="none",
        base_url=url,
        retry=RetryPolicy(max_attempts=2, initial_backoff=0.1),
        rate_limit=RateLimit(requests_per_minute=3000, concurrency=8),
        probe_delay=0.25,
        max_probe_delay=2.0,
    )


class Answerer(ChatAgent):
    """Asks the model connection named "provider" each question; outputs its answer."""

    @action(InputEvent)
    @staticmethod
    def ask(event: InputEvent, ctx: RunnerContext) -> None:
        question = ChatMessage.user(f"question {event.input['n']}")
        ctx.send_event(ChatRequestEvent(model="provider", messages=[question]))

    @action(ChatResponseEvent)
    @staticmethod
    def answer(event: ChatResponseEvent, ctx: RunnerContext) -> None:
        ctx.send_event(OutputEvent(output={"answer": event.response.content}))


class ShowPauses(logging.Handler):
    """Prints the engine's "paused: ..." and "resumed: ..." log lines."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith(("paused:", "resumed:")):
            self.lines.append(text)
            print(f"[ratchet] {text}")


def main() -> int:
    provider = FlakyProvider()
    pauses = ShowPauses()
    engine_log = logging.getLogger("ratchet.engine")
    engine_log.addHandler(pauses)
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-outage-"))
    try:
        inputs = [{"key": f"customer-{n % 10}", "n": n} for n in range(QUESTIONS)]
        out = tmp / "answers.jsonl"
        agent = Answerer(resources={"provider": connection(provider.url)})
        result = ratchet.run(agent, inputs=inputs, output=out, state_dir=tmp / "state")
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        errors = [r for r in rows if "error" in r]
        answers = [r["output"]["answer"] for r in rows if "error" not in r]
        answered = sorted(int(a.rsplit(" ", 1)[1]) for a in answers)
        print(
            f"{QUESTIONS} questions, {len(rows)} outputs, {len(errors)} error outputs; "
            f"{provider.refused} requests refused during the outage"
        )
        paused = any(x.startswith("paused:") for x in pauses.lines)
        resumed = any(x.startswith("resumed:") for x in pauses.lines)
        ok = paused and resumed and not errors and answered == list(range(QUESTIONS))
        ok = ok and result.runs_failed == 0
        print(
            "the stream paused during the outage and resumed after it, with no error outputs"
            if ok
            else "UNEXPECTED: see above"
        )
        return 0 if ok else 1
    finally:
        engine_log.removeHandler(pauses)
        provider.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
