"""`RunnerContext`, what an action receives, and the binding that lets the engine run actions."""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import inspect
import logging
import math
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

from ratchet._clock import SYSTEM_CLOCK
from ratchet._errors import (
    UPGRADE_FIXES,
    CheckpointError,
    CodecError,
    ConfigError,
    IncompatibleChangeError,
    InternalError,
    InvalidArgumentError,
    InvalidTypeError,
    MigrationError,
    NonDeterminismError,
    RatchetError,
    SignalTimeout,
)
from ratchet.agents._agent import Agent, AgentSpec
from ratchet.agents._events import (
    DelayedEvent,
    Emitted,
    ErrorEvent,
    Event,
    InputEvent,
    OutputEvent,
    emitted_from_wire,
    freeze,
)
from ratchet.agents._exceptions import encode_error, rebuild_error
from ratchet.agents._ltm import LongTermMemory, LongTermMemoryConfig
from ratchet.agents._memory import MemoryBuffer, MemoryObject
from ratchet.agents._resource import Resource
from ratchet.agents._retry import Retry
from ratchet.runtime._dispatch import RETRY_FN, SIGNAL_FN, SLEEP_FN, TaskCalls, Waits
from ratchet.runtime._machine import Output, Task, TaskResult
from ratchet.runtime._metrics import KeyMetrics, Metrics
from ratchet.store import codec
from ratchet.store._base import AgentVersion, DispatchTable, ltm_key_scope

log = logging.getLogger("ratchet.agents")

T = TypeVar("T")

_current: contextvars.ContextVar[RunnerContext | None] = contextvars.ContextVar(
    "ratchet_ctx", default=None
)


# Errors a durable call raises for the engine, not for the action: they stop the job (the last
# checkpoint is intact) instead of becoming the action's ErrorEvent.
ENGINE_FAULTS = (NonDeterminismError, CheckpointError, InternalError)


def _fn_name(fn: Callable[..., Any]) -> str:
    target = getattr(fn, "__func__", fn)
    owner = getattr(target, "__objclass__", None)
    module = getattr(target, "__module__", None) or getattr(owner, "__module__", None) or "builtins"
    qual = getattr(target, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qual}"


