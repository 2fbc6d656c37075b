"""Running an agent on the embedded engine: `ratchet.run()` and how the CLI finds an agent."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import random
import signal
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import ConfigError, InvalidArgumentError, InvalidTypeError, StateError
from ratchet.agents._agent import Agent
from ratchet.agents._context import AgentBinding, install_task_factory
from ratchet.connectors import is_uri, sink_for, source_for
from ratchet.runtime._dispatch import AGENT_FILE_MODULE_PREFIX
from ratchet.runtime._engine import Engine, EngineConfig, EngineResult
from ratchet.runtime._io import (
    JOB_FILE,
    CallbackSink,
    IterableSource,
    JobIdentity,
    JsonlFilesSource,
    JsonlSink,
    JsonlSource,
    Sink,
    Source,
    job_identity,
    refuse_output_read_as_input,
)
from ratchet.store._sqlite import DB_NAME, SqliteStore, StateLock, state_dir_error

log = logging.getLogger("ratchet.agents")


def _auto(
    agent: Any,
    inputs: Any,
    state_dir: str | os.PathLike[str],
    follow: bool,
    agent_config: Any,
    clock: Clock,
    rng: Any,
) -> tuple[int, str]:
    """`workers="auto"` for `run`: what `auto_workers` says, but one process when the call
    asks for what only one process takes (agent_config, clock, rng, an agent object another
    process cannot import), or hands over a short in-memory list of inputs."""
    from collections.abc import Sized

    from ratchet.agents._sharded import agent_spec
    from ratchet.runtime._auto_workers import (
        SMALL_INPUT_COUNT,
        existing_workers,
        new_job_workers,
    )

    kept = existing_workers(state_dir)
    if kept is not None:
        return kept  # never moves keys on its own (a sharded state then needs what it needs)
    if agent_config is not None or clock is not SYSTEM_CLOCK or rng is not None:
        return 1, "agent_config, clock or rng given: one process takes them"
    try:
        agent_spec(agent)
    except ConfigError:
        return 1, "the agent's class cannot be imported by another process"
    if isinstance(inputs, Sized) and not isinstance(inputs, str | bytes):
        if len(inputs) < SMALL_INPUT_COUNT:
            return 1, f"a short list of inputs ({len(inputs)} < {SMALL_INPUT_COUNT})"
    path = os.fspath(inputs) if isinstance(inputs, str | os.PathLike) else None
    return new_job_workers(path if isinstance(path, str) else None, follow)


def load_agent(spec: str, *, loaded: bool = False) -> Agent:
    """`package.module:Class` or `path/file.py:Class` to an agent instance.

    A file this interpreter already loaded with the same bytes is not executed again (its
    `register_type` classes would be new classes under taken names); a changed file is.
    `loaded`: not even if it changed (a worker forked from a coordinator that loaded it)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(
            f"agent {spec!r} must look like 'package.module:Class' or 'path/file.py:Class'"
        )
    if target.endswith(".py") or os.sep in target:
        path = Path(target)
        if not path.exists():
            raise ConfigError(f"agent file {path} does not exist")
        if path.is_dir():
            raise ConfigError(f"agent file {path} is a directory; name a .py file in it")
        mod_name = f"{AGENT_FILE_MODULE_PREFIX}{path.stem}"
        had = sys.modules.get(mod_name)
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            raise ConfigError(f"agent file {path} cannot be read: {exc}") from exc
        if (
            had is not None
            and _same_file(getattr(had, "__file__", None), path)
            and (loaded or getattr(had, _SOURCE_DIGEST, None) == digest)
        ):
            # Loaded before in this interpreter (a forked worker; in Flink's thread mode every
            # task and job on a TaskManager shares one): executing it again would make new
            # classes under the names its `register_type` classes already hold.
            return _instance(spec, target, attr, had)
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"cannot load agent file {path}")
        module = importlib.util.module_from_spec(module_spec)
        setattr(module, _SOURCE_DIGEST, digest)
        sys.modules[mod_name] = module
        parent = str(path.parent.resolve())
        if parent not in sys.path:
            sys.path.insert(0, parent)
        try:
            module_spec.loader.exec_module(module)
        except InvalidArgumentError as exc:
            if had is None:
                raise
            sys.modules[mod_name] = had  # the version this interpreter runs stays
            raise ConfigError(
                f"agent file {path} changed since this Python process loaded it, and the new "
                f"version cannot replace the old one here ({exc}); run it in a new process "
                "(on Flink in thread mode: restart the TaskManagers)"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - the user's file failed: said in one line
            if had is None:
                sys.modules.pop(mod_name, None)
            else:
                sys.modules[mod_name] = had
            raise ConfigError(f"agent file {path} failed to load: {_failure(exc)}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            hint = (
                f"; for a file, give its path: '{target.replace('.', os.sep)}.py:{attr}'"
                if exc.name == target.partition(".")[0]
                else ""
            )
            raise ConfigError(f"cannot import agent module {target!r}: {exc}{hint}") from exc
        except Exception as exc:  # noqa: BLE001 - the user's module failed: said in one line
            raise ConfigError(f"agent module {target!r} failed to load: {_failure(exc)}") from exc
    return _instance(spec, target, attr, module)


def _failure(exc: BaseException) -> str:
    """An exception raised by the user's code, with where it was raised (file:line)."""
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__} at {exc.filename}:{exc.lineno}: {exc.msg}"
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


