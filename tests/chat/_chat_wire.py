"""Real HTTP servers on 127.0.0.1 speaking the OpenAI, Anthropic and Ollama wire protocols.

Replies come from a `ScriptedChatModel` (chosen by the conversation, so a resent request gets
the same answer). Faults queued with `fail_next` are served first: an HTTP status with
headers, a delay longer than the client's timeout, or a malformed body. Every request is
recorded, so tests count what reached the "provider".
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ratchet.agents.chat import ChatMessage, MessageRole, ScriptedChatModel, ToolCall
from ratchet.agents.chat._providers._scripted import count_tokens


@dataclass
class Fault:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    delay: float = 0.0
    trickle: float = 0.0  # the normal reply, its bytes sent this many seconds apart


_TRICKLE = "x-test-trickle"  # internal: how the handler learns a reply is to be trickled


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


class WireServer:
    """Base: a threaded HTTP server; subclasses translate one provider's protocol."""

    path = "/"

    def __init__(self, script: ScriptedChatModel, marker_dir: Path | None = None) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.faults: list[Fault] = []
        self.hang_on: dict[int, float] = {}  # reply number -> seconds to stall (first time only)
        self.marker_dir = marker_dir
        self.by_digest: Counter[str] = Counter()
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("content-length", 0))
                raw = self.rfile.read(length)
                status, headers, body = outer._handle(self.path, dict(self.headers), raw)
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        if k != _TRICKLE:
                            self.send_header(k, v)
                    self.send_header("content-length", str(len(body)))
                    gap = float(headers.get(_TRICKLE, 0))
                    self.end_headers()
                    if gap:
                        for i in range(len(body)):
                            self.wfile.write(body[i : i + 1])
                            self.wfile.flush()
                            time.sleep(gap)
                    else:
                        self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> WireServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def fail_next(self, *faults: Fault) -> None:
        self.faults.extend(faults)

    def count(self, reply_number: int) -> int:
        """How many requests asked for reply #n (1-based: n-1 assistant messages before)."""
        with self._lock:
            return sum(1 for r in self.requests if self._turn(r) == reply_number - 1)

    def _marker(self, name: str) -> None:
        if self.marker_dir is not None:
            (self.marker_dir / name).write_text("x")

    def _handle(
        self, path: str, headers: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        body = json.loads(raw or b"{}")
        with self._lock:
            self.requests.append(body)
            self.headers.append({k.lower(): v for k, v in headers.items()})
            self.by_digest[_digest(body)] += 1
            fault = self.faults.pop(0) if self.faults else None
            turn = self._turn(body)
            n = sum(1 for r in self.requests if self._turn(r) == turn)
        self._marker(f"request_{turn + 1}_{n}")
        if turn + 1 in self.hang_on and n == 1:
            time.sleep(self.hang_on[turn + 1])
        if fault is not None:
            if fault.delay:
                time.sleep(fault.delay)
            if fault.status != 200 or fault.body is not None:
                payload = fault.body if fault.body is not None else self.error_body(fault.status)
                return fault.status, {"content-type": "application/json", **fault.headers}, payload
        messages = self.to_messages(body)
        try:
            reply = self.script.reply_for(messages)
        except Exception as exc:  # noqa: BLE001 - a script error becomes a 500 the test sees
            return 500, {"content-type": "application/json"}, self.error_body(500, str(exc))
        out = self.from_reply(body, reply, count_tokens(messages), count_tokens([reply]))
        self._marker(f"response_{turn + 1}_{n}")
        headers = {"content-type": "application/json"}
        if fault is not None and fault.trickle:
            headers[_TRICKLE] = str(fault.trickle)
        return 200, headers, json.dumps(out).encode()

    def _turn(self, body: dict[str, Any]) -> int:
        return sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")

    # provider-specific
    def to_messages(self, body: dict[str, Any]) -> list[ChatMessage]:
        raise NotImplementedError

    def from_reply(
        self, body: dict[str, Any], reply: ChatMessage, tin: int, tout: int
    ) -> dict[str, Any]:
        raise NotImplementedError

    def error_body(self, status: int, message: str = "") -> bytes:
        raise NotImplementedError


class OpenAIServer(WireServer):
    def to_messages(self, body: dict[str, Any]) -> list[ChatMessage]:
        out = []
        for m in body["messages"]:
            calls = [
                ToolCall(
                    id=c["id"],
                    name=c["function"]["name"],
                    arguments=json.loads(c["function"]["arguments"]),
                )
                for c in m.get("tool_calls") or []
            ]
            out.append(
                ChatMessage(
                    role=MessageRole(m["role"]),
                    content=m.get("content") or "",
                    tool_calls=calls,
                    tool_call_id=m.get("tool_call_id"),
                )
            )
        return out

    def from_reply(
        self, body: dict[str, Any], reply: ChatMessage, tin: int, tout: int
    ) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
        if reply.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.name, "arguments": json.dumps(tc.arguments)},
                }
                for tc in reply.tool_calls
            ]
        return {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "m"),
            "choices": [
                {
                    "index": 0,
                    "message": msg,
                    "finish_reason": "tool_calls" if reply.tool_calls else "stop",
                }
            ],
            "usage": {"prompt_tokens": tin, "completion_tokens": tout, "total_tokens": tin + tout},
        }

    def error_body(self, status: int, message: str = "") -> bytes:
        return json.dumps(
            {
                "error": {
                    "message": message or f"test error {status}",
                    "type": "test",
                    "code": status,
                }
            }
        ).encode()


