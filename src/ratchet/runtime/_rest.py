"""The REST status API of a supervised job (FastAPI): job, checkpoint statistics, config.

The shapes follow Flink's checkpoint statistics: counts and the latest completed, failed
and restored checkpoint, each with id, trigger timestamp, duration and size.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

API_VERSION = "v1"


class WaitingRun(BaseModel):
    key: Any
    seq: int
    task: str | None = Field(description="the waiting task (None: a delayed event)")
    on: str = Field(description='"sleep", "signal NAME" or "delayed event"')
    since: float | None = None
    until: float | None = Field(None, description="when the wait ends or times out")


class Paused(BaseModel):
    resource: str
    since: float
    next_probe: float
    error: str


class JobInfo(BaseModel):
    state: Literal["starting", "running", "restarting", "finished", "failed"]
    worker_pid: int | None = Field(description="pid of the current worker process")
    resource_id: str | None = Field(description="new for every worker start")
    restarts: int
    uptime_seconds: float = Field(description="since the supervisor started")
    worker_uptime_seconds: float | None
    last_exit: str | None = Field(description="how the previous worker ended, if one did")
    in_flight_runs: int | None = Field(
        description="runs in flight at the worker's last report (after its latest checkpoint)"
    )
    queued_inputs: int | None = Field(description="inputs admitted and not finished, same time")
    waiting: list[WaitingRun] | None = Field(
        None, description="runs parked in a durable wait at the worker's last report"
    )
    paused: list[Paused] | None = Field(
        None, description="resources unavailable: no new input is admitted until they are back"
    )


class SignalBody(BaseModel):
    value: Any = Field(None, description="any JSON value; the waiting action receives it")


class RedriveAll(BaseModel):
    model_config = ConfigDict(extra="forbid")
    all: Literal[True] = Field(description="every dead letter that waits for a redrive")


class RedriveKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str = Field(description="the dead letters of this key (its text form)")


class RedriveId(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int = Field(ge=0, le=2**53, description="one dead letter (`ratchet dead-letters`)")


# Exactly one of the three, as the document says (a body with none or two is a 422).
RedriveBody = RedriveAll | RedriveKey | RedriveId


class RedriveAsked(BaseModel):
    marked: int = Field(description="dead letters marked; each is admitted once")
    bad_lines_skipped: int


class SignalSent(BaseModel):
    id: int
    key: str
    name: str
    sent_at: float


class CheckpointRef(BaseModel):
    id: int
    trigger_timestamp: float = Field(description="seconds since the epoch")
    duration_ms: float
    size_bytes: int
    restored_at: float | None = None


class FailedCheckpoint(BaseModel):
    trigger_timestamp: float
    failure_timestamp: float
    failure_message: str


class CheckpointCounts(BaseModel):
    completed: int
    failed: int
    in_progress: int
    restored: int
    total: int


class LatestCheckpoints(BaseModel):
    completed: CheckpointRef | None
    failed: FailedCheckpoint | None
    restored: CheckpointRef | None


class CheckpointStatistics(BaseModel):
    counts: CheckpointCounts
    latest: LatestCheckpoints


class RestartStrategy(BaseModel):
    type: Literal["fixed-delay"] = "fixed-delay"
    attempts: int
    delay_seconds: float


class JobConfig(BaseModel):
    checkpoint_interval_ms: float = Field(description="as the running worker reports it")
    tolerable_checkpoint_failures: int
    max_concurrent_runs: int
    max_buffered_inputs: int
    restart_strategy: RestartStrategy
    state_dir: str
    engine: dict[str, Any] = Field(description="the worker's full engine configuration")


class JobMetrics(BaseModel):
    counters: dict[str, float] = Field(
        description="process-local counters of the current worker (reset when it restarts): "
        "durable_calls.made / .replayed, chat.model_calls, chat.tokens.input / .output (and "
        "the same per model setup: chat.model_calls[SETUP], ...), and whatever actions count "
        "with ctx.metrics.inc(); GET /metrics has them summed over workers"
    )


class Unavailable(BaseModel):
    detail: str


METRICS_MEDIA_TYPE = "text/plain"


def bearer_token_ok(header: str | None, token: str) -> bool:
    """`Authorization: Bearer <token>`, compared in constant time (no early exit on a prefix)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode("utf-8"), token.encode("utf-8")
    )


