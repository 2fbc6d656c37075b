"""`RateLimit` on real time: many concurrent model calls through one OpenAI connection (the
real `openai` SDK) against a local fake server; prints the rate the server saw beside the
configured limit and their ratio. The limiter sleeps until a request may go (no polling),
so the CPU time is printed too.

    .venv/bin/python benchmarks/rate_limit_bench.py [--seconds 12]

(a) requests per minute; (b) tokens per minute, the estimate corrected by the reported usage;
(c) concurrency against a server that takes 50 ms per request. About 40 s in all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ratchet.agents.chat import ChatMessage, OpenAIChatModel, RateLimit, estimate_tokens

QUESTION = "What is the status of order A-1? " * 25  # about 210 tokens, estimated


class FakeProvider:
    """An OpenAI chat completions endpoint on 127.0.0.1 that records when requests arrive and
    how many are in flight, and reports `usage_tokens` per reply."""

    def __init__(self, latency: float = 0.0, usage_tokens: int = 0) -> None:
        self.arrivals: list[float] = []
        self.in_flight = 0
        self.most_in_flight = 0
        lock = threading.Lock()
        me = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                self.rfile.read(int(self.headers.get("content-length", 0)))
                with lock:
                    me.arrivals.append(time.perf_counter())
                    me.in_flight += 1
                    me.most_in_flight = max(me.most_in_flight, me.in_flight)
                if latency:
                    time.sleep(latency)
                with lock:
                    me.in_flight -= 1
                body = json.dumps(
                    {
                        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "shipped"}}],
                        "usage": {"prompt_tokens": usage_tokens, "completion_tokens": 0,
                                  "total_tokens": usage_tokens},
                    }
                ).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


async def drive(model: OpenAIChatModel, calls: int) -> None:
    try:
        await asyncio.gather(*(model.chat([ChatMessage.user(QUESTION)]) for _ in range(calls)))
    finally:
        await model.client.close()


def steady_rate(arrivals: list[float]) -> float:
    """Requests per minute the server saw after the first two seconds (the bucket starts full:
    a burst of one second's worth, which arrives spread out while connections are opened)."""
    times = sorted(arrivals)
    tail = [t for t in times if t >= times[0] + 2.0]
    return (len(tail) - 1) / (tail[-1] - tail[0]) * 60


def run(name: str, limit: RateLimit, server: FakeProvider, calls: int) -> tuple[float, float]:
    model = OpenAIChatModel("m", api_key="none", base_url=server.url, rate_limit=limit)
    wall, cpu = time.perf_counter(), time.process_time()
    asyncio.run(drive(model, calls))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"  {name}: {calls} calls in {wall:.1f} s, {cpu:.2f} s CPU ({cpu / wall:.0%})")
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="length of (a) and (b)")
    args = ap.parse_args()
    rows: list[tuple[str, str, str, float]] = []

    rpm = 1200.0
    server = FakeProvider()
    calls = int(rpm / 60 * args.seconds)
    run("(a) requests_per_minute", RateLimit(requests_per_minute=rpm), server, calls)
    got = steady_rate(server.arrivals)
    rows.append(("(a) requests/min", f"{rpm:.0f} rpm", f"{got:.0f} rpm", got / rpm))
    server.close()

    tpm, per_call = 60_000.0, 240
    est = estimate_tokens([ChatMessage.user(QUESTION)])
    server = FakeProvider(usage_tokens=per_call)
    calls = int(tpm / per_call / 60 * args.seconds)
    run(f"(b) tokens_per_minute (estimate {est}, reported {per_call})", RateLimit(
        tokens_per_minute=tpm), server, calls)  # fmt: skip
    got = steady_rate(server.arrivals) * per_call
    rows.append(("(b) tokens/min", f"{tpm:.0f} tpm", f"{got:.0f} tpm", got / tpm))
    server.close()

    server = FakeProvider(latency=0.05)
    run("(c) concurrency", RateLimit(concurrency=8), server, 400)
    rows.append(("(c) in flight", "8", f"{server.most_in_flight}", server.most_in_flight / 8))
    server.close()

    print(f"\n{'limit':<18} {'configured':>12} {'measured':>12} {'ratio':>7}")
    for what, conf, meas, ratio in rows:
        print(f"{what:<18} {conf:>12} {meas:>12} {ratio:>6.2f}x")


if __name__ == "__main__":
    main()
