"""`ratchet run --workers N`: a job over N shard worker processes, and each worker's entry.

The coordinator, the shard wire and the guarantees are in `ratchet.runtime._multiproc`; the
layout and re-sharding in `ratchet.runtime._shards`. This module puts them together with the
agent layer (loading the agent, building the source and sink, the per-shard `Job`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ratchet._errors import ConfigError, RatchetError
from ratchet.agents._agent import Agent
from ratchet.agents._context import AgentBinding
from ratchet.agents._run import (
    Job,
    _sink,
    _source,
    load_agent,
    lost_history_error,
    restored_from_savepoint,
    run_owned,
)
from ratchet.connectors import redact, replays_in_order
from ratchet.runtime._engine import (
    EngineConfig,
    EngineResult,
    check_cut_output,
    stopped_by_signal,
    stopped_for_max_errors,
)
from ratchet.runtime._forking import open_fds, start_method
from ratchet.runtime._io import (
    JOB_FILE,
    JobIdentity,
    Sink,
    Source,
    job_identity,
    refuse_output_read_as_input,
)
from ratchet.runtime._multiproc import (
    Coordinator,
    PipeSink,
    PipeSource,
    WorkerConn,
    add_counts,
    die_with_parent,
    wait_for_lock,
)
from ratchet.runtime._shards import (
    Layout,
    check_no_timers,
    check_quiet,
    first_redrive_seq,
    frozen,
    int_text,
    lost_layout_error,
    read_layout,
    read_position,
    reshard,
    shard_of,
    shard_position,
)
from ratchet.store._sqlite import DB_NAME, SqliteStore, StateLock, state_dir_error

log = logging.getLogger("ratchet.shards")


def agent_spec(agent: Agent | str) -> str:
    """How a worker process loads the agent: `module:Class` or `path/file.py:Class`."""
    if isinstance(agent, str):
        return agent
    cls = type(agent)
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if cls.__module__.startswith("ratchet_user_") and path:
        return f"{path}:{cls.__qualname__}"  # loaded from a file by load_agent
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ConfigError(
            f"workers > 1 start the agent {cls.__qualname__} in new processes, which cannot "
            f"import it from {cls.__module__!r}; define it in a module and pass that module's "
            f"class (or the spec 'package.module:Class')"
        )
    return f"{cls.__module__}:{cls.__qualname__}"


class _NoInput(Source):
    """The job's source, restored and positioned, but yielding nothing: a single-process state
    finishes what it holds (runs in flight, queued inputs, the outbox) and admits no input."""

    follow = False

    def __init__(self, inner: Source) -> None:
        self.inner = inner

    def open(self, job: Any, *, checkpoint_interval: float) -> None:
        self.inner.open(job, checkpoint_interval=checkpoint_interval)

    def restore(self, position: dict[str, Any]) -> None:
        self.inner.restore(position)

    def position(self) -> dict[str, Any]:
        return self.inner.position()

    def next_record(self) -> None:
        return None

    def unread(self) -> None:
        pass

    def acknowledge(self, position: dict[str, Any]) -> None:
        self.inner.acknowledge(position)

    def close(self) -> None:
        self.inner.close()


def refuse_too_many(workers: int) -> None:
    """Refuse more worker processes than this machine can use: four per usable core, at
    least 16 (`--workers 1000` forked a thousand processes for three inputs)."""
    from ratchet.runtime._auto_workers import usable_cores

    most = max(16, 4 * usable_cores())
    if workers > most:
        raise ConfigError(
            f"--workers {workers} is more than {most}, four worker processes per usable core "
            f"of this machine (at least 16): past that each worker only adds its start-up, "
            f"its files and its checkpoints; pass --workers auto, or at most {most} (more "
            f"than one machine gives: the Flink engine, docs/flink.md)"
        )


def run_sharded(
    agent: Agent | str,
    *,
    inputs: Any,
    output: Any,
    state_dir: str | os.PathLike[str],
    workers: int,
    key: str = "key",
    follow: bool = False,
    config: EngineConfig | None = None,
    append_output: bool = False,
    handle_signals: bool = False,
    on_report: Callable[[dict[str, Any]], None] | None = None,
    on_progress: Callable[[Any], None] | None = None,
) -> EngineResult:
    """Run the job with `workers` shard processes (1: the single-process engine), moving keys
    between shards first when the state was written with another number of workers.

    `on_report` (workers > 1): the whole job's status after every shard checkpoint
    (`merge_reports`): how a supervised sharded job reports to its supervisor; `on_progress`
    is the engine's hook when the job runs in one process (workers == 1)."""
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, not {workers}")
    refuse_too_many(workers)
    if workers > 1:  # before a layout or a shard is made
        refuse_output_read_as_input(inputs, output)
        if not replays_in_order(inputs):
            # Its inputs would be numbered again in another order after a coordinator
            # crash: one dropped as done (and acknowledged), another run twice (a chaos
            # test saw both).
            shown = redact(inputs) if isinstance(inputs, str) else type(inputs).__name__
            raise ConfigError(
                f"--input {shown} cannot be read by --workers {workers}: after a crash it "
                f"gives the inputs not yet acknowledged back in another order, and several "
                f"workers number inputs by the order they are read, so one could be lost and "
                f"another run twice. Run it with --workers 1 (a state written with more workers "
                f"is moved back to one process)"
            )
        start_method()  # a bad $RATCHET_WORKER_START is refused before anything runs
    config = config or EngineConfig()
    config.validate()
    spec = agent_spec(agent)
    if isinstance(agent, str):
        before = open_fds()
        instance = load_agent(spec)
        opened = {fd: name for fd, name in open_fds().items() if before.get(fd) != name}
        # Forked workers share the module as loaded here: not when its import holds a file or
        # a socket open (in a worker that would be /dev/null; a new interpreter opens its own).
        no_fork = (
            f"loading the agent opened {', '.join(sorted(opened.values()))}" if opened else None
        )
    else:  # the calling program's modules and state are not ratchet's to fork
        instance = agent
        no_fork = "the agent was passed as an object, not loaded by ratchet from its spec"
    binding = AgentBinding(instance)
    sdir = Path(state_dir)
    try:
        sdir.mkdir(parents=True, exist_ok=True)
        lock = StateLock(sdir)
        lock.acquire()
    except OSError as exc:
        raise state_dir_error(sdir, exc) from exc
    try:
        layout = read_layout(sdir)
        drained: EngineResult | None = None
        if layout.workers != workers:
            changed, drained = _change_workers(
                spec, instance, binding, layout, workers, sdir, lock,
                inputs=inputs, output=output, key=key, config=config, append=append_output,
                no_fork=no_fork, handle_signals=handle_signals,
            )  # fmt: skip
            if changed is None:
                assert drained is not None
                # It stopped before the old shards were done (--max-errors, or a SIGTERM or
                # SIGINT while they finished): the old layout stays in force.
                return drained
            layout = changed
        if workers == 1:
            lock.release()
            job = Job(
                instance, inputs=inputs, output=output, state_dir=sdir, key=key, follow=follow,
                config=config, append_output=append_output, on_progress=on_progress,
            )  # fmt: skip
            result = run_owned(job, handle_signals=handle_signals)
        else:
            result = _coordinate(
                spec, layout, sdir, inputs=inputs, output=output, key=key, follow=follow,
                config=config, append=append_output, handle_signals=handle_signals,
                on_report=on_report, no_fork=no_fork,
            )  # fmt: skip
        if drained is not None:  # what the old shards finished counts in this run's result
            add_counts(result, asdict(drained))
        return result
    finally:
        lock.release()


