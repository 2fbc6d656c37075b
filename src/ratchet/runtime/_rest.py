"""The REST status API of a supervised job (FastAPI): job, checkpoint statistics, config.

The shapes follow Flink's checkpoint statistics: counts and the latest completed, failed
and restored checkpoint, each with id, trigger timestamp, duration and size.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from fastapi import FastAPI

API_VERSION = "v1"
# A request body above this is a 413 before any endpoint reads it: a signal's value is stored
# in the state and delivered to the action, and a redrive body is a few bytes. The same limit
# as the HTTP ingestion source's default `max_body`.
MAX_BODY = 1 << 20


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


class ShardInfo(BaseModel):
    shard: int = Field(description="its index: the shard of STATE/shards/<shard>-of-<N>")
    pid: int | None = Field(description="pid of its current worker process")
    restarts: int = Field(
        description="times a coordinator restarted this shard's worker since the supervisor "
        "started (kept across restarts of the coordinator, as ratchet_shard_restarts_total)"
    )
    reported: bool = Field(description="whether its current worker has reported yet")
    in_flight_runs: int | None = None
    queued_inputs: int | None = None
    checkpoints: CheckpointStatistics | None = Field(
        None, description="its own checkpoint statistics (ids are the shard's own)"
    )


class JobInfo(BaseModel):
    state: Literal["starting", "running", "restarting", "finished", "failed"]
    worker_pid: int | None = Field(description="pid of the current worker process")
    resource_id: str | None = Field(description="new for every worker start")
    restarts: int = Field(
        description="workers the supervisor restarted since it started, in all (never reset)"
    )
    restarts_counted: int | None = Field(
        default=None,
        description="the restarts --restart-attempts limits now (restart N/attempts in the "
        "log): since the supervisor started, or since the last worker that ran "
        "--restart-reset-after seconds; 0 once the current worker has run that long",
    )
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
    shards: list[ShardInfo] | None = Field(
        None,
        description="a job run with --workers N: each shard's worker (worker_pid is then the "
        "coordinator's; the counts above are summed over the shards)",
    )


class SignalBody(BaseModel):
    # Only `value`: `{"approved": true}` without it was taken as a signal of null.
    model_config = ConfigDict(extra="forbid")
    value: Any = Field(None, description="any JSON value; the waiting action receives it")


class RedriveAll(BaseModel):
    model_config = ConfigDict(extra="forbid")
    all: Literal[True] = Field(description="every dead letter that waits for a redrive")


class RedriveKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str = Field(description="the dead letters of this key (its text form)")
    key_type: Literal["auto", "str", "int"] = Field(
        "auto",
        description='the string key "1" or the integer key 1 (auto: the one the state holds; '
        "a state holding both refuses auto)",
    )


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
    key_type: Literal["str", "int"] | None = Field(
        None, description="the key it is for, of the two of its text; absent: either"
    )


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
    """What the supervisor does when its worker dies (docs/operations.md, "What the supervisor
    restarts")."""

    # A str, not a Literal, and the fields after `delay_seconds` optional: a newer `ratchet
    # status --url` reads an older supervisor ("fixed-delay", without them).
    type: str = Field(
        default="fixed-delay-with-reset",
        description="a fixed delay, doubled only while a connector's server cannot be reached "
        "at start; the count of restarts starts again after a worker ran reset_after_seconds",
    )
    attempts: int = Field(
        description="restarts allowed in a row (--restart-attempts); one more death ends the job"
    )
    delay_seconds: float = Field(description="the delay before a restart (--restart-delay)")
    reset_after_seconds: float | None = Field(
        default=None,
        description="a worker that runs this long (from its first report) starts the count of "
        "attempts again (--restart-reset-after); 0: never",
    )
    unreachable_delay_factor: float | None = Field(
        default=None,
        description="the delay is multiplied by this for each worker in a row that could not "
        "reach a connector's server at start",
    )
    unreachable_max_delay_seconds: float | None = Field(
        default=None, description="up to this delay (30 s, or delay_seconds if that is longer)"
    )


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


class InvalidPart(BaseModel):
    loc: list[str | int] = Field(description="where: ['query', name] for a query parameter")
    msg: str
    type: str


class Invalid(BaseModel):
    """A 422 answer: FastAPI's for a value out of range, ratchet's for an unknown query
    parameter (both carry more fields at times: FastAPI's echoes the `input`, with NaN and
    infinite numbers as the text "NaN", "Infinity", "-Infinity")."""

    detail: list[InvalidPart]


class HistorySample(BaseModel):
    t: float = Field(
        description="when the supervisor received the report (seconds since the epoch)"
    )
    inputs: float
    runs_completed: float
    outputs: float
    runs_failed: float
    dead_letters: float
    in_flight_runs: int | None
    queued_inputs: int | None
    waiting_runs: int
    restarts: int
    checkpoint: dict[str, Any] | None = Field(
        description="the latest completed checkpoint: id, duration_ms, size_bytes, "
        "trigger_timestamp"
    )


class JobHistory(BaseModel):
    samples: list[HistorySample] = Field(
        description="one per worker report (after a restore and after every checkpoint), "
        "oldest first; counts are totals over the supervisor's workers"
    )


class KeyList(BaseModel):
    total: int = Field(description="keys matching the search")
    keys: list[str] = Field(description="their text forms, in order, at most `limit`")
    key_types: list[Literal["str", "int"]] = Field(
        description='the type of each of `keys`, in the same order: the string key "1" and '
        "the integer key 1 are two keys of one text (pass it as ?key_type= to read one)"
    )


class MemoryField(BaseModel):
    path: str
    type: str = Field(description="the stored value's type name")
    value: Any = None


class KeyMemory(BaseModel):
    key: str
    fields: list[MemoryField]
    memory: dict[str, Any] = Field(description="as `ratchet inspect --json` shows it")


class RunSummary(BaseModel):
    key: str
    seq: int
    completed_at: float
    status: str
    tasks: int | None = None
    key_type: Literal["str", "int"] | None = Field(
        None, description="whose run, of the two keys of a text like 1; absent: not recorded"
    )


class RunsView(BaseModel):
    in_flight: list[dict[str, Any]] = Field(description="as `ratchet runs list --json`")
    waiting: list[dict[str, Any]] = Field(description="parked runs and what they wait on")
    recent: list[RunSummary] = Field(description="completed runs with a kept trace, newest first")


class Trace(BaseModel):
    key: str
    seq: int
    completed_at: float
    status: str
    started_at: float | None = None
    key_type: Literal["str", "int"] | None = Field(
        None, description="whose run, of the two keys of a text like 1; absent: not recorded"
    )
    tasks: list[Any]


class Approval(BaseModel):
    key: Any
    seq: int
    call_id: str
    signal: str = Field(description="POST /v1/keys/{key}/signals/{signal} decides it")
    since: float | None = None
    tool: str | None = None
    arguments: Any = None
    description: str | None = None


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
    signal: Callable[..., dict[str, Any]] | None = None,
    redrive: Callable[[bool, str | None, int | None, str], dict[str, Any]] | None = None,
    prometheus: Callable[[], tuple[bytes, str]] | None = None,
    token: str | None = None,
    history: Callable[[], list[dict[str, Any]]] | None = None,
    open_state: Callable[[], Any] | None = None,
) -> Any:
    """A FastAPI app that reads the supervisor's view through the callables.

    `prometheus` returns the body and content type of `GET /metrics`. With a `token`, every
    endpoint answers 401 without `Authorization: Bearer <token>`; the OpenAPI document
    (`/openapi.json`, `/docs`, `/redoc`) stays open: it describes the API, not the job, and so
    does the dashboard's page (`/` and `/dashboard/*`): it holds no data and asks for the token.
    `open_state` opens the job's state read-only (`ratchet.open_state`) for the endpoints
    that read it: keys and memory, runs, traces, dead letters, approvals.
    """
    from fastapi import Depends, FastAPI, Query, Request
    from fastapi.encoders import jsonable_encoder
    from fastapi.exceptions import RequestValidationError
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
        # Every endpoint: a query parameter it does not take (`known_query_parameters`); the
        # endpoints with parameters also for a value out of range (FastAPI's own answer).
        responses={
            422: {
                "model": Invalid,
                "description": "an unknown query parameter, or an invalid value",
            }
        },
    )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Any, exc: RequestValidationError) -> Any:
        """FastAPI's own 422 answer, its echoed inputs made JSON: a body holding 1e400 or NaN
        (which the JSON parser reads as floats) made the default answer fail, a 500 in plain
        text and a traceback in the supervisor's log."""
        return JSONResponse({"detail": _json_safe(jsonable_encoder(exc.errors()))}, 422)

    @app.middleware("http")
    async def known_query_parameters(request: Any, call_next: Any) -> Any:
        """A query parameter the endpoint does not take is refused, not ignored: a misspelt
        one (`?limt=5`) would otherwise answer as if it had not been given."""
        if request.query_params:
            unknown = _unknown_query_parameters(app, request.scope, request.query_params)
            if unknown:
                return JSONResponse(
                    {
                        "detail": [
                            {"loc": ["query", name], "msg": "unknown query parameter",
                             "type": "extra_forbidden"}
                            for name in unknown
                        ]
                    },
                    status_code=422,
                )  # fmt: skip
        return await call_next(request)

    if token is not None:
        secret = token
        open_paths = {
            app.openapi_url,
            app.docs_url,
            app.redoc_url,
            app.swagger_ui_oauth2_redirect_url,
            "/",
            *(f"/dashboard/{name}" for name in DASHBOARD_FILES),
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

        def post_signal(
            request: Any,
            key: str,
            name: str,
            body: SignalBody,
            key_type: Literal["auto", "str", "int"] = Query(
                "auto",
                description='the string key "1" or the integer key 1 (auto: the one the '
                "state holds; a state holding both refuses auto)",
            ),
        ) -> Any:
            from ratchet._errors import RatchetError
            from ratchet.runtime._shards import int_text

            key, name = _signal_target(request.scope, key, name)
            if key_type == "int" and not int_text(key):
                return JSONResponse(
                    {"detail": f"key {key!r} is not an integer: no integer key has that text"},
                    status_code=404,
                )
            try:
                return send(key, name, body.value, key_type)
            except RatchetError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=400)

        # The class, not its name: this module's annotations are text, which FastAPI reads in
        # the module's globals, and fastapi is imported only here (the server extra).
        post_signal.__annotations__["request"] = Request
        # `{name:path}`: the server decodes %2F before routing, so a name holding "/" (sent
        # as %2F) reached no route; the key and name are read from the path as sent.
        app.post(
            "/v1/keys/{key:path}/signals/{name:path}",
            status_code=202,
            response_model=SignalSent,
            responses={
                404: {"model": Unavailable, "description": "key_type=int and a key no integer has"},
                **bad_request,
            },
            summary="send a signal to a key: stored durably before the answer",
            description="The name is what follows the last `/signals/` of the path as sent: "
            "percent-encode a `/` in it as `%2F`.",
        )(post_signal)

    if redrive is not None:
        ask = redrive

        @app.post(
            "/v1/dead-letters/redrive",
            status_code=202,
            response_model=RedriveAsked,
            responses={
                404: {
                    "model": Unavailable,
                    "description": "no dead letter with that id waits; key_type int and a key "
                    "no integer has",
                },
                **bad_request,
            },
            summary="admit dead letters again (one of all, key, id), each exactly once",
        )
        def post_redrive(body: RedriveBody) -> Any:
            from ratchet._errors import ConfigError, RatchetError
            from ratchet.runtime._shards import int_text

            all_letters = isinstance(body, RedriveAll)
            key = body.key if isinstance(body, RedriveKey) else None
            key_type = body.key_type if isinstance(body, RedriveKey) else "auto"
            dead_id = body.id if isinstance(body, RedriveId) else None
            if key is not None and key_type == "int" and not int_text(key):
                # As the key endpoints answer it: no integer key has that text (it was a 400).
                return JSONResponse(
                    {"detail": f"key {key!r} is not an integer: no integer key has that text"},
                    status_code=404,
                )
            try:
                return ask(all_letters, key, dead_id, key_type)
            except ConfigError as exc:
                # The body names exactly one; what can still be wrong is an unknown id.
                return JSONResponse(
                    {"detail": str(exc)}, status_code=404 if dead_id is not None else 400
                )
            except RatchetError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=400)

    if history is not None:
        samples = history

        @app.get(
            "/v1/job/history",
            response_model=JobHistory,
            responses=unauthorized,
            summary="the job's figures over time (the dashboard's charts)",
        )
        def get_history() -> Any:
            return {"samples": samples()}

    if open_state is not None:
        _state_endpoints(app, open_state, unauthorized)

    _dashboard(app)
    # Outermost: a body over the limit is refused before the token and query checks read it.
    app.add_middleware(_BodyLimit, limit=MAX_BODY)
    return app