def _args_digest(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    try:
        return codec.digest((args, kwargs))
    except TypeError:
        # Arguments that cannot be stored (a client object, say) count by their type only.
        def part(v: Any) -> Any:
            try:
                codec.check_admissible(v)
                return v
            except TypeError:
                return f"<{type(v).__module__}.{type(v).__qualname__}>"

        return codec.digest((tuple(part(a) for a in args), {k: part(v) for k, v in kwargs.items()}))


class _Ended:
    """Stands in for a finished task's event list, memory ops and call journal: a ctx kept
    past its action (in a thread, an attribute) wrote into buffers nobody read again, and
    its durable calls left records of a completed run."""

    __slots__ = ("_task",)

    def __init__(self, task: Task) -> None:
        self._task = task  # the message is made only when it is needed: sealing is per task

    def _refuse(self, *_args: Any, **_kwargs: Any) -> Any:
        task = self._task
        raise InvalidArgumentError(
            f"the ctx of action {task.action} (key {task.run.key!r}, input {task.run.seq}) "
            f"was used after the action returned, and what it did would be lost: do an "
            f"action's work (memory, events, durable calls) before it returns, and join any "
            f"thread it starts"
        )

    append = _refuse

    def __getattr__(self, name: str) -> Any:
        self._refuse()


class RunnerContext:
    """What an action gets besides its event: its key, memory, event sending and durable calls.

    - `short_term_memory`: per key, across runs. `sensory_memory`: per run, cleared after it.
    - Reads see the memory as it was when this task was dispatched, plus this task's own writes;
      writes become visible to later tasks of the run when this task commits.
    - `durable_execute` records a call's result before returning it; after a crash the
      recorded result is returned instead of calling again.
    """

    def __init__(
        self,
        task: Task,
        calls: TaskCalls | None,
        config: dict[str, Any],
        metrics: Metrics | None = None,
        waits: Waits | None = None,
        make_calls: Callable[[Task], TaskCalls] | None = None,
    ) -> None:
        self._task = task
        self._metrics = metrics or Metrics()
        # The task's durable-call journal; without one (the fused inline path: a task with no
        # records from before a restart) `make_calls(task)` makes it when first needed, and
        # `waits` is the engine's (what the journal would carry).
        self._calls_made = calls
        self._make_calls = make_calls
        self._waits_of = calls.waits if calls is not None else waits
        self.events: list[Emitted] = []
        self.config = config

    # Made when an action first needs them (most tasks touch one memory or none, make no
    # durable call and note nothing); until then the class's None is read.
    _stm_buf: MemoryBuffer | None = None
    _sensory_buf: MemoryBuffer | None = None
    _stm_view: MemoryObject | None = None
    _sensory_view: MemoryObject | None = None
    _trace_calls: list[dict[str, Any]] | None = None  # durable calls, for the trace
    _notes: list[dict[str, Any]] | None = None
    _ltm: Any = None
    _ltm_texts_made: dict[tuple[str, str], int] | None = None

    @property
    def _calls(self) -> TaskCalls:
        calls = self._calls_made
        if calls is None:
            with _MAKING_CALLS:  # threads an inline action starts may make calls at once
                calls = self._calls_made
                if calls is None:
                    if self._make_calls is None:
                        raise InternalError("a RunnerContext has no durable-call journal")
                    calls = self._calls_made = self._make_calls(self._task)
        return calls

    @property
    def _ltm_texts(self) -> dict[tuple[str, str], int]:
        texts = self._ltm_texts_made
        if texts is None:
            texts = self._ltm_texts_made = {}
        return texts

    @property
    def _stm(self) -> MemoryBuffer:
        buf = self._stm_buf
        if buf is None:
            self._refuse_if_ended()
            waits = self._waits_of
            buf = self._stm_buf = MemoryBuffer(
                self._task.stm, "short_term", waits.now if waits is not None else None
            )
        return buf

    @property
    def _sensory(self) -> MemoryBuffer:
        buf = self._sensory_buf
        if buf is None:
            self._refuse_if_ended()
            buf = self._sensory_buf = MemoryBuffer(self._task.sensory, "sensory")
        return buf

    @property
    def short_term_memory(self) -> MemoryObject:
        """Per-key memory, kept across runs (see the class docstring)."""
        view = self._stm_view
        if view is None:
            view = self._stm_view = MemoryObject(self._stm)
        return view

    @property
    def sensory_memory(self) -> MemoryObject:
        """Per-run memory, cleared when the run completes."""
        view = self._sensory_view
        if view is None:
            view = self._sensory_view = MemoryObject(self._sensory)
        return view

    @property
    def key(self) -> Any:
        return self._task.run.key

    @property
    def long_term_memory(self) -> LongTermMemory:
        """The key's long-term memory: texts searched by meaning (docs/runtime.md, "Long-term
        memory"); `.shared(name)` for one all keys share. Async methods: add, search, get,
        delete, count."""
        if self._ltm is None:
            self._ltm = LongTermMemory(self, ltm_key_scope(self._task.run.key))
        ltm: LongTermMemory = self._ltm
        return ltm

    @property
    def metrics(self) -> KeyMetrics:
        """Process-local counters (`ctx.metrics.inc("orders.refunded")`), in total and per key."""
        return KeyMetrics(self._metrics, self._task.run.key)

    @property
    def seq(self) -> int:
        """The input's sequence number in its source: with `key`, a stable id for the run."""
        return self._task.run.seq

    @property
    def memory_version(self) -> int:
        """The layout version of the memory this task sees: the agent's `memory_version`,
        except in a run that was in flight across an upgrade (it finishes on the memory it
        started with; the key is migrated when its next run starts)."""
        return self._task.run.memory_version

    @property
    def task_id(self) -> str:
        """This task's id: the same when it is replayed after a crash."""
        return self._task.task_id

    def patched(self, change_id: str) -> bool:
        """Branch changed code safely for runs in flight (docs/runtime.md, "Upgrading an agent").

        `if ctx.patched("refund-v2"): new code; else: old code`. True for every execution
        except one that repeats an earlier attempt of this task which got past this point
        without the patch (its recorded durable calls are the old branch's): that one gets
        False, and keeps getting False after any further crash, so it finishes on the path its
        records came from. Call it where the action is not running calls concurrently.
        """
        if not isinstance(change_id, str) or not change_id:
            raise InvalidTypeError(f"ctx.patched() takes a non-empty str id, got {change_id!r}")
        return self._calls.patched(change_id)

    def send_event(
        self,
        event: Event,
        *,
        delay: float | datetime.timedelta | None = None,
        at: datetime.datetime | None = None,
    ) -> None:
        """Emit an event; it is delivered (or output) when this task commits.

        `delay` (seconds or a timedelta) or `at` (an aware datetime) deliver it to this run
        later instead: a durable timer, kept across restarts (due at once if it fell due while
        the job was down). The run stays in flight, holding no slot, until it is delivered.
        """
        if not isinstance(event, Event):
            raise InvalidTypeError(
                f"send_event() takes a ratchet Event, got {type(event).__name__}; wrap the value, "
                f"e.g. OutputEvent(output=...)"
            )
        frozen = freeze(event)
        if delay is None and at is None:
            self.events.append(frozen)
            return
        if delay is not None and at is not None:
            raise InvalidArgumentError("send_event() takes delay= or at=, not both")
        if at is not None:
            if not isinstance(at, datetime.datetime) or at.tzinfo is None:
                raise InvalidArgumentError(
                    f"send_event(at=) takes an aware datetime (with tzinfo, e.g. "
                    f"datetime.now(timezone.utc) + timedelta(hours=1)), got {at!r}"
                )
            due = at.timestamp()
        else:
            due = self._waits("send_event(delay=)").now() + _seconds("delay", delay)
        self.events.append(Emitted(DelayedEvent, {"due": float(due), "event": frozen.wire()}))

    # -- durable waits ------------------------------------------------------------------------

    def _waits(self, what: str) -> Waits:
        waits = self._waits_of
        if waits is None:
            raise ConfigError(
                f"{what} needs an engine with durable timers and signals: the embedded engine "
                f"(`ratchet run`) has them; the Flink engine does not yet (docs/flink.md)"
            )
        return waits

    async def sleep(self, seconds: float | datetime.timedelta) -> None:
        """A durable timer: after a crash the task resumes at this point when it is due (at
        once if it fell due while the job was down). The run holds no slot meanwhile."""
        waits = self._waits("ctx.sleep")
        secs = _seconds("ctx.sleep", seconds)
        digest = repr(secs)
        idx, rec = self._calls.claim(SLEEP_FN, digest)
        if rec is not None and rec.status == "ok":
            until = float(codec.decode(rec.payload or b"")["until"])
        else:
            now = waits.now()
            until = now + secs
            payload = codec.encode({"since": now, "until": until})
            await asyncio.wrap_future(self._calls.write(idx, SLEEP_FN, digest, "ok", payload))
        await waits.until(self._task, until)

    async def wait_for_signal(
        self,
        name: str,
        timeout: float | datetime.timedelta | None = None,  # noqa: ASYNC109 - durable: recorded
    ) -> Any:
        """The value sent for `name` to this key (`ratchet signal`, REST, `send_signal`).

        Signals of a key and name are delivered in the order sent, each exactly once; one sent
        before anybody waits is kept until a run of the key waits for it. With `timeout`,
        raises `ratchet.SignalTimeout` when it passes; the deadline is recorded, so after a
        crash the wait resumes with the time it had left."""
        if not isinstance(name, str) or not name:
            raise InvalidTypeError(f"wait_for_signal() takes a non-empty str name, got {name!r}")
        waits = self._waits("ctx.wait_for_signal")
        secs = None if timeout is None else _seconds("wait_for_signal(timeout=)", timeout)
        idx, rec = self._calls.claim(SIGNAL_FN, name)
        if rec is not None and rec.status == "ok":
            return codec.decode(rec.payload or b"")
        if rec is not None and rec.status == "error":
            raise _timed_out(self.key, name, codec.decode(rec.payload or b""))
        if rec is not None:  # an intent: the wait began before a crash
            until = codec.decode(rec.payload or b"").get("until")
        else:
            now = waits.now()
            until = None if secs is None else now + secs
            payload = codec.encode({"since": now, "until": until})
            await asyncio.wrap_future(self._calls.write(idx, SIGNAL_FN, name, "intent", payload))
            # The action may have ended meanwhile (this is the other branch of a gather that
            # failed): a sealed ctx takes no signal, which its journal could not record.
            self._refuse_if_ended()
        value = await waits.signal(self._task, self._calls, idx, name, until)
        if value is None:
            raise _timed_out(self.key, name, {"until": until})
        return codec.decode(value)

    # -- durable calls ----------------------------------------------------------------------

    def _claim(self, name: str, digest: str) -> tuple[int, bool, Any]:
        """(index, answered from the journal?, value or the intent record to reconcile)."""
        idx, rec = self._calls.claim(name, digest)
        replayed = rec is not None and rec.status in ("ok", "error")
        _last_replayed.set(replayed)
        if replayed:
            self._metrics.add(self.key, "durable_calls.replayed")
        else:
            self._metrics.add(self.key, "durable_calls.made")
        if rec is None:
            return idx, False, None
        if rec.status == "ok":
            return idx, True, codec.decode(rec.payload or b"")
        if rec.status == "error":
            raise rebuild_error(rec.payload or b"")
        return idx, False, rec  # an intent with no result: the call may or may not have happened

    def _result_payload(self, name: str, value: Any) -> bytes:
        try:
            return codec.encode(value)
        except TypeError as exc:
            raise CodecError(
                f"durable call {name} returned a value ratchet cannot record ({exc}); return plain "
                f"data (dict, list, str, bytes, a registered model) from the function"
            ) from None

    def _retry_state(self, value: Any, retry: Retry | Resource | None) -> tuple[int, float | None]:
        """(attempt to make, time it may start) for a claimed call: an intent record that a
        failed attempt rewrote holds {attempt, until}; a plain intent or none starts at 1."""
        if retry is not None and value is not None and value.payload:
            state = codec.decode(value.payload)
            if isinstance(state, dict) and "attempt" in state:
                return int(state["attempt"]) + 1, float(state["until"])
        return 1, None

    def _failed_attempt(
        self, retry: Retry | None, exc: Exception, attempt: int, name: str
    ) -> tuple[float, bytes] | None:
        """When `retry` tries again after `exc`: (until, the intent payload recording it)."""
        if retry is None or not retry.retries(exc, attempt):
            return None
        waits = self._waits(f"durable call {name} with retry=")
        now = waits.now()
        until = now + retry.delay(attempt)
        self._metrics.add(self.key, "durable_calls.retried")
        log.warning(
            "durable call %s failed (attempt %d of %d), trying again in %.3gs: %s: %s",
            name, attempt, retry.max_attempts, until - now, type(exc).__name__, exc,
        )  # fmt: skip
        state = {"attempt": attempt, "until": until, "error": f"{type(exc).__name__}: {exc}"}
        return until, codec.encode(state)

    def _now(self) -> float:
        waits = self._waits_of
        return waits.now() if waits is not None else SYSTEM_CLOCK.now()

    def trace_note(self, kind: str, **fields: Any) -> None:
        """Add a note to this task's entry in the run's trace (`ratchet trace`): the chat
        layer notes each model call; an action may note what it decided and why."""
        note = {"kind": _traceable(kind), **{k: _traceable(v) for k, v in fields.items()}}
        if self._notes is None:
            self._notes = []
        self._notes.append(note)

    def _traced_call(self, fn: Callable[..., Any]) -> dict[str, Any]:
        entry: dict[str, Any] = {"fn": _fn_name(fn), "at": self._now()}
        if self._trace_calls is None:
            self._trace_calls = []
        self._trace_calls.append(entry)
        return entry

    def _close_call(self, entry: dict[str, Any], error: BaseException | None) -> None:
        entry["duration"] = self._now() - entry["at"]
        entry["replayed"] = _last_replayed.get()
        if error is not None:
            entry["error"] = f"{type(error).__name__}: {error}"

    def durable_execute(
        self,
        fn: Callable[..., T],
        *args: Any,
        reconciler: Callable[..., T] | None = None,
        retry: Retry | None = None,
        **kwargs: Any,
    ) -> T:
        """Call `fn(*args, **kwargs)` at most once per completed call, across crashes.

        If the process died after the intent was recorded but before the result was, the call
        may have happened: `reconciler(*args, **kwargs)` (if given) is asked for the result
        instead of calling again; without one, `fn` is called again (at-least-once).
        `retry`: a `ratchet.Retry` policy for the call; between attempts the task waits
        durably (a sync action's worker thread blocks meanwhile).
        """
        entry = self._traced_call(fn)
        try:
            result = self._execute(fn, args, kwargs, reconciler, retry)
        except BaseException as exc:
            self._close_call(entry, exc)
            raise
        self._close_call(entry, None)
        return result

    def _execute(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reconciler: Callable[..., T] | None,
        retry: Retry | None,
    ) -> T:
        name = _fn_name(fn)
        digest = _args_digest(args, kwargs)
        idx, done, value = self._claim(name, digest)
        if done:
            return value  # type: ignore[no-any-return]
        attempt, until = self._retry_state(value, retry)
        target = fn
        if until is None and value is not None and reconciler is not None:
            target = reconciler
        elif until is None:
            self._calls.write(idx, name, digest, "intent", None).result()
        while True:
            if until is not None:
                left = until - self._waits("retry").now()
                if left > 0:
                    self._waits("retry").sleep_sync(left)
            try:
                result = target(*args, **kwargs)
                if inspect.isawaitable(result):
                    raise InvalidTypeError(
                        f"{name} is async; use `await ctx.durable_execute_async(...)`"
                    )
            except Exception as exc:
                again = self._failed_attempt(retry, exc, attempt, name)
                if again is not None:
                    until, state = again
                    self._calls.write(idx, name, digest, "intent", state).result()
                    attempt, target = attempt + 1, fn
                    continue
                self._calls.write(idx, name, digest, "error", encode_error(exc)).result()
                raise
            break
        self._calls.write(idx, name, digest, "ok", self._result_payload(name, result)).result()
        return result

    @overload
    async def durable_execute_async(
        self,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        reconciler: Callable[..., Any] | None = None,
        retry: Retry | None = None,
        resource: Resource | None = None,
        **kwargs: Any,
    ) -> T: ...

    @overload
    async def durable_execute_async(
        self,
        fn: Callable[..., T],
        *args: Any,
        reconciler: Callable[..., Any] | None = None,
        retry: Retry | None = None,
        resource: Resource | None = None,
        **kwargs: Any,
    ) -> T: ...

    async def durable_execute_async(
        self,
        fn: Callable[..., Awaitable[T]] | Callable[..., T],
        *args: Any,
        reconciler: Callable[..., Any] | None = None,
        retry: Retry | None = None,
        resource: Resource | None = None,
        **kwargs: Any,
    ) -> T:
        """The async form of `durable_execute`; a sync `fn` runs in a thread, off the loop.
        Between retries the task is parked (it holds no run slot). `resource`: a
        `ratchet.Resource` whose transient failures past the retries pause the stream (the
        call waits for the resource to come back) instead of failing the action."""
        if resource is not None and not isinstance(resource, Resource):
            raise InvalidTypeError(f"resource= takes a ratchet.Resource, got {resource!r}")
        if resource is not None and self._waits_of is None:
            # An engine with no durable waits (the Flink engine) cannot pause on an outage:
            # the call is a plain durable call there, and a failure the action's error.
            resource = None
        entry = self._traced_call(fn)
        try:
            result = await self._execute_async(fn, args, kwargs, reconciler, retry, resource)
        except BaseException as exc:
            self._close_call(entry, exc)
            raise
        self._close_call(entry, None)
        return result  # type: ignore[no-any-return]

    async def _execute_async(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reconciler: Callable[..., Any] | None,
        retry: Retry | None,
        resource: Resource | None,
    ) -> Any:
        name = _fn_name(fn)
        digest = _args_digest(args, kwargs)
        idx, done, value = self._claim(name, digest)
        if done:
            return value
        attempt, until = self._retry_state(value, retry or resource)
        target: Callable[..., Any] = fn
        if until is None and value is not None and reconciler is not None:
            target = reconciler
        elif until is None:
            await asyncio.wrap_future(self._calls.write(idx, name, digest, "intent", None))
        paused = resource is not None and until is not None and _paused(value)
        while True:
            if until is not None and paused:
                assert resource is not None
                await self._waits("resource=").until_available(self._task, resource.name, until)
            elif until is not None:
                await self._waits("retry").until(self._task, until)
            try:
                if inspect.iscoroutinefunction(target):
                    result = await target(*args, **kwargs)
                else:
                    result = await asyncio.to_thread(target, *args, **kwargs)
                    if inspect.isawaitable(result):
                        result = await result
            except Exception as exc:
                fixable = resource is None or resource.transient(exc)
                again = self._failed_attempt(retry, exc, attempt, name) if fixable else None
                if again is not None:
                    until, state = again
                    await asyncio.wrap_future(self._calls.write(idx, name, digest, "intent", state))
                    attempt, target, paused = attempt + 1, fn, False
                    continue
                if resource is not None and resource.transient(exc):
                    # Past its retries: the resource is down. Wait for it, not fail the run.
                    error = f"{type(exc).__name__}: {exc}"
                    waits = self._waits("resource=")
                    until = waits.unavailable(
                        resource.name, resource.probe_delay, resource.max_probe_delay, error
                    )
                    state_map = {"attempt": attempt, "until": until, "error": error}
                    state_map["resource"] = resource.name
                    await asyncio.wrap_future(
                        self._calls.write(idx, name, digest, "intent", codec.encode(state_map))
                    )
                    self._metrics.add(self.key, "durable_calls.paused")
                    attempt, target, paused = attempt + 1, fn, True
                    continue
                if resource is not None:  # it answered: it is up, whatever it said
                    self._waits("resource=").available(resource.name)
                await asyncio.wrap_future(
                    self._calls.write(idx, name, digest, "error", encode_error(exc))
                )
                raise
            break
        if resource is not None:
            self._waits("resource=").available(resource.name)
        payload = self._result_payload(name, result)
        await asyncio.wrap_future(self._calls.write(idx, name, digest, "ok", payload))
        return result

    def _result(self) -> TaskResult:
        made = self._calls_made
        left = made.unclaimed() if made is not None and made.replayed else None
        if left and made is not None:
            made.discard_new()  # a refusal leaves the records as they were before it
            calls = ", ".join(f"#{r.idx} {r.fn} (argument digest {r.digest[:12]})" for r in left)
            raise IncompatibleChangeError(
                f"replay of key {self.key!r} input {self.seq}, task {self.task_id}: recorded "
                f"durable call(s) {calls} were not made again; the action's calls changed since "
                f"they were recorded (a call is matched by its function and arguments). "
                f"{UPGRADE_FIXES}"
            )
        trace: dict[str, Any] | None = None
        if self._trace_calls or self._notes:
            trace = {}
            if self._trace_calls:
                trace["calls"] = self._trace_calls
            if self._notes:
                trace["notes"] = self._notes
        stm, sensory = self._stm_buf, self._sensory_buf
        result = TaskResult(
            [] if stm is None else stm.ops,
            [] if sensory is None else sensory.ops,
            list(self.events),
            trace,
        )
        self._seal()
        return result

    _ended: _Ended | None = None

    def _seal(self) -> None:
        """The action returned (or failed): what this ctx is asked to do from now on is
        refused, not silently dropped. Signals an earlier attempt took, which this one did not
        wait for again, go back (`TaskCalls.release_unused`)."""
        made = self._calls_made
        if isinstance(made, TaskCalls) and made.replayed:
            made.release_unused()
        ended = self._ended = _Ended(self._task)
        self.events = ended  # type: ignore[assignment]
        for buf in (self._stm_buf, self._sensory_buf):
            if buf is not None:
                buf.ops = ended  # type: ignore[assignment]
        self._calls_made = ended  # type: ignore[assignment]

    def _refuse_if_ended(self) -> None:
        if self._ended is not None:
            self._ended._refuse()


def _clock_of(calls: TaskCalls) -> Callable[[], float]:
    """Where a task reads the time: the engine's clock, or the system's without one."""
    return calls.waits.now if calls.waits is not None else SYSTEM_CLOCK.now


def _call_sync(fn: Callable[[Event, RunnerContext], Any], task: Task, ctx: RunnerContext) -> None:
    """Run a sync action; one that returned something was written wrong (refused)."""
    out = fn(task.event.thaw(), ctx)
    if out is not None:
        _refuse_result(out, task)


def _refuse_result(out: Any, task: Task) -> None:
    """An action's return value would be dropped (an event returned, never sent; a coroutine
    never run): fail the action instead, as an exception in it would."""
    if inspect.isawaitable(out):
        close = getattr(out, "close", None)
        if close is not None:
            close()
        raise InvalidTypeError(
            f"sync action {task.action} returned an awaitable; declare it `async def`"
        )
    raise InvalidTypeError(
        f"action {task.action} returned a value ({type(out).__qualname__}), and an action's "
        f"return value is not used; send it with ctx.send_event(...) and return None"
    )


def _timed(
    result: TaskResult, now: Callable[[], float], started: float, attempts: int
) -> TaskResult:
    """Note when the task started, how long it took and in how many attempts (the trace)."""
    result.started = started
    result.duration = now() - started
    if attempts > 1:
        if result.trace is None:
            result.trace = {}
        result.trace["attempts"] = attempts
    return result


def _traceable(value: Any) -> Any:
    if value is None or type(value) in (bool, int, float, str):
        return value
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _paused(record: Any) -> bool:
    """Whether a claimed intent record says its call waits for a resource to come back."""
    if record is None or not record.payload:
        return False
    state = codec.decode(record.payload)
    return isinstance(state, dict) and "resource" in state


def _seconds(what: str, value: Any) -> float:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(
            f"{what} takes seconds >= 0 (an int, a float or a timedelta), got {value!r}"
        )
    return float(value)


def _timed_out(key: Any, name: str, record: Any) -> SignalTimeout:
    until = record.get("until") if isinstance(record, dict) else None
    when = (
        f" at {datetime.datetime.fromtimestamp(until, datetime.UTC).isoformat()}" if until else ""
    )
    return SignalTimeout(f"no signal {name!r} for key {key!r} before the timeout{when}")


_MAKING_CALLS = threading.Lock()

# Per thread / asyncio task, so concurrent calls of one action do not overwrite each other.
_last_replayed: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ratchet_replayed", default=False
)