def _coordinate(
    spec: str,
    layout: Layout,
    sdir: Path,
    *,
    inputs: Any,
    output: Any,
    key: str,
    follow: bool,
    config: EngineConfig,
    append: bool,
    handle_signals: bool,
    stop_at: int | None = None,
    on_report: Callable[[dict[str, Any]], None] | None = None,
    no_fork: str | None = None,
) -> EngineResult:
    """`no_fork`: why the workers must be new interpreters (None: forked where safe)."""
    source = _source(inputs, key, follow and stop_at is None)
    sink = _sink(output, append)
    try:
        job = job_identity(sdir, has_history=False)
        sink.open(job)
        _refuse_lost_shard_history(layout, sdir, sink, job)
        check_cut_output(sink, lambda text, whole: _in_an_outbox(layout, text, whole))
        source.open(job, checkpoint_interval=config.checkpoint_interval)
        if no_fork is not None and start_method() == "fork":
            log.info("starting shard workers as new interpreters: %s", no_fork)
        coordinator = Coordinator(
            spec, layout, sdir, source, sink, config, stop_at=stop_at, on_report=on_report,
            worker_main=_forked_main if no_fork is None else None,
        )  # fmt: skip
        try:
            coordinator.fork_workers()  # before the loop and its threads, where safe
            return asyncio.run(coordinator.run(handle_signals=handle_signals))
        finally:
            coordinator.end_workers()
    finally:
        try:
            source.close()
        finally:
            sink.close()  # releases the output file's lock


