"""OpenTelemetry export against a real OTLP/HTTP receiver on 127.0.0.1: the protobuf it gets
holds run -> action -> call spans, model calls with GenAI attributes, and work answered from
the journal after a restore marked as replayed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra (opentelemetry-sdk)")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

import ratchet  # noqa: E402
from ratchet import Agent, EngineConfig, Event, InputEvent, OutputEvent, action  # noqa: E402
from ratchet.store._memory import MemoryStore  # noqa: E402
from ratchet.testing import FakeClock  # noqa: E402
from support.chat_agents import Asker
from support.fakeclock import START, Drive  # noqa: E402


class Receiver:
    """An OTLP/HTTP trace receiver: decodes each ExportTraceServiceRequest it is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        receiver.spans.extend(ss.spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def attrs(self, span: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kv in span.attributes:
            v = kv.value
            kind = v.WhichOneof("value")
            out[kv.key] = (
                [x.string_value for x in v.array_value.values]
                if kind == "array_value"
                else getattr(v, kind)
            )
        return out


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


def test_a_chat_run_becomes_run_action_and_genai_spans(tmp_path: Path, receiver: Receiver) -> None:
    ratchet.run(
        Asker(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s",
        config=EngineConfig(otel_endpoint=receiver.url),
    )  # fmt: skip
    spans = {s.name: s for s in receiver.spans}
    (run,) = [s for s in receiver.spans if s.name.startswith("run ")]
    assert receiver.attrs(run)["ratchet.key"] == "a"
    actions = [s for s in receiver.spans if s.name.startswith("action ")]
    assert {s.name for s in actions} >= {"action ask", "action ratchet_chat", "action answer"}
    assert all(s.parent_span_id == run.span_id and s.trace_id == run.trace_id for s in actions)
    chat = spans["chat m"]
    a = receiver.attrs(chat)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "m"
    assert a["gen_ai.usage.output_tokens"] > 0 and a["ratchet.replayed"] is False
    assert chat.parent_span_id == spans["action ratchet_chat"].span_id
    assert chat.end_time_unix_nano >= chat.start_time_unix_nano > 0


class Looked(Event):
    v: int


def lookup(n: int) -> int:
    return n + 1


class TwoSteps(Agent):
    @action(InputEvent)
    async def first(self, event: InputEvent, ctx: Any) -> None:
        v = await ctx.durable_execute_async(lookup, event.input["n"])
        ctx.send_event(Looked(v=v))

    @action(Looked)
    async def second(self, event: Looked, ctx: Any) -> None:
        await ctx.sleep(60)
        ctx.send_event(OutputEvent(output=event.v))


def test_work_answered_from_the_journal_is_exported_as_replayed(receiver: Receiver) -> None:
    clock = FakeClock(START)
    store = MemoryStore(clock)
    rows = [{"key": "a", "n": 1}]
    Drive(TwoSteps(), rows, store).run(stop_at=START + 10, follow=True, otel_endpoint=receiver.url)
    assert [s for s in receiver.spans if s.name.startswith("run ")] == []  # not completed yet
    Drive(TwoSteps(), rows, store.reopen()).run(otel_endpoint=receiver.url)
    by_name = {s.name: receiver.attrs(s) for s in receiver.spans}
    assert by_name["action first"]["ratchet.replayed"] is True
    assert by_name["action second"]["ratchet.replayed"] is False
    assert not any(n.startswith("call ") and n.endswith("lookup") for n in by_name)  # not re-made