# The sha256 of an agent file's bytes, kept on the module `load_agent` made from it.
_SOURCE_DIGEST = "__ratchet_source_sha256__"


def _check_clock(clock: Any) -> None:
    """A clock is checked before the state directory is touched (`clock=time`, the module,
    failed deep in the store with an AttributeError and left a lock file behind)."""
    if not isinstance(clock, Clock):  # the protocol's methods, as RateLimit(clock=) checks
        raise InvalidTypeError(
            f"clock= must be a ratchet Clock (now, monotonic, sleep, sleep_sync), e.g. "
            f"ratchet.testing.FakeClock(); got {clock!r}"
        )


def _same_file(name: str | None, path: Path) -> bool:
    return name is not None and Path(name).resolve() == path.resolve()


def _instance(spec: str, target: str, attr: str, module: Any) -> Agent:
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError(f"{target} has no attribute {attr!r}")
    if isinstance(obj, type) and issubclass(obj, Agent):
        try:
            inspect.signature(obj).bind()
        except TypeError as exc:  # the advice is for this case only, not every failure inside
            raise ConfigError(
                f"agent {spec}: creating {attr}() failed: TypeError: {exc}; ratchet creates an agent "
                "class with no arguments (give its parameters defaults, or name an agent "
                "instance made at module level)"
            ) from exc
        except ValueError:  # no signature to read: call it and see
            pass
        try:
            return obj()
        except Exception as exc:  # noqa: BLE001 - the user's constructor failed
            raise ConfigError(f"agent {spec}: creating {attr}() failed: {_failure(exc)}") from exc
    if isinstance(obj, Agent):
        return obj
    raise ConfigError(f"{spec} is {obj!r}, not a ratchet.Agent subclass or instance")


def _source(inputs: Any, key: str, follow: bool) -> Source:
    if isinstance(inputs, Source):
        return inputs
    if is_uri(inputs):  # http://, postgresql://, nats:// (docs/connectors.md)
        return source_for(inputs, key=key, follow=follow)
    if isinstance(inputs, str | os.PathLike):
        path = Path(inputs)
        if path.is_dir() or (_has_glob(str(inputs)) and not path.is_file()):
            return JsonlFilesSource(inputs, key_field=key, follow=follow)
        return JsonlSource(inputs, key_field=key, follow=follow)
    if isinstance(inputs, Iterable):
        return IterableSource(inputs, key_field=key)
    raise ConfigError(
        f"inputs must be a JSONL path, a directory or glob pattern of JSONL files, an iterable "
        f"of dicts or a Source, not {inputs!r}"
    )


def _has_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def _sink(output: Any, append: bool) -> Sink:
    if is_uri(output):
        return sink_for(output, append=append)
    if isinstance(output, str | os.PathLike):
        return JsonlSink(output, append=append)
    if append:
        raise ConfigError(
            f"append_output applies to a JSONL output path, not {output!r} (a JsonlSink you "
            f"build yourself takes append=True)"
        )
    if isinstance(output, Sink):
        return output
    if callable(output):
        return CallbackSink(output)
    raise ConfigError(f"output must be a JSONL path, a callable or a Sink, not {output!r}")


def _refuse_lost_history(state_dir: Path, store: SqliteStore, sink: Sink, job: JobIdentity) -> None:
    """A state with no completed checkpoint whose job has outputs in its sink lost its
    history (an output is released only after its checkpoint completed): ratchet.db's
    write-ahead log removed, or the file copied without it. Running would redo every input
    and repeat every durable call."""
    if not sink.holds_outputs_of(job):
        return
    if restored_from_savepoint(store):
        # A savepoint's outputs may run ahead of it (the job was rolled back to it), but one
        # with no completed checkpoint holds nothing of the job: taken before its first
        # checkpoint, or of a state that had lost its write-ahead log. Going on from it would
        # redo every input whose output is out and repeat every durable call.
        raise _empty_savepoint_error(state_dir, store, sink, job)
    raise lost_history_error(state_dir, sink, job)