# An output's id is "<key>:<run seq>:<task id>:<index>" (`Machine`); a key may hold ':'.
_OUTPUT_ID = re.compile(r"(.*):[0-9]+:[^:]*:[0-9]+", re.DOTALL)


def _refuse_lost_shard_history(layout: Layout, sdir: Path, sink: Sink, job: JobIdentity) -> None:
    """`_refuse_lost_history` for each shard: a shard's state with no completed checkpoint
    while the sink holds outputs of keys it holds lost its history (its write-ahead log
    removed after a kill). A shard that had no work yet, or was killed before its first
    checkpoint, released none of its keys' outputs; every shard is made with a seed
    position, at input 0 unless re-sharding moved keys into it. The key of an output is read
    from its id, of either type its text can be."""
    shards = len(layout.dirs)
    for index, shard in enumerate(layout.dirs):
        if not (shard / JOB_FILE).exists() or not (shard / DB_NAME).exists():
            continue
        try:
            store = SqliteStore.open_readonly(shard)
        except RatchetError:
            continue  # a database that is not whole: its worker's start names the problem
        try:
            if (
                store.stats()["counts"]["completed"] > 0
                or shard_position(store.meta("source") or {})[0] > 0
                or restored_from_savepoint(store)
            ):
                continue
        finally:
            store.close()

        def of_this_shard(out_id: str, index: int = index) -> bool:
            m = _OUTPUT_ID.fullmatch(out_id)
            if m is None:
                return False
            text = m.group(1)
            return shard_of(text, shards) == index or (
                int_text(text) and shard_of(int(text), shards) == index
            )

        if sink.holds_outputs_where(job, of_this_shard):
            raise lost_history_error(shard, sink, job, sdir)


def _in_an_outbox(layout: Layout, text: str, whole: bool) -> bool:
    """Whether a shard's outbox holds output `text` (`whole` False: an id beginning so)."""
    for shard in layout.dirs:
        if not (shard / DB_NAME).exists():
            continue
        try:
            store = SqliteStore.open_readonly(shard)
        except RatchetError:
            continue  # its worker's start names the problem
        try:
            conn = store.conn
            if whole:
                row = conn.execute("SELECT 1 FROM outbox WHERE id = ?", (text,)).fetchone()
            else:
                row = conn.execute(
                    "SELECT 1 FROM outbox WHERE substr(id, 1, ?) = ?", (len(text), text)
                ).fetchone()
            if row is not None:
                return True
        finally:
            store.close()
    return False


def _change_workers(
    spec: str,
    agent: Agent,
    binding: AgentBinding,
    layout: Layout,
    workers: int,
    sdir: Path,
    lock: StateLock,
    *,
    inputs: Any,
    output: Any,
    key: str,
    config: EngineConfig,
    append: bool,
    no_fork: str | None,
    handle_signals: bool = False,
) -> tuple[Layout | None, EngineResult | None]:
    """Bring every shard of `layout` to one input position with nothing in flight, then move
    the keys to `workers` shards (at that checkpoint, before any new input is admitted).
    Returns the new layout and what finishing the old shards did; no layout when that
    stopped early (`--max-errors`, a SIGTERM or SIGINT): the job stops there, as it would
    have. A run waiting on a durable timer is refused before anything is finished."""
    check_no_timers(layout.dirs, workers, layout.workers)
    if layout.workers == 1:
        if not (sdir / DB_NAME).exists():
            if (sdir / JOB_FILE).exists():  # not a new state: its database or layout is lost
                raise lost_layout_error(sdir)
            return reshard(sdir, layout, workers, binding.name, binding.fingerprint,
                           binding.action_names, position=(0, {})), None  # fmt: skip
        # Finish what the single-process state holds, admitting nothing new.
        lock.release()
        job = Job(
            agent, inputs=_NoInput(_source(inputs, key, False)), output=output, state_dir=sdir,
            config=config, append_output=append,
        )  # fmt: skip
        drained = run_owned(job, handle_signals=handle_signals)
        lock.acquire()
        if stopped_for_max_errors(drained.stopped_by) or stopped_by_signal(drained.stopped_by):
            return None, drained
        store = SqliteStore.open_readonly(sdir)
        try:
            src = store.meta("source") or {}
        finally:
            store.close()
        position = (int(src.get("next_seq", 0)), dict(src.get("position") or {}))
    else:
        # Every shard reads on to where the furthest one is, and finishes what it holds.
        furthest = max(read_position(d)[0] for d in layout.dirs)
        drained = _coordinate(
            spec, layout, sdir, inputs=inputs, output=output, key=key, follow=False,
            config=config, append=append, handle_signals=handle_signals, stop_at=furthest,
            no_fork=no_fork,
        )  # fmt: skip
        if stopped_for_max_errors(drained.stopped_by) or stopped_by_signal(drained.stopped_by):
            return None, drained
        spots = [read_position(d) for d in layout.dirs]
        aligned = {(n, f) for n, f, _at in spots}
        if aligned != {(furthest, furthest)}:
            raise ConfigError(
                f"cannot change the number of workers to {workers}: the {layout.workers} shards "
                f"of {sdir} did not reach one input position ({sorted(aligned)} (next, from), "
                f"expected {furthest}); run the job with --workers {layout.workers} to the end "
                f"of its input first"
            )
        position = (furthest, spots[0][2])
    with frozen(layout.dirs):  # a signal sent now waits, then goes to the new layout
        check_quiet(layout.dirs, workers)
        return reshard(sdir, layout, workers, binding.name, binding.fingerprint,
                       binding.action_names, position=position), drained  # fmt: skip


