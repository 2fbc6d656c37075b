"""The REST status API of a supervised job (FastAPI): job, checkpoint statistics, config.

The shapes follow Flink's checkpoint statistics: counts and the latest completed, failed
and restored checkpoint, each with id, trigger timestamp, duration and size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

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


class RedriveBody(BaseModel):
    all: bool = False
    key: str | None = None
    id: int | None = None


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
        "durable_calls.made / .replayed, chat.model_calls, chat.tokens.input / .output, and "
        "whatever actions count with ctx.metrics.inc()"
    )


class Unavailable(BaseModel):
    detail: str


def create_app(
    job: Callable[[], JobInfo],
    checkpoints: Callable[[], CheckpointStatistics | None],
    config: Callable[[], JobConfig | None],
    metrics: Callable[[], JobMetrics | None] | None = None,
    signal: Callable[[str, str, Any], dict[str, Any]] | None = None,
    redrive: Callable[[bool, str | None, int | None], dict[str, Any]] | None = None,
) -> Any:
    """A FastAPI app that reads the supervisor's view through the three callables."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(
        title="ratchet job API",
        version=API_VERSION,
        description="Status of a supervised `ratchet run`: the job, its checkpoints, its config.",
    )

    @app.get("/v1/job", response_model=JobInfo, summary="the job and its current worker")
    def get_job() -> JobInfo:
        return job()

    @app.get(
        "/v1/job/checkpoints",
        response_model=CheckpointStatistics,
        responses={503: {"model": Unavailable}},
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
        responses={503: {"model": Unavailable}},
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
        responses={503: {"model": Unavailable}},
        summary="the current worker's counters, as of its latest report",
    )
    def get_metrics() -> Any:
        m = metrics() if metrics is not None else None
        if m is None:
            return JSONResponse({"detail": "no worker has reported yet"}, status_code=503)
        return m

    if signal is not None:
        send = signal

        @app.post(
            "/v1/keys/{key}/signals/{name}",
            status_code=202,
            response_model=SignalSent,
            responses={400: {"model": Unavailable}},
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
            responses={400: {"model": Unavailable}},
            summary="admit dead letters again (one of all, key, id), each exactly once",
        )
        def post_redrive(body: RedriveBody) -> Any:
            from ratchet._errors import RatchetError

            try:
                return ask(body.all, body.key, body.id)
            except RatchetError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=400)

    return app