def create_app(
    job: Callable[[], JobInfo],
    checkpoints: Callable[[], CheckpointStatistics | None],
    config: Callable[[], JobConfig | None],
    metrics: Callable[[], JobMetrics | None] | None = None,
    signal: Callable[[str, str, Any], dict[str, Any]] | None = None,
    redrive: Callable[[bool, str | None, int | None], dict[str, Any]] | None = None,
    prometheus: Callable[[], tuple[bytes, str]] | None = None,
    token: str | None = None,
) -> Any:
    """A FastAPI app that reads the supervisor's view through the callables.

    `prometheus` returns the body and content type of `GET /metrics`. With a `token`, every
    endpoint answers 401 without `Authorization: Bearer <token>`; the OpenAPI document
    (`/openapi.json`, `/docs`, `/redoc`) stays open: it describes the API, not the job.
    """
    from fastapi import Depends, FastAPI
    from fastapi.responses import JSONResponse, Response
    from fastapi.security import HTTPBearer

    dependencies: list[Any] = []
    unauthorized: dict[int | str, dict[str, Any]] = {}
    if token is not None:
        # Documents the scheme in OpenAPI; the middleware below enforces it.
        scheme = HTTPBearer(auto_error=False, description="the job's --rest-token")
        dependencies.append(Depends(scheme))
        unauthorized = {401: {"model": Unavailable, "description": "no or a wrong bearer token"}}

    app = FastAPI(
        title="ratchet job API",
        version=API_VERSION,
        description="Status of a supervised `ratchet run`: the job, its checkpoints, its config, "
        "its metrics (JSON and Prometheus); signals and dead-letter redrive.",
        dependencies=dependencies,
    )
    if token is not None:
        secret = token
        open_paths = {
            app.openapi_url,
            app.docs_url,
            app.redoc_url,
            app.swagger_ui_oauth2_redirect_url,
        }

        @app.middleware("http")
        async def require_token(request: Any, call_next: Any) -> Any:
            if request.url.path in open_paths or bearer_token_ok(
                request.headers.get("authorization"), secret
            ):
                return await call_next(request)
            return JSONResponse(
                {"detail": "missing or wrong bearer token"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )

    unavailable: dict[int | str, dict[str, Any]] = {
        503: {"model": Unavailable, "description": "no worker has reported yet"},
        **unauthorized,
    }
    bad_request: dict[int | str, dict[str, Any]] = {
        400: {"model": Unavailable, "description": "the request cannot be carried out"},
        **unauthorized,
    }

    @app.get(
        "/v1/job",
        response_model=JobInfo,
        responses=unauthorized,
        summary="the job and its current worker",
    )
    def get_job() -> JobInfo:
        return job()

    @app.get(
        "/v1/job/checkpoints",
        response_model=CheckpointStatistics,
        responses=unavailable,
        summary="checkpoint statistics, as the latest worker reported them",
    )
    def get_checkpoints() -> Any:
        stats = checkpoints()
        if stats is None:
            return JSONResponse({"detail": "no worker has reported yet"}, status_code=503)
        return stats

    @app.get(
        "/v1/job/config",
        response_model=JobConfig,
        responses=unavailable,
        summary="the effective configuration of the running job",
    )
    def get_config() -> Any:
        cfg = config()
        if cfg is None:
            return JSONResponse({"detail": "no worker has reported yet"}, status_code=503)
        return cfg

    @app.get(
        "/v1/job/metrics",
        response_model=JobMetrics,
        responses=unavailable,
        summary="the current worker's counters, as of its latest report",
    )
    def get_metrics() -> Any:
        m = metrics() if metrics is not None else None
        if m is None:
            return JSONResponse({"detail": "no worker has reported yet"}, status_code=503)
        return m

    if prometheus is not None:
        expose = prometheus

        @app.get(
            "/metrics",
            response_class=Response,
            response_model=None,
            responses={
                200: {
                    "description": "Prometheus text exposition format",
                    "content": {METRICS_MEDIA_TYPE: {"schema": {"type": "string"}}},
                },
                **unauthorized,
            },
            summary="the job's metrics in the Prometheus text format (for scraping)",
        )
        def get_prometheus() -> Any:
            body, content_type = expose()
            return Response(content=body, media_type=content_type)

    if signal is not None:
        send = signal

        @app.post(
            "/v1/keys/{key}/signals/{name}",
            status_code=202,
            response_model=SignalSent,
            responses=bad_request,
            summary="send a signal to a key: stored durably before the answer",
        )
        def post_signal(key: str, name: str, body: SignalBody) -> Any:
            from ratchet._errors import RatchetError

            try:
                return send(key, name, body.value)
            except RatchetError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=400)

    if redrive is not None:
        ask = redrive

        @app.post(
            "/v1/dead-letters/redrive",
            status_code=202,
            response_model=RedriveAsked,
            responses={
                404: {"model": Unavailable, "description": "no dead letter with that id waits"},
                **bad_request,
            },
            summary="admit dead letters again (one of all, key, id), each exactly once",
        )
        def post_redrive(body: RedriveBody) -> Any:
            from ratchet._errors import ConfigError, RatchetError

            all_letters = isinstance(body, RedriveAll)
            key = body.key if isinstance(body, RedriveKey) else None
            dead_id = body.id if isinstance(body, RedriveId) else None
            try:
                return ask(all_letters, key, dead_id)
            except ConfigError as exc:
                # The body names exactly one; what can still be wrong is an unknown id.
                return JSONResponse(
                    {"detail": str(exc)}, status_code=404 if dead_id is not None else 400
                )
            except RatchetError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=400)

    return app
