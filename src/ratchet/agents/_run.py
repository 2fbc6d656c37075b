"""Running an agent on the embedded engine: `ratchet.run()` and how the CLI finds an agent."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import os
import signal
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import ConfigError
from ratchet.agents._agent import Agent
from ratchet.agents._context import AgentBinding, install_task_factory
from ratchet.runtime._engine import Engine, EngineConfig, EngineResult
from ratchet.runtime._io import CallbackSink, IterableSource, JsonlSink, JsonlSource, Sink, Source
from ratchet.store._sqlite import SqliteStore, StateLock


def load_agent(spec: str) -> Agent:
    """`package.module:Class` or `path/file.py:Class` to an agent instance."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(
            f"agent {spec!r} must look like 'package.module:Class' or 'path/file.py:Class'"
        )
    if target.endswith(".py") or os.sep in target:
        path = Path(target)
        if not path.exists():
            raise ConfigError(f"agent file {path} does not exist")
        mod_name = f"ratchet_user_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"cannot load agent file {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        sys.path.insert(0, str(path.parent.resolve()))
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"cannot import agent module {target!r}: {exc}") from exc
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError(f"{target} has no attribute {attr!r}")
    if isinstance(obj, type) and issubclass(obj, Agent):
        return obj()
    if isinstance(obj, Agent):
        return obj
    raise ConfigError(f"{spec} is {obj!r}, not a ratchet.Agent subclass or instance")


def _source(inputs: Any, key: str, follow: bool) -> Source:
    if isinstance(inputs, Source):
        return inputs
    if isinstance(inputs, str | os.PathLike):
        return JsonlSource(inputs, key_field=key, follow=follow)
    if isinstance(inputs, Iterable):
        return IterableSource(inputs, key_field=key)
    raise ConfigError(
        f"inputs must be a JSONL path, an iterable of dicts or a Source, not {inputs!r}"
    )


def _sink(output: Any) -> Sink:
    if isinstance(output, Sink):
        return output
    if isinstance(output, str | os.PathLike):
        return JsonlSink(output)
    if callable(output):
        return CallbackSink(output)
    raise ConfigError(f"output must be a JSONL path, a callable or a Sink, not {output!r}")


class Job:
    """One agent, one state directory: opened (and locked) on enter, closed on exit."""

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
    ) -> None:
        self.config = config or EngineConfig()
        self.config.validate()
        self.binding = AgentBinding(agent, agent_config)
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock = StateLock(self.state_dir)
        self._lock.acquire()
        try:
            self.store = SqliteStore.open(
                self.state_dir,
                self.binding.name,
                self.binding.fingerprint,
                self.binding.action_names,
                synchronous=self.config.synchronous,
                clock=clock,
            )
            self.engine = Engine(
                self.binding,
                self.store,
                _source(inputs, key, follow),
                _sink(output),
                self.config,
                on_progress,
                clock=clock,
            )
        except BaseException:
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

    return asyncio.run(main())


def run(
    agent: Agent,
    *,
    inputs: Any,
    output: Any,
    state_dir: str | os.PathLike[str],
    key: str = "key",
    follow: bool = False,
    config: EngineConfig | None = None,
    agent_config: dict[str, Any] | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> EngineResult:
    """Run `agent` over `inputs` into `output`, durably in `state_dir`; resumes if it has state.

    `inputs`: a JSONL path, an iterable of dicts (replayable in the same order), or a Source.
    `output`: a JSONL path (exactly once), a callable (at least once, with stable ids), or a Sink.
    `clock`: where the engine reads time (tests pass `ratchet.testing.FakeClock`).
    """
    job = Job(
        agent,
        inputs=inputs,
        output=output,
        state_dir=state_dir,
        key=key,
        follow=follow,
        config=config,
        agent_config=agent_config,
        clock=clock,
    )
    return run_owned(job)