def _empty_savepoint_error(
    state_dir: Path, store: SqliteStore, sink: Sink, job: JobIdentity
) -> StateError:
    from ratchet.runtime._savepoints import SAVEPOINT_META

    record = store.meta(SAVEPOINT_META)
    of = record.get("state_dir") if isinstance(record, dict) else None
    listed = f" (`ratchet checkpoints --state {of}` lists its savepoints)" if of else ""
    return StateError(
        f"{state_dir} was restored from a savepoint{f' of {of}' if of else ''} that holds no "
        f"completed checkpoint, but {sink.describe()} holds outputs of its job {job.id}: the "
        f"savepoint was taken before the job's first checkpoint, or of a state that had lost "
        f"its write-ahead log, and going on from it would redo every input and repeat every "
        f"durable call. Continue from a savepoint taken at a checkpoint{listed} into a new "
        f"--state; to start the job over, remove {state_dir} and write to a new output"
    )


def _refuse_lost_layout(state_dir: Path) -> None:
    """A sharded state whose `shards/layout.json` was removed looks like a one-process state
    that lost its database: said as what it is, with the number of workers to write back."""
    from ratchet.runtime._shards import SHARDS_DIR, lost_layout_error

    if (
        not (state_dir / DB_NAME).exists()
        and (state_dir / JOB_FILE).exists()
        and (state_dir / SHARDS_DIR).is_dir()
    ):
        raise lost_layout_error(state_dir)


def restored_from_savepoint(store: SqliteStore) -> bool:
    from ratchet.runtime._savepoints import SAVEPOINT_META

    restored = store.conn.execute("SELECT 1 FROM meta WHERE name = ?", (SAVEPOINT_META,))
    return restored.fetchone() is not None


def lost_history_error(
    state_dir: Path, sink: Sink, job: JobIdentity, job_dir: Path | None = None
) -> StateError:
    """What `_refuse_lost_history` says; a sharded job says it of one shard's `state_dir`
    within its `job_dir`."""
    return StateError(
        f"{state_dir / DB_NAME} has no completed checkpoint, but {sink.describe()} holds "
        f"outputs of its job {job.id}: the state lost its committed work (its write-ahead "
        f"log {DB_NAME}-wal was removed, or {DB_NAME} was copied without it) and a run would "
        f"redo every input and repeat every durable call. Restore {DB_NAME} together with "
        f"its {DB_NAME}-wal file, or continue from a savepoint taken before (--state NEW "
        f"--from-savepoint PATH); to start the job over, remove {job_dir or state_dir} and "
        f"write to a new output"
    )


class Job:
    """One agent, one state directory: opened (and locked) on enter, closed on exit.

    `job` is the state directory's identity (`job.json`, made once with the state); the
    output is bound to it, and the input to the checkpointed source position.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        inputs: Any,
        output: Any,
        state_dir: str | os.PathLike[str],
        key: str = "key",
        follow: bool = False,
        config: EngineConfig | None = None,
        agent_config: dict[str, Any] | None = None,
        on_progress: Callable[[Engine], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        append_output: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.config.validate()
        _check_clock(clock)
        self.binding = AgentBinding(agent, agent_config)
        # The connectors first: a wrong input or output path is refused before the state
        # directory is created.
        refuse_output_read_as_input(inputs, output)
        source = _source(inputs, key, follow)
        sink = _sink(output, append_output)
        self.state_dir = Path(state_dir)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._lock = StateLock(self.state_dir)
            self._lock.acquire()
        except BaseException as exc:
            source.close()
            sink.close()
            if isinstance(exc, OSError):
                raise state_dir_error(self.state_dir, exc) from exc
            raise
        store: SqliteStore | None = None
        try:
            _refuse_lost_layout(self.state_dir)
            store = SqliteStore.open(
                self.state_dir,
                self.binding.name,
                self.binding.fingerprint,
                self.binding.action_names,
                synchronous=self.config.synchronous,
                clock=clock,
            )
            # A state that completed checkpoints but has no job file predates job ids.
            history = store.stats()["counts"]["completed"] > 0
            had_job = (self.state_dir / JOB_FILE).exists()
            self.job = job_identity(self.state_dir, has_history=history, clock=clock, rng=rng)
            sink.open(self.job)
            # (A state re-sharded back to one worker has a seed position, not a checkpoint.)
            if had_job and not history and not store.meta("source"):
                _refuse_lost_history(self.state_dir, store, sink, self.job)
            source.open(self.job, checkpoint_interval=self.config.checkpoint_interval)
            self.store = store
            self._closed = False
            self.engine = Engine(
                self.binding,
                self.store,
                source,
                sink,
                self.config,
                on_progress,
                clock=clock,
            )
        except BaseException:
            source.close()
            sink.close()
            if store is not None:
                store.close()
            self._lock.release()
            raise

    async def run_async(self, handle_signals: bool = False) -> EngineResult:
        loop = asyncio.get_running_loop()
        install_task_factory(loop)
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.engine.request_stop, f"signal {sig.name}")
        try:
            return await self.engine.run()
        finally:
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            self.close()

    def close(self) -> None:
        """Release the output, the database and the state lock; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.close_io()  # a job built and never run still holds its output file
        finally:
            self.store.close()
            self._lock.release()