def _signal_target(scope: Any, key: str, name: str) -> tuple[str, str]:
    """The key and the signal name of `POST /v1/keys/{key}/signals/{name}`, from the path as
    sent: the name is what follows its last `/signals/`, so a name holding "/" is reached
    sent as %2F (decoded before routing, it split the name), and a key holding "/" too.
    `key` and `name` (from the decoded path) when the server gives no such path."""
    from urllib.parse import unquote

    raw = scope.get("raw_path")
    prefix = f"/{API_VERSION}/keys/"
    try:
        sent = raw.decode("ascii") if isinstance(raw, bytes) else ""
    except UnicodeDecodeError:
        return key, name
    head, found, tail = sent.rpartition("/signals/")
    if not found or not head.startswith(prefix):
        return key, name
    return unquote(head.removeprefix(prefix)), unquote(tail)


def _json_safe(value: Any) -> Any:
    """`value` with every non-finite float as the text JSON has no number for ("NaN",
    "Infinity", "-Infinity"): a JSON answer cannot hold them as numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


class _BodyLimit:
    """Refuse a request body over `limit` bytes with a 413, by its Content-Length or, for a
    chunked body, by counting it; the body is read at most to the limit."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._refuse(send, int(length))
            return
        if length is not None and length.isdigit():  # the server stops at Content-Length
            await self.app(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse(send, None)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any, length: int | None) -> None:
        import json

        size = f"{length} bytes" if length is not None else f"more than {self.limit} bytes"
        body = json.dumps(
            {"detail": f"the request body has {size}; the limit is {self.limit} bytes"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


DASHBOARD_FILES = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}


def _dashboard_file(name: str) -> bytes:
    from importlib.resources import files

    return (files("ratchet.runtime") / "dashboard" / name).read_bytes()


def _dashboard(app: FastAPI) -> None:
    """The web dashboard: static files of the package (no build step, nothing fetched from
    elsewhere: it works offline), reading the JSON endpoints of this API."""
    from fastapi.responses import Response

    @app.get("/", include_in_schema=False)
    def get_dashboard() -> Any:
        return Response(_dashboard_file("index.html"), media_type="text/html; charset=utf-8")

    for name, media in DASHBOARD_FILES.items():

        def serve(name: str = name, media: str = media) -> Any:
            return Response(_dashboard_file(name), media_type=media)

        app.add_api_route(f"/dashboard/{name}", serve, methods=["GET"], include_in_schema=False)


def _state_endpoints(
    app: FastAPI, open_state: Callable[[], Any], unauthorized: dict[int | str, dict[str, Any]]
) -> None:
    """Read-only views of the job's state, each in one read transaction (ratchet.open_state):
    safe while the worker writes, and they see only committed checkpoints."""
    from fastapi import Query
    from fastapi.responses import JSONResponse

    from ratchet._errors import InvalidArgumentError, StateError

    no_state: dict[int | str, dict[str, Any]] = {
        503: {"model": Unavailable, "description": "the state cannot be read (not created yet)"},
        **unauthorized,
    }
    not_found: dict[int | str, dict[str, Any]] = {
        404: {"model": Unavailable, "description": "nothing committed under that name"},
        **no_state,
    }
    # A key's traces: the string key "1" and the integer key 1 are two keys.
    which_key: dict[int | str, dict[str, Any]] = {
        400: {"model": Unavailable, "description": "key_type=auto and the state holds both "
              "keys of the text: say which"},
    }  # fmt: skip
    key_type_doc = 'the string key "1" or the integer key 1 (auto: the one the state holds;'

    def read(fn: Callable[[Any], Any]) -> Any:
        try:
            with open_state() as state:
                return fn(state)
        except StateError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=503)
        except InvalidArgumentError as exc:  # which key is meant: the caller must say
            return JSONResponse({"detail": str(exc)}, status_code=400)

    def missing(what: str) -> Any:
        return JSONResponse({"detail": what}, status_code=404)

    @app.get(
        "/v1/keys",
        response_model=KeyList,
        responses=no_state,
        summary="keys with committed memory, optionally those whose text contains a search",
    )
    def get_keys(
        contains: str | None = Query(None, max_length=200, description="case-insensitive"),
        limit: int = Query(100, ge=0, le=10_000),
    ) -> Any:
        def fn(s: Any) -> Any:
            typed = s._typed_keys(contains, limit)
            return {
                "total": s.count_keys(contains),
                "keys": [text for text, _kind in typed],
                "key_types": [kind for _text, kind in typed],
            }

        return read(fn)

    @app.get(
        "/v1/keys/{key:path}/memory",
        response_model=KeyMemory,
        responses={**which_key, **not_found},
        summary="a key's committed memory: each field with its type, and the whole as JSON",
    )
    def get_memory(
        key: str,
        key_type: Literal["auto", "str", "int"] = Query(
            "auto", description=key_type_doc + " a state holding both refuses auto)"
        ),
    ) -> Any:
        from ratchet.runtime._shards import int_text

        def fn(s: Any) -> Any:
            fields = (
                s.memory_fields(key, key_type=key_type)
                if key_type != "int" or int_text(key)
                else None
            )
            if fields is None:
                what = f"key {key!r}" if key_type == "auto" else f"{key_type} key {key!r}"
                return missing(f"{what} has no committed memory")
            memory = s.memory(key, as_json=True, key_type=key_type)
            return {"key": key, "fields": fields, "memory": memory}

        return read(fn)

    @app.get(
        "/v1/keys/{key:path}/runs",
        response_model=list[RunSummary],
        responses={
            404: {"model": Unavailable, "description": "key_type=int and a key no integer has"},
            **which_key,
            **no_state,
        },
        summary="a key's completed runs that have a kept trace, newest first",
    )
    def get_key_runs(
        key: str,
        key_type: Literal["auto", "str", "int"] = Query(
            "auto", description=key_type_doc + " a state holding both refuses auto)"
        ),
    ) -> Any:
        from ratchet.runtime._shards import int_text

        if key_type == "int" and not int_text(key):
            return missing(f"key {key!r} is not an integer: no integer key has that text")
        return read(
            lambda s: [
                {k: t[k] for k in ("key", "seq", "completed_at", "status", "key_type") if k in t}
                | {"tasks": len(t["tasks"])}
                for t in s.traces(key, key_type=key_type)
            ]
        )

    @app.get(
        "/v1/keys/{key:path}/runs/{seq}/trace",
        response_model=Trace,
        responses={**which_key, **not_found},
        summary="the trace of one completed run (`ratchet trace --key K --seq N --json`)",
    )
    def get_trace(
        key: str,
        seq: int,
        key_type: Literal["auto", "str", "int"] = Query(
            "auto", description=key_type_doc + " the run of the input seq)"
        ),
    ) -> Any:
        from ratchet.runtime._shards import int_text

        def fn(s: Any) -> Any:
            found = (
                s.traces(key, seq, key_type=key_type)
                if -(2**63) <= seq < 2**63 and (key_type != "int" or int_text(key))
                else []
            )
            if not found:
                return missing(f"no kept trace for key {key!r}, input {seq}")
            return found[0]

        return read(fn)

    @app.get(
        "/v1/runs",
        response_model=RunsView,
        responses=no_state,
        summary="runs in flight, runs waiting, and the most recently completed runs",
    )
    def get_runs(recent: int = Query(50, ge=0, le=1000)) -> Any:
        return read(
            lambda s: {
                "in_flight": s.runs_in_flight(),
                "waiting": s.waiting(),
                "recent": s.recent_runs(recent),
            }
        )

    @app.get(
        "/v1/dead-letters",
        response_model=list[dict[str, Any]],
        responses=no_state,
        summary="dead letters, oldest first (`ratchet dead-letters --json`)",
    )
    def get_dead_letters() -> Any:
        return read(lambda s: s.dead_letters())

    @app.get(
        "/v1/approvals",
        response_model=list[Approval],
        responses=no_state,
        summary="tool calls waiting for a person's decision",
    )
    def get_approvals() -> Any:
        return read(lambda s: s.approvals())


def _unknown_query_parameters(app: Any, scope: Any, given: Any) -> list[str]:
    """The query parameters of a request that the API endpoint it reaches does not declare
    (none for a path that is not an API endpoint: documents, the dashboard)."""
    from fastapi.routing import APIRoute
    from starlette.routing import Match

    def declared(dependant: Any) -> set[str]:  # its own and its dependencies' query parameters
        names = {p.alias for p in dependant.query_params}
        for sub in dependant.dependencies:
            names |= declared(sub)
        return names

    for route in app.router.routes:
        if isinstance(route, APIRoute) and route.matches(scope)[0] == Match.FULL:
            return sorted(set(given.keys()) - declared(route.dependant))
    return []