class AnthropicServer(WireServer):
    def to_messages(self, body: dict[str, Any]) -> list[ChatMessage]:
        out = []
        if body.get("system"):
            out.append(ChatMessage.system(body["system"]))
        for m in body["messages"]:
            content = m["content"]
            if isinstance(content, str):
                out.append(ChatMessage(role=MessageRole(m["role"]), content=content))
                continue
            if m["role"] == "assistant":
                text = "".join(b.get("text", "") for b in content if b["type"] == "text")
                calls = [
                    ToolCall(id=b["id"], name=b["name"], arguments=b["input"])
                    for b in content
                    if b["type"] == "tool_use"
                ]
                out.append(ChatMessage.assistant(text, calls))
            else:
                for b in content:
                    if b["type"] == "tool_result":
                        out.append(
                            ChatMessage(
                                role=MessageRole.TOOL,
                                content=b["content"],
                                tool_call_id=b["tool_use_id"],
                                extras={"is_error": b.get("is_error", False)},
                            )
                        )
                    else:
                        out.append(ChatMessage.user(b.get("text", "")))
        return out

    def from_reply(
        self, body: dict[str, Any], reply: ChatMessage, tin: int, tout: int
    ) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if reply.content:
            content.append({"type": "text", "text": reply.content})
        for tc in reply.tool_calls:
            content.append(
                {"type": "tool_use", "id": tc.id, "name": tc.name, "input": tc.arguments}
            )
        return {
            "id": "msg_test",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", "m"),
            "content": content,
            "stop_reason": "tool_use" if reply.tool_calls else "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": tin, "output_tokens": tout},
        }

    def error_body(self, status: int, message: str = "") -> bytes:
        kind = {429: "rate_limit_error", 401: "authentication_error"}.get(status, "api_error")
        return json.dumps(
            {"type": "error", "error": {"type": kind, "message": message or f"test error {status}"}}
        ).encode()


class OllamaServer(WireServer):
    def to_messages(self, body: dict[str, Any]) -> list[ChatMessage]:
        out = []
        for m in body["messages"]:
            calls = [
                ToolCall(
                    id=f"ollama_{i}",
                    name=c["function"]["name"],
                    arguments=c["function"]["arguments"],
                )
                for i, c in enumerate(m.get("tool_calls") or [])
            ]
            out.append(
                ChatMessage(
                    role=MessageRole(m["role"]), content=m.get("content") or "", tool_calls=calls
                )
            )
        return out

    def from_reply(
        self, body: dict[str, Any], reply: ChatMessage, tin: int, tout: int
    ) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            msg["tool_calls"] = [
                {"function": {"name": tc.name, "arguments": tc.arguments}}
                for tc in reply.tool_calls
            ]
        return {
            "model": body.get("model", "m"),
            "created_at": "2025-01-01T00:00:00Z",
            "message": msg,
            "done": True,
            "done_reason": "stop",
            "prompt_eval_count": tin,
            "eval_count": tout,
        }

    def error_body(self, status: int, message: str = "") -> bytes:
        return json.dumps({"error": message or f"test error {status}"}).encode()


def sync(fn: Any) -> Any:
    """Run an async test function with asyncio.run (no async plugin needed)."""
    import asyncio
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return wrapper