def last_call_replayed() -> bool:
    """Whether the durable call this thread or task made last was answered from the journal."""
    return _last_replayed.get()


def current_context() -> RunnerContext | None:
    """The context of the action running in this thread or task, if any."""
    return _current.get()


class AgentBinding:
    """Adapts an `Agent` to the engine: dispatch table, action execution, event wire format."""

    def __init__(self, agent: Agent, config: dict[str, Any] | None = None) -> None:
        self.spec = AgentSpec(agent)
        self.name = self.spec.agent_name
        self.fingerprint = self.spec.fingerprint()
        self.action_names = self.spec.describe()
        self.memory_version = self.spec.memory_version
        self.version = AgentVersion(
            self.name, self.fingerprint, self.spec.table(), self.memory_version
        )
        self.config = dict(config or {})
        self.metrics = Metrics()
        ltm = getattr(agent, "long_term_memory", None)
        if ltm is not None and not isinstance(ltm, LongTermMemoryConfig):
            raise ConfigError(
                f"{self.name}.long_term_memory must be a ratchet.LongTermMemoryConfig("
                f"embedding=...), not {ltm!r}"
            )
        self.ltm_config: LongTermMemoryConfig | None = ltm
        self._by_name = {a.name: a for a in self.spec.actions}
        self._listeners: dict[type, tuple[list[str], bool]] = {}  # names, is an error event
        self._kinds: dict[type, int] = {}
        self._modes = {
            a.name: ("async" if a.is_async else "inline" if a.inline else "thread")
            for a in self.spec.actions
        }

    def listeners(self, event: Emitted) -> list[str]:
        et = event.cls
        found = self._listeners.get(et)
        if found is None:
            names = [a.name for a in self.spec.listeners(et)]
            found = self._listeners[et] = (names, bool(self._kind(et) & _ERROR))
        names, error = found
        return _not_to_itself(event, names) if error else names

    def _kind(self, cls: type[Event]) -> int:
        """Whether events of `cls` are outputs, errors, both or neither (bits; pydantic's
        metaclass makes subclass checks slow, and every committed event asks)."""
        kind = self._kinds.get(cls)
        if kind is None:
            kind = self._kinds[cls] = (_OUTPUT if issubclass(cls, OutputEvent) else 0) | (
                _ERROR if issubclass(cls, ErrorEvent) else 0
            )
        return kind

    def known_actions(self) -> list[str]:
        return [a.name for a in self.spec.actions]

    def delayed(self, event: Emitted) -> tuple[float, Emitted] | None:
        """(due time, event) of an event sent with a delay; None for any other."""
        if event.cls is not DelayedEvent:
            return None
        name, fields = event.fields["event"]
        return float(event.fields["due"]), emitted_from_wire(name, fields)

    def pinned(
        self, table: DispatchTable
    ) -> tuple[Callable[[Emitted], list[str]], Callable[[Emitted], bool]]:
        """Dispatch by an earlier version's table, for a run that started under it.

        An event reaches the table's actions that hear its type or a base type (matched by
        event name: the classes are this version's); one that none of them hears (a type new
        code sends) reaches this version's actions. Actions the agent no longer has are listed
        too; the machine keeps them only where the run's journal holds them.
        """
        cache: dict[type, list[str]] = {}

        def listeners(event: Emitted) -> list[str]:
            et = event.cls
            names = cache.get(et)
            if names is None:
                heard = {getattr(k, "event_name", None) for k in et.__mro__}
                names = [n for n, evs in table if heard.intersection(evs)]
                if not names:
                    # An event no action of that version heard (new code's new event type):
                    # this version's actions get it rather than nobody.
                    names = [a.name for a in self.spec.listeners(et)]
                cache[et] = names
            return _not_to_itself(event, names)

        def is_output(event: Emitted) -> bool:
            if issubclass(event.cls, OutputEvent):
                return True
            return issubclass(event.cls, ErrorEvent) and not listeners(event)

        return listeners, is_output

    def migrate(self, key: Any, memory: dict[str, Any], version: int) -> dict[str, Any]:
        """`memory` of `key`, brought from `version` to `memory_version` by the migrations."""
        migrations = self.spec.migrations
        data = memory
        while version < self.memory_version:
            fn = migrations.get(version)
            if fn is None:
                raise MigrationError(
                    f"key {key!r} has memory at version {version}, and {self.name} (memory_version "
                    f"{self.memory_version}) has no @ratchet.migration({version}); add one that "
                    f"brings version {version} to {version + 1}. Nothing of the key was changed"
                )
            buffer = MemoryBuffer(data, "short_term")
            try:
                fn(MemoryObject(buffer))
            except RatchetError as exc:
                raise MigrationError(
                    f"the migration of key {key!r} from memory version {version} "
                    f"({_fn_name(fn)}) failed: {exc}. Nothing of the key was changed"
                ) from exc
            except Exception as exc:  # noqa: BLE001 - the user's migration failed
                raise MigrationError(
                    f"the migration of key {key!r} from memory version {version} "
                    f"({_fn_name(fn)}) raised {type(exc).__name__}: {exc}. Nothing of the key "
                    f"was changed; fix the migration and run again"
                ) from exc
            data = buffer.data  # the base, untouched, or a copy with the writes applied
            version += 1
        return data

    def budget_output(self, key: Any, seq: int, dropped: int) -> Emitted:
        """What a run that used up its task budget reports, as an error output."""
        return Emitted(
            ErrorEvent,
            {
                "action": "ratchet",
                "error_type": "ratchet.TaskBudgetExceeded",
                "message": (
                    f"the run of key {key!r} input {seq} dispatched its budget of tasks and "
                    f"{dropped} more were not run (an event loop between actions?); raise "
                    f"max_tasks_per_run (--max-tasks-per-run) if the run needs more"
                ),
                "event_type": "ratchet.InputEvent",
            },
        )

    def is_output(self, event: Emitted) -> bool:
        kind = self._kinds.get(event.cls)
        if kind is None:
            kind = self._kind(event.cls)
        if kind & _OUTPUT:
            return True
        # A failure nobody handles is reported as an output rather than vanishing.
        return bool(kind & _ERROR) and not self.listeners(event)

    def action_mode(self, action: str) -> str:
        return self._modes[action]

    def event_to_wire(self, event: Emitted) -> Any:
        return event.wire()

    def event_from_wire(self, wire: Any) -> Emitted:
        name, fields = wire
        return emitted_from_wire(name, fields)

    def event_from_input(self, value: Any) -> Emitted:
        # Listeners get copies decoded from its stored form (taken before any of them runs).
        return Emitted(InputEvent, {"input": value})

    def describe_event(self, event: Emitted) -> str:
        """An event as a run's trace names it."""
        if event.cls is DelayedEvent:
            name, _fields = event.fields["event"]
            return f"{name} (delayed)"
        return event.cls.event_name

    def is_error(self, event: Emitted) -> bool:
        return bool(self._kind(event.cls) & _ERROR)

    def error_record(self, event: Emitted) -> dict[str, Any]:
        """An error event as the output's `error` object (and a dead letter's detail)."""
        return {
            "action": event.field("action"),
            "type": event.field("error_type"),
            "message": event.field("message"),
            "event_type": event.field("event_type"),
        }

    def output_record(self, output: Output) -> dict[str, Any]:
        ev: Emitted = output.event
        rec: dict[str, Any] = {
            "id": output.id,
            "key": output.key,
            "seq": output.seq,
            "task": output.task_id,
        }
        if self._kind(ev.cls) & _ERROR:
            rec["output"] = None
            rec["error"] = self.error_record(ev)
        else:
            rec["output"] = ev.field("output")
        return rec

    def _error_result(self, task: Task, exc: BaseException, attempts: int = 1) -> TaskResult:
        log.warning(
            "action %s failed on key %r: %s: %s", task.action, task.run.key, type(exc).__name__, exc
        )
        message = str(exc)
        if attempts > 1:
            message = f"{message} (after {attempts} attempts)"
        fields = {
            "action": task.action,
            "error_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": message,
            "event_type": task.event.cls.event_name,
        }
        # A failed action commits nothing but its error event.
        return TaskResult([], [], [Emitted(ErrorEvent, fields)])

    def run_sync(self, task: Task, calls: TaskCalls) -> TaskResult:
        spec = self._by_name[task.action]
        now = _clock_of(calls)
        if not calls.replayed and spec.retry is None:
            return self._run_once(spec.fn, task, calls, now)
        attempt, until = self._resume_attempt(calls) if calls.replayed else (1, None)
        started = now()
        while True:
            if until is not None:
                # A blocking backoff: a sync action's retry holds its worker thread meanwhile.
                self._backoff_sync(calls, until)
            made = calls.for_attempt(attempt)  # (attempt 1: `calls`)
            ctx = RunnerContext(task, made, self.config, self.metrics)
            token = _current.set(ctx)
            try:
                _call_sync(spec.fn, task, ctx)
            except ENGINE_FAULTS:
                raise
            except Exception as exc:  # noqa: BLE001 - a user's failure becomes data
                ctx._seal()
                until = self._record_failure(task, calls, made, spec.retry, exc, attempt)
                if until is not None:
                    attempt += 1
                    continue
                return _timed(self._error_result(task, exc, attempt), now, started, attempt)
            finally:
                _current.reset(token)
            return _timed(ctx._result(), now, started, attempt)

    def _run_once(
        self,
        fn: Callable[[Event, RunnerContext], Any],
        task: Task,
        calls: TaskCalls,
        now: Callable[[], float],
    ) -> TaskResult:
        """`run_sync` for the common case: a first execution (no records) without retries."""
        started = now()
        ctx = RunnerContext(task, calls, self.config, self.metrics)
        token = _current.set(ctx)
        try:
            _call_sync(fn, task, ctx)
        except ENGINE_FAULTS:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's failure becomes data
            ctx._seal()
            result = self._error_result(task, exc)
        else:
            result = ctx._result()
        finally:
            _current.reset(token)
        result.started = started
        result.duration = now() - started
        return result

    def inline_runner(
        self,
        action: str,
        waits: Waits | None,
        make_calls: Callable[[Task], TaskCalls],
    ) -> Callable[[Task], TaskResult] | None:
        """The fused path's runner of an inline action without a retry policy, or None.

        It does what `run_sync` does for a first execution (`_run_once`), for a task that
        has no durable-call records from before a restart: the engine calls it at dispatch
        and commits its result at once. Its journal (`make_calls(task)`) is made only if the
        action makes a durable call or a wait; its clock is `waits`'s (the system's without).
        """
        spec = self._by_name[action]
        if self._modes[action] != "inline" or spec.retry is not None:
            return None
        fn = spec.fn
        config, metrics, error_result = self.config, self.metrics, self._error_result
        now = waits.now if waits is not None else SYSTEM_CLOCK.now
        set_current, reset_current = _current.set, _current.reset

        def run(task: Task) -> TaskResult:
            started = now()
            ctx = RunnerContext(task, None, config, metrics, waits, make_calls)
            token = set_current(ctx)
            try:
                out = fn(task.event.thaw(), ctx)
                if out is not None:
                    _refuse_result(out, task)
            except ENGINE_FAULTS:
                raise
            except Exception as exc:  # noqa: BLE001 - a user's failure becomes data
                ctx._seal()
                result = error_result(task, exc)
            else:
                result = ctx._result()
            finally:
                reset_current(token)
            result.started = started
            result.duration = now() - started
            return result

        return run

    async def run_async(self, task: Task, calls: TaskCalls) -> TaskResult:
        spec = self._by_name[task.action]
        attempt, until = self._resume_attempt(calls)
        now = _clock_of(calls)
        started = now()
        while True:
            if until is not None:
                assert calls.waits is not None
                await calls.waits.until(task, until)
            made = calls.for_attempt(attempt)
            ctx = RunnerContext(task, made, self.config, self.metrics)
            children: set[asyncio.Task[Any]] = set()
            token = _current.set(ctx)
            _children.set(children)
            try:
                out = await spec.fn(task.event.thaw(), ctx)
                if out is not None:
                    _refuse_result(out, task)
            except ENGINE_FAULTS:
                raise
            except Exception as exc:  # noqa: BLE001 - a user's failure becomes data
                if spec.retry is not None and spec.retry.retries(exc, attempt):
                    # Before the attempt's signals go back: a wait of its own still running
                    # (gather's other branch) would take them straight back, for good.
                    await _settle_leftovers(task, children)
                ctx._seal()
                until = await asyncio.to_thread(
                    self._record_failure, task, calls, made, spec.retry, exc, attempt
                )
                if until is not None:
                    attempt += 1
                    continue
                return _timed(self._error_result(task, exc, attempt), now, started, attempt)
            finally:
                _current.reset(token)
                _cancel_leftovers(task, children)
            return _timed(ctx._result(), now, started, attempt)

    # -- retries ----------------------------------------------------------------------------

    @staticmethod
    def _resume_attempt(calls: TaskCalls) -> tuple[int, float | None]:
        """The attempt a task (re)starts at, one after the failed attempts it recorded, and
        the time it may start (None: now)."""
        markers = calls.retry_markers()
        if not markers:
            return 1, None
        last = markers[-1]
        return int(last.digest) + 1, float(codec.decode(last.payload or b"")["until"])

    def _record_failure(
        self,
        task: Task,
        calls: TaskCalls,
        made: TaskCalls,
        retry: Retry | None,
        exc: Exception,
        attempt: int,
    ) -> float | None:
        """Record a failed attempt that will be tried again, durably, with the time the next
        attempt may start (returned); None when the policy says the task fails now (the run's
        dead letter then keeps the signals it took). `made`: the attempt's own journal
        (`calls.for_attempt(attempt)`), whose signals go back first (`release_attempt`)."""
        if retry is None or not retry.retries(exc, attempt):
            return None
        waits = calls.waits
        now = waits.now() if waits is not None else None
        if now is None:
            raise ConfigError(
                f"action {task.action} has retry=, which needs an engine with durable timers: "
                f"the embedded engine has them; the Flink engine does not yet (docs/flink.md)"
            )
        until = now + retry.delay(attempt)
        payload = codec.encode(
            {
                "error": f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}",
                "at": now,
                "until": until,
            }
        )
        # The signals this attempt took go back before the retry is recorded: a kill between
        # the two re-executes this attempt, whose wait takes them again (the other order
        # would lose them in that window: nothing reads a retried attempt's records).
        made.release_attempt()
        idx, _ = calls.claim(RETRY_FN, str(attempt))
        calls.write(idx, RETRY_FN, str(attempt), "ok", payload).result()
        self.metrics.add(task.run.key, "actions.retried")
        log.warning(
            "action %s failed on key %r (attempt %d of %d), trying again in %.3gs: %s: %s",
            task.action, task.run.key, attempt, retry.max_attempts, until - now,
            type(exc).__name__, exc,
        )  # fmt: skip
        return until

    @staticmethod
    def _backoff_sync(calls: TaskCalls, until: float) -> None:
        assert calls.waits is not None
        left = until - calls.waits.now()
        if left > 0:
            calls.waits.sleep_sync(left)