class _NoWaitExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor for jobs ratchet runs itself: at the end of the job it
    does not wait for a thread stuck in a blocking call (a tool parked forever must not hold
    a clean stop hostage; the final checkpoint already recorded it as in flight)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=True)


def run_owned(job: Job, handle_signals: bool = False) -> EngineResult:
    """Run a job on a new event loop that ratchet owns (what `run()` and the CLI do)."""

    async def main() -> EngineResult:
        asyncio.get_running_loop().set_default_executor(
            _NoWaitExecutor(thread_name_prefix="ratchet-io")
        )
        return await job.run_async(handle_signals=handle_signals)

    coro = main()
    try:
        return asyncio.run(coro)
    finally:
        # If asyncio.run refused to start (a loop already runs in this thread), the job
        # never ran: close it, or its state directory stays locked by this process.
        coro.close()
        job.close()


def _refuse_running_loop(what: str) -> None:
    """`what` starts its own event loop: inside a running one (Jupyter, an async app) say
    what to await instead, before any state is touched."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise ConfigError(
        f"{what} cannot be called from a running event loop (Jupyter, an async app): it "
        f"starts its own; there, use `await ratchet.Job(agent, inputs=..., output=..., "
        f'state_dir=...).run_async()` (docs/api.md, "Running a job inside an event loop")'
    )


def run(
    agent: Agent | str,
    *,
    inputs: Any,
    output: Any,
    state_dir: str | os.PathLike[str],
    key: str = "key",
    follow: bool = False,
    config: EngineConfig | None = None,
    agent_config: dict[str, Any] | None = None,
    clock: Clock = SYSTEM_CLOCK,
    append_output: bool = False,
    rng: random.Random | None = None,
    workers: int | Literal["auto"] = 1,
) -> EngineResult:
    """Run `agent` over `inputs` into `output`, durably in `state_dir`; resumes if it has state.

    `inputs`: a JSONL path, a directory or glob pattern of JSONL files (rotated logs, read in
    order and tracked by identity), a connector URI (`http://HOST:PORT`,
    `postgresql://...?table=NAME`, `nats://...?stream=S&subject=SUBJ`; docs/connectors.md),
    an iterable of dicts (replayable in the same order), or a Source.
    `output`: a JSONL path (exactly once, bound to this state's job), a connector URI
    (`postgresql://...?table=NAME`, `nats://...`; exactly once), a callable (at least
    once, with stable ids), or a Sink. `append_output=True` lets a JSONL output that holds
    another job's outputs be appended to (otherwise it is refused).
    `clock`: where the engine reads time (tests pass `ratchet.testing.FakeClock`); `rng`:
    where a new state's job id comes from (default: the operating system's randomness).
    `workers`: shard the keys over this many worker processes (docs/operations.md); the
    agent's class must be importable in a new process. A state written with another number
    of workers has its keys moved first; `"auto"` lets ratchet choose (docs/operations.md,
    "How many workers"). `agent` may be the spec `ratchet run` takes
    (`package.module:Class` or `path/file.py:Class`): ratchet then loads it, and workers can be
    forked from this process instead of started as new interpreters.
    Inside a running event loop (Jupyter, an async app) it is refused: there, await
    `Job(...).run_async()` (docs/api.md).
    """
    from ratchet.runtime._shards import is_sharded

    _refuse_running_loop("ratchet.run()")
    if workers == "auto":
        workers, why = _auto(agent, inputs, state_dir, follow, agent_config, clock, rng)
        log.info("workers=auto: %d (%s)", workers, why)
    elif isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be a number >= 1 or 'auto', not {workers!r}")

    if workers != 1 or is_sharded(state_dir):
        if agent_config is not None or clock is not SYSTEM_CLOCK or rng is not None:
            raise ConfigError(
                "workers > 1 (or a sharded state) takes neither agent_config, clock nor rng: "
                "each worker process builds its agent from its class and reads the system clock"
            )
        from ratchet.agents._sharded import run_sharded

        return run_sharded(
            agent, inputs=inputs, output=output, state_dir=state_dir, workers=workers, key=key,
            follow=follow, config=config, append_output=append_output,
        )  # fmt: skip
    job = Job(
        load_agent(agent) if isinstance(agent, str) else agent,
        inputs=inputs,
        output=output,
        state_dir=state_dir,
        key=key,
        follow=follow,
        config=config,
        agent_config=agent_config,
        clock=clock,
        append_output=append_output,
        rng=rng,
    )
    return run_owned(job)