def _forked_main(argv: list[str]) -> int:
    """A worker forked from the coordinator: it has the agent's module as loaded there."""
    return worker_main(argv, forked=True)


def worker_main(argv: list[str] | None = None, *, forked: bool = False) -> int:
    """One shard: an ordinary embedded engine fed and drained by the coordinator."""
    p = argparse.ArgumentParser(prog="ratchet-shard-worker")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--agent", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--report", action="store_true", help="report status after each checkpoint")
    p.add_argument("--lines-for", default=None, help="render JSONL output lines for this job id")
    args = p.parse_args(argv)
    die_with_parent()
    conn = WorkerConn(socket.socket(fileno=args.fd))
    try:
        agent = load_agent(args.agent, loaded=forked)
        config = EngineConfig(**json.loads(args.config))
        source = PipeSource(conn)
        sink = PipeSink(conn, lines_for=args.lines_for)
        wait_for_lock(Path(args.dir))

        def report(engine: Any) -> None:
            line = {"checkpoints": engine.stats.as_dict(), "status": engine.status()}
            conn.send(["report", json.dumps(line, default=str)])

        job = Job(
            agent, inputs=source, output=sink, state_dir=args.dir, config=config,
            on_progress=report if args.report else None,
        )  # fmt: skip
        engine = job.engine
        engine.redrive_seqs = itertools.count(first_redrive_seq(Path(args.dir)))

        def wake() -> None:
            loop = engine._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(engine._poke)
                except RuntimeError:
                    pass

        stop_asked = threading.Event()  # the coordinator's "stop" came (not a signal)

        def stop() -> None:
            loop = engine._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(engine.request_stop, "stopped by the coordinator")

        def read() -> None:
            while True:
                try:
                    msg = conn.recv()
                except OSError:
                    msg = None
                if msg is None:
                    os._exit(70)  # the coordinator is gone: stop as a crash would, safely
                kind = msg[0]
                if kind in ("in", "eof"):
                    source.push(msg)
                elif kind == "ack":
                    sink.answered(msg[1], None, msg[2] if len(msg) > 2 else None)
                elif kind == "nack":
                    sink.answered(msg[1], msg[2], away=msg[3] if len(msg) > 3 else None)
                elif kind == "stop":
                    stop_asked.set()
                    stop()

        source.wake = wake
        threading.Thread(target=read, name="ratchet-shard-reader", daemon=True).start()
        result = run_owned(job, handle_signals=True)
        how = result.stopped_by
        if how.startswith("signal SIG") and not stop_asked.is_set():
            # Sent to this worker alone (the coordinator stops its workers by message): its
            # work is checkpointed; it ends by that signal, so the coordinator restarts it as
            # any killed worker (a "done" would have retired its shard, keys and all).
            conn.send(["partial", asdict(result)])  # what it did counts in the job's result
            sig = signal.Signals[how.removeprefix("signal ")]
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        conn.send(["done", asdict(result)])
    except RatchetError as exc:
        conn.send(["error", type(exc).__name__, str(exc)])
        return 2
    except BaseException as exc:
        conn.send(["error", type(exc).__name__, f"{type(exc).__name__}: {exc}"])
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(worker_main())