# What `AgentBinding._kind` says an event class is (bits).
_OUTPUT, _ERROR = 1, 2


def _not_to_itself(event: Emitted, names: list[str]) -> list[str]:
    if names and issubclass(event.cls, ErrorEvent):
        # An action's own failure is not delivered back to it: a handler that raises on
        # every error would otherwise receive its own error forever.
        failed = event.fields.get("action")
        if failed in names:
            return [n for n in names if n != failed]
    return names


# Tasks an action creates inherit this contextvar; the task factory records them so the
# ones still running when the action returns can be cancelled.
_children: contextvars.ContextVar[set[asyncio.Task[Any]] | None] = contextvars.ContextVar(
    "ratchet_children", default=None
)


async def _settle_leftovers(task: Task, children: set[asyncio.Task[Any]]) -> None:
    """Cancel a failed attempt's tasks that still run, and let them end (at most
    _SETTLE_SECONDS): none of them may wait for a signal, or make a call, once the attempt's
    records are given back for its retry."""
    pending = [c for c in children if not c.done()]
    if not pending:
        return
    for c in pending:
        c.cancel()
    await asyncio.wait(pending, timeout=_SETTLE_SECONDS)
    log.warning(
        "action %s (key %r) failed with %d asyncio task(s) of its own still running (asyncio."
        "gather does not cancel the others when one fails); they were cancelled before its "
        "retry",
        task.action,
        task.run.key,
        len(pending),
    )


_SETTLE_SECONDS = 5.0


def _cancel_leftovers(task: Task, children: set[asyncio.Task[Any]]) -> None:
    pending = [c for c in children if not c.done()]
    for c in pending:
        c.cancel()
    if pending:
        log.warning(
            "action %s (key %r) returned with %d asyncio task(s) it did not await; they were "
            "cancelled. Await every task an action starts (asyncio.gather / TaskGroup)",
            task.action,
            task.run.key,
            len(pending),
        )


def install_task_factory(loop: asyncio.AbstractEventLoop) -> None:
    """Track tasks created inside actions (so leftovers can be cancelled)."""
    previous = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
        if previous is not None:
            t = previous(loop, coro, **kwargs)
        else:
            t = asyncio.Task(coro, loop=loop, **kwargs)
        # The task's own context says whose child it is (a task created with another
        # `context=`, as ratchet's own timers are, belongs to no action).
        ctx = kwargs.get("context")
        owner = _children.get() if ctx is None else ctx.get(_children)
        if owner is not None:
            owner.add(t)  # type: ignore[arg-type]
        return t

    loop.set_task_factory(factory)
