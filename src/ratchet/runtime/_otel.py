"""OpenTelemetry export of run traces: spans run -> action -> durable call / model / tool call.

Spans are made from a run's trace when the checkpoint that completes the run has committed,
with the times the trace recorded, so what is exported is what happened and was kept: a task
or call answered from the journal after a crash is exported as replayed (`ratchet.replayed`),
never as a fresh call. Model calls follow the GenAI semantic conventions
(`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...).
Needs the `otel` extra (the official SDK and its OTLP/HTTP exporter).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from ratchet._errors import ConfigError

_MODEL_FN = "._call_model"
_TOOL_FN = "._call_tool"


def wanted(endpoint: str | None) -> bool:
    """Export spans when an endpoint is given, or the standard OTLP variables name one."""
    return bool(
        endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


_ENV_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def check_endpoint(endpoint: str | None, flag: str = "--otel-endpoint") -> None:
    """Refuse an endpoint the exporter cannot post to: the SDK takes any string and then
    drops every span with a logged warning, so a typo would export nothing and exit 0.
    Without `endpoint`, the OTLP variables the SDK would read are checked instead."""
    example = "http://127.0.0.1:4318/v1/traces"
    if endpoint is not None:
        given = [(flag, endpoint, f"give {flag} {{}}")]
    else:
        # The traces variable wins over the general one in the SDK, so it is the one used.
        given = [
            (name, value, f"set {name} to {{}} (or unset it)")
            for name in _ENV_VARS
            if (value := os.environ.get(name))
        ][:1]
    if given and given[0][0] == "OTEL_EXPORTER_OTLP_ENDPOINT":
        example = "http://127.0.0.1:4318"  # a base URL: the SDK appends /v1/traces
    for where, url, fix in given:
        try:
            parts = urlsplit(url)
            host = parts.hostname
        except ValueError:
            host = None
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not host:
            raise ConfigError(
                f"{where} {url!r} is not an http:// or https:// URL with a host; "
                + fix.format(f"an OTLP/HTTP URL such as {example}")
            )


class RunExporter:
    """Turns completed runs' traces into spans and exports them over OTLP/HTTP."""

    def __init__(self, endpoint: str | None, agent: str) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource as OtelResource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ConfigError(
                f"OpenTelemetry export needs the otel extra: pip install 'ratchet[otel]' ({exc})"
            ) from None
        check_endpoint(endpoint, "EngineConfig(otel_endpoint=...)")
        # The SDK reads OTEL_EXPORTER_OTLP_* itself when no endpoint is given.
        exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
        self.provider = TracerProvider(
            resource=OtelResource.create({"service.name": "ratchet", "ratchet.agent": agent})
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("ratchet")
        self.agent = agent

    def export_run(self, key: Any, seq: int, failed: bool, tasks: list[dict[str, Any]]) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        known = [t["started"] for t in tasks if t.get("started") is not None]
        ends = [t["started"] + t.get("duration", 0.0) for t in tasks if t.get("started")]
        start = min(known) if known else None
        end = max(ends) if ends else start
        run = self.tracer.start_span(
            f"run {self.agent}",
            start_time=_ns(start),
            attributes={"ratchet.key": str(key), "ratchet.seq": seq, "ratchet.failed": failed},
        )
        if failed:
            run.set_status(Status(StatusCode.ERROR, "the run ended in an error"))
        ctx = trace.set_span_in_context(run)
        for t in tasks:
            replayed = bool(t.get("replayed"))
            t_start = t.get("started", start)
            attrs: dict[str, Any] = {
                "ratchet.task_id": t["task"],
                "ratchet.action": t["action"],
                "ratchet.event": t["on"],
                "ratchet.replayed": replayed,
                "ratchet.attempts": t.get("attempts", 1),
            }
            span = self.tracer.start_span(
                f"action {t['action']}", context=ctx, start_time=_ns(t_start), attributes=attrs
            )
            child = trace.set_span_in_context(span)
            models = [n for n in t.get("notes", []) if n.get("kind") == "model_call"]
            for call in t.get("calls", []):
                self._call(child, call, models)
            span.end(end_time=_ns((t_start or 0.0) + t.get("duration", 0.0)) if t_start else None)
        run.end(end_time=_ns(end))

    def _call(self, parent: Any, call: dict[str, Any], models: list[dict[str, Any]]) -> None:
        from opentelemetry.trace import Status, StatusCode

        fn = call["fn"]
        attrs: dict[str, Any] = {
            "ratchet.function": fn,
            "ratchet.replayed": bool(call.get("replayed")),
        }
        name = f"call {fn}"
        if fn.endswith(_MODEL_FN) and models:
            note = models.pop(0)
            model = str(note.get("model"))
            name = f"chat {model}"
            attrs["gen_ai.operation.name"] = "chat"
            attrs["gen_ai.request.model"] = model
            for field, attr in (
                ("input_tokens", "gen_ai.usage.input_tokens"),
                ("output_tokens", "gen_ai.usage.output_tokens"),
            ):
                if note.get(field) is not None:
                    attrs[attr] = int(note[field])
            if note.get("finish_reason"):
                attrs["gen_ai.response.finish_reasons"] = [str(note["finish_reason"])]
        elif fn.endswith(_TOOL_FN):
            name = "execute_tool"
            attrs["gen_ai.operation.name"] = "execute_tool"
        at = call.get("at")
        span = self.tracer.start_span(name, context=parent, start_time=_ns(at), attributes=attrs)
        if call.get("error"):
            span.set_status(Status(StatusCode.ERROR, str(call["error"])))
        span.end(end_time=_ns(at + call.get("duration", 0.0)) if at is not None else None)

    def close(self) -> None:
        self.provider.force_flush()
        self.provider.shutdown()


def _ns(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e9)
