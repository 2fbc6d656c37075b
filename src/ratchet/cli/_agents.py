"""`ratchet run`, `ratchet status`, `ratchet inspect`: the agent side of the CLI."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ratchet._argtypes import add_key_type, refuse_key_type_without_key, whole_number
from ratchet._clock import SYSTEM_CLOCK
from ratchet._errors import (
    EXIT_BAD_INPUT,
    EXIT_ERRORS,
    EXIT_OK,
    EXIT_USAGE,
    BadInputError,
    ConfigError,
    RatchetError,
    ServerUnreachableError,
    StateInUseError,
)
from ratchet.runtime._io import to_json_text

# The `run` parser and the destinations of its supervision options, kept so a supervised run can
# derive its worker's command line from the parsed arguments (a new flag cannot be forgotten).
_RUN_PARSER: argparse.ArgumentParser | None = None
_SUPERVISION_DESTS: frozenset[str] = frozenset()
# Each supervision option but --supervise: its destination -> (its flag, its default).
_SUPERVISOR_ONLY: dict[str, tuple[str, Any]] = {}


# A TCP port: 0 (any free one) to 65535.
_port = whole_number(
    0,
    65535,
    not_a_number="{text!r} is not a port number",
    out_of_range="{n} is not a port (0 to 65535)",
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    global _RUN_PARSER, _SUPERVISION_DESTS
    run = sub.add_parser("run", help="run an agent over a JSONL input, durably")
    run.add_argument("agent", help="package.module:Class or path/file.py:Class")
    run.add_argument(
        "--input",
        required=True,
        help="JSON Lines file, one input object per line; or a directory or a quoted glob "
        "pattern ('logs/app.jsonl*') of files read in order, for logs rotated by renaming; or a "
        "connector URI: http://127.0.0.1:PORT (POST /v1/events), "
        "postgresql://USER@HOST/DB?table=NAME, nats://HOST:PORT?stream=S&subject=SUBJ "
        "(docs/connectors.md)",
    )
    run.add_argument(
        "--output",
        required=True,
        help="JSON Lines file the outputs are appended to; or a connector URI: "
        "postgresql://USER@HOST/DB?table=NAME, nats://HOST:PORT?stream=S&subject=SUBJ",
    )
    run.add_argument(
        "--append-output",
        action="store_true",
        help="append to an --output file that holds another job's outputs (refused otherwise)",
    )
    run.add_argument("--state", required=True, help="state directory (created if missing)")
    run.add_argument(
        "--from-savepoint",
        default=None,
        metavar="PATH",
        help="start the job from a savepoint (`ratchet savepoint`): --state must be new or "
        "empty; the savepoint's state is restored into it first",
    )
    run.add_argument("--key", default="key", help="input field that holds the key (default: key)")
    run.add_argument("--follow", action="store_true", help="keep reading new lines (unbounded job)")
    run.add_argument(
        "--checkpoint-interval",
        type=float,
        default=200.0,
        metavar="MS",
        help="milliseconds between checkpoints; 0 starts the next as soon as one completes",
    )
    run.add_argument("--max-concurrent-runs", type=int, default=64)
    run.add_argument("--max-buffered-inputs", type=int, default=1000)
    run.add_argument(
        "--max-tasks-per-run",
        type=int,
        default=10_000,
        help="tasks one run may dispatch before it ends with an error output (default 10000)",
    )
    run.add_argument("--tolerable-checkpoint-failures", type=int, default=3)
    run.add_argument("--sync-workers", type=int, default=16, help="threads for sync actions")
    run.add_argument(
        "--synchronous",
        choices=["normal", "full"],
        default="normal",
        help="SQLite synchronous mode: normal survives process crashes, full also power loss",
    )
    run.add_argument(
        "--on-bad-input",
        choices=["stop", "skip", "dead-letter"],
        default="stop",
        help="a bad line: stop before it (exit 3), skip it, or keep it as a dead letter",
    )
    run.add_argument(
        "--trace-retention",
        default="20",
        metavar="POLICY",
        help="traces of completed runs kept (`ratchet trace`): the last N per key ('20', the "
        "default), an age ('7d'), both ('20,7d'), or 'off'",
    )
    run.add_argument(
        "--otel-endpoint",
        default=None,
        metavar="URL",
        help="export run traces as OpenTelemetry spans over OTLP/HTTP (e.g. "
        "http://127.0.0.1:4318/v1/traces; default: the OTEL_EXPORTER_OTLP_* variables); "
        "needs pip install 'ratchet[otel]'",
    )
    run.add_argument(
        "--allow-errors",
        action="store_true",
        help="exit 0 from a bounded job in which runs ended in error (default: exit 4)",
    )
    run.add_argument(
        "--max-errors",
        type=int,
        default=None,
        metavar="N",
        help="stop (final checkpoint, exit 4) once more than N runs ended in error",
    )
    run.add_argument(
        "--workers",
        type=_workers_arg,
        default=1,
        metavar="N|auto",
        help="shard the keys over N worker processes (default 1: one process); a state "
        "written with another N has its keys moved first; auto: one per usable core (at most "
        "4), one for a small input, and an existing state's own number (docs/operations.md)",
    )
    run.add_argument("--json", action="store_true", help="print the run's summary as JSON")
    sup = run.add_argument_group("supervision")
    sup.add_argument(
        "--supervise",
        action="store_true",
        help="run the engine in a worker process and restart it when it dies",
    )
    sup.add_argument(
        "--restart-attempts",
        type=int,
        default=10,
        help="restarts in a row before the supervisor gives up (default 10)",
    )
    sup.add_argument(
        "--restart-delay", type=float, default=1.0, metavar="SECONDS", help="default 1"
    )
    sup.add_argument(
        "--restart-reset-after",
        type=float,
        default=600.0,  # the Supervisor's RESTART_RESET_AFTER (not imported on the run path)
        metavar="SECONDS",
        help="a worker that runs this long starts the count of --restart-attempts again "
        "(default 600; 0: never)",
    )
    sup.add_argument(
        "--rest-port",
        type=_port,
        default=None,
        help="serve the REST status API here (0: a free port, printed)",
    )
    sup.add_argument(
        "--rest-host",
        default="127.0.0.1",
        help="default 127.0.0.1; any other address needs --rest-token",
    )
    sup.add_argument(
        "--rest-token",
        default=None,
        metavar="TOKEN",
        help="every REST request must send `Authorization: Bearer TOKEN` (default: the "
        "environment variable RATCHET_REST_TOKEN; required off loopback); never passed to "
        "the worker",
    )
    run.set_defaults(func=cmd_run)
    _RUN_PARSER = run
    # A worker restarts on the state the first start restored: the savepoint is not its flag.
    _SUPERVISION_DESTS = frozenset(a.dest for a in sup._group_actions) | {"from_savepoint"}
    _SUPERVISOR_ONLY.update(
        (a.dest, (a.option_strings[0], a.default))
        for a in sup._group_actions
        if a.dest != "supervise"
    )

    status = sub.add_parser(
        "status", help="checkpoints, in-flight runs and queued inputs of a state"
    )
    where = status.add_mutually_exclusive_group(required=True)
    where.add_argument("--state", help="read a state directory")
    where.add_argument(
        "--url",
        help="ask a supervised job's REST API, e.g. http://127.0.0.1:8765 (or the "
        "http://127.0.0.1:8765/v1/job it printed)",
    )
    where.add_argument(
        "--jobmanager",
        metavar="HOST:PORT",
        help="ask a Flink cluster's JobManager (REST port): its jobs, or with --job one job",
    )
    status.add_argument("--job", default=None, help="with --jobmanager: a Flink job id")
    status.add_argument(
        "--rest-token",
        default=None,
        metavar="TOKEN",
        help="with --url: the job's token (default: $RATCHET_REST_TOKEN)",
    )
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    inspect = sub.add_parser("inspect", help="the committed short-term memory per key")
    source = inspect.add_mutually_exclusive_group(required=True)
    source.add_argument("--state", help="a state directory of the embedded engine")
    source.add_argument(
        "--flink-memory",
        metavar="DIR",
        help="the memory output of a Flink job (`ratchet flink run --memory-output DIR`)",
    )
    inspect.add_argument("--key", default=None, help="only this key (see --key-type)")
    add_key_type(inspect, when="with --key: ")
    inspect.add_argument(
        "--agent",
        default=None,
        help="package.module:Class or path/file.py:Class that wrote the state: its module is "
        "loaded (as `ratchet run` loads it, nothing runs) so the types it registers decode",
    )
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=cmd_inspect)

    from ratchet.cli import _deadletters, _signals, _trace, _upgrade

    _upgrade.register(sub)
    _signals.register(sub)
    _deadletters.register(sub)
    _trace.register(sub)


def _config(args: argparse.Namespace) -> Any:
    from ratchet.runtime._engine import EngineConfig

    if args.checkpoint_interval < 0:
        raise ConfigError(
            f"--checkpoint-interval must be >= 0 milliseconds, not {args.checkpoint_interval:g}"
        )
    return EngineConfig(
        checkpoint_interval=args.checkpoint_interval / 1000.0,
        max_concurrent_runs=args.max_concurrent_runs,
        max_buffered_inputs=args.max_buffered_inputs,
        max_tasks_per_run=args.max_tasks_per_run,
        tolerable_checkpoint_failures=args.tolerable_checkpoint_failures,
        sync_workers=args.sync_workers,
        synchronous=args.synchronous.upper(),
        on_bad_input=args.on_bad_input,
        max_errors=args.max_errors,
        trace_retention=args.trace_retention,
        otel_endpoint=args.otel_endpoint,
    )


def _summary(result: Any) -> dict[str, Any]:
    return {
        "inputs": result.inputs,
        "runs_completed": result.runs_completed,
        "outputs": result.outputs,
        "tasks_executed": result.tasks_executed,
        "tasks_replayed": result.tasks_replayed,
        "restored_runs": result.restored_runs,
        "runs_failed": result.runs_failed,
        "dead_letters": result.dead_letters,
        "redriven": result.redriven,
        "restored_from_checkpoint": (result.restored_from or {}).get("id"),
        "bad_inputs": result.bad_inputs,
        "stopped_by": result.stopped_by,
        "checkpoints": result.checkpoints,
        # ctx.metrics counters and ratchet's own (durable_calls.made / .replayed, ...) of this
        # process: an unsupervised run had no way to show them.
        "metrics": result.metrics,
    }


def _workers_arg(text: str) -> int | str:
    """`--workers`: a number, or `auto` (resolved when the command runs)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of workers: give N >= 1, or auto"
        ) from None


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The same `ratchet run`, without supervision: what the supervisor starts as its worker.

    Derived from the `run` parser's own actions, so every option a user passed reaches the
    worker, including ones added after this was written.
    """
    assert _RUN_PARSER is not None, "register() builds the run parser first"
    argv = [sys.executable, "-m", "ratchet.cli"]
    if getattr(args, "verbose", False):
        argv.append("-v")
    if getattr(args, "log_format", "text") != "text":
        argv += ["--log-format", args.log_format]
    argv.append("run")
    positionals: list[str] = []
    for action in _RUN_PARSER._actions:
        if action.dest in _SUPERVISION_DESTS or action.dest == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        value = getattr(args, action.dest)
        if not action.option_strings:
            positionals.append(str(value))
        elif isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            if value != action.default:
                argv.append(action.option_strings[-1])
        elif value is not None:
            argv += [
                action.option_strings[-1],
                repr(value) if isinstance(value, float) else str(value),
            ]
    return argv + ["--", *positionals]


def _supervise(args: argparse.Namespace) -> int:
    from ratchet.agents._run import load_agent
    from ratchet.cli import end_startup
    from ratchet.runtime._supervisor import Supervisor

    load_agent(args.agent)  # a bad agent spec fails here, once, not in every worker
    _config(args)
    sup = Supervisor(
        _worker_argv(args),
        args.state,
        restart_attempts=args.restart_attempts,
        restart_delay=args.restart_delay,
        restart_reset_after=args.restart_reset_after,
        rest_host=args.rest_host,
        rest_port=args.rest_port,
        rest_token=args.rest_token,
        log_format=args.log_format,
    )
    end_startup()  # the supervisor's own: its worker is a `ratchet run` with a start-up of its own
    return sup.run()


def _die_with_supervisor() -> None:
    """A worker whose supervisor was killed must not run on unsupervised: on Linux the kernel
    sends it SIGTERM (a clean stop with a final checkpoint) when the supervisor dies."""
    import ctypes
    import os
    import signal

    from ratchet.runtime._supervisor_env import SUPERVISOR_PID_ENV

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return  # not Linux: the broken status pipe still stops the worker at its next report
    expected = os.environ.get(SUPERVISOR_PID_ENV)
    if expected and os.getppid() != int(expected):
        os.kill(os.getpid(), signal.SIGTERM)  # the supervisor died before prctl took effect


def _status_reporter(args: argparse.Namespace) -> Any:
    """In a supervised worker: one JSON line per restore/checkpoint to the supervisor's pipe."""
    import os

    from ratchet.runtime._supervisor_env import RESOURCE_ID_ENV, STATUS_FD_ENV

    fd = os.environ.get(STATUS_FD_ENV)
    if not fd:
        return None
    _die_with_supervisor()
    pipe = os.fdopen(int(fd), "w", encoding="utf-8", buffering=1)
    resource_id = os.environ.get(RESOURCE_ID_ENV)

    def report(engine: Any) -> None:
        line = {
            "pid": os.getpid(),
            "resource_id": resource_id,
            "checkpoints": engine.stats.as_dict(),
            "config": engine.config.as_dict(),
            "status": engine.status(),
        }
        try:
            pipe.write(json.dumps(line, default=str) + "\n")
        except BrokenPipeError:
            engine.request_stop("the supervisor is gone")

    return report


def _job_reporter(args: argparse.Namespace) -> Any:
    """In a supervised sharded job's coordinator: the whole job's status (its workers' reports
    merged) as one JSON line to the supervisor's pipe, shaped as one engine's report."""
    import os

    from ratchet.runtime._supervisor_env import RESOURCE_ID_ENV, STATUS_FD_ENV

    fd = os.environ.get(STATUS_FD_ENV)
    if not fd or args.workers == 1:
        return None
    _die_with_supervisor()
    pipe = os.fdopen(int(fd), "w", encoding="utf-8", buffering=1)
    head = {
        "pid": os.getpid(),
        "resource_id": os.environ.get(RESOURCE_ID_ENV),
        "config": _config(args).as_dict(),
    }

    def report(merged: dict[str, Any]) -> None:
        try:
            pipe.write(json.dumps(dict(merged, **head), default=str) + "\n")
        except BrokenPipeError:
            pass  # the supervisor is gone; its death signal stops this job cleanly

    return report


def cmd_run(args: argparse.Namespace) -> int:
    from ratchet.connectors import is_uri
    from ratchet.runtime._io import (
        check_input_path,
        check_output_path,
        refuse_output_read_as_input,
    )
    from ratchet.runtime._otel import check_endpoint

    # Refused before anything is created (the supervisor creates the state directory).
    if not is_uri(args.output):
        check_output_path(args.output)
    if args.input is not None and not is_uri(args.input):
        check_input_path(args.input)
        refuse_output_read_as_input(args.input, args.output)
    check_endpoint(args.otel_endpoint)  # or the OTEL_EXPORTER_OTLP_* variables
    import logging

    from ratchet.runtime._say import say

    course = logging.getLogger("ratchet.cli.course")  # its own lines (a savepoint, auto)

    if args.from_savepoint is not None:
        from pathlib import Path

        from ratchet.runtime._savepoints import restore_or_resume

        # The same command again resumes the state its first run restored (killed, or refused
        # after the restore): restoring anew would repeat the work done since.
        restored = restore_or_resume(Path(args.from_savepoint), Path(args.state))
        say(
            course,
            (
                f"{args.state} already holds savepoint {args.from_savepoint}, restored by an "
                f"earlier run: resuming it (not restored again; a new --state restores anew)"
            )
            if restored["resumed"]
            else f"restored savepoint {args.from_savepoint} into {args.state}",
            getattr(args, "log_format", "text"),
        )
    if args.workers == "auto":
        from ratchet.runtime._auto_workers import auto_workers

        args.workers, why = auto_workers(args.state, args.input, args.follow)
        say(course, f"--workers auto: {args.workers} ({why})", getattr(args, "log_format", "text"))
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1 or auto, not {args.workers}")
    if args.workers > 1:
        from ratchet.agents._sharded import refuse_too_many

        refuse_too_many(args.workers)  # before a supervisor starts (its worker would refuse)
    if args.supervise:
        if args.rest_port is not None:
            from ratchet.runtime._supervisor import require_rest_server

            require_rest_server()
        return _supervise(args)  # its worker is this `ratchet run`, with --workers N if given
    for dest, (flag, default) in _SUPERVISOR_ONLY.items():
        if getattr(args, dest, default) != default:  # a worker's command line never has one
            raise ConfigError(
                f"{flag} is an option of a supervised job (with the REST API it serves); add "
                f"--supervise (or drop {flag})"
            )
    try:
        return _run_here(args)
    except StateInUseError as exc:
        _tell_supervisor(exc)
        raise
    except ServerUnreachableError as exc:
        if _tell_supervisor(exc):
            raise  # the supervisor says that it waits, and for how long
        raise ServerUnreachableError(
            f"{exc}; with --supervise, ratchet waits for {exc.server} at {exc.address} and retries",
            server=exc.server,
            address=exc.address,
        ) from exc


def _tell_supervisor(exc: StateInUseError | ServerUnreachableError) -> bool:
    """A supervised worker refused for a reason that passes says so on its status pipe before
    it exits 2, so its supervisor restarts it (within the restart policy) instead of giving up
    as on a state or a setting that is wrong: the state's lock held by another process for a
    moment, or a connector's server that cannot be reached yet (down, restarting). Whether
    this process is a supervised worker."""
    import os

    from ratchet.runtime._supervisor_env import (
        REFUSED_STATE_IN_USE,
        REFUSED_UNREACHABLE,
        STATUS_FD_ENV,
    )

    fd = os.environ.get(STATUS_FD_ENV)
    if not fd:
        return False
    said = (
        {REFUSED_STATE_IN_USE: exc.holder}
        if isinstance(exc, StateInUseError)
        else {REFUSED_UNREACHABLE: f"{exc.server} at {exc.address}"}
    )
    try:
        os.write(int(fd), (json.dumps(said) + "\n").encode())
    except OSError:  # the supervisor is gone: nobody to tell
        pass
    return True


def _run_here(args: argparse.Namespace) -> int:
    """`ratchet run` in this process (a supervised job's worker, or an unsupervised job)."""
    from ratchet.agents._run import Job, load_agent, run_owned
    from ratchet.cli import end_startup
    from ratchet.runtime._engine import stopped_for_max_errors
    from ratchet.runtime._shards import is_sharded

    if args.workers != 1 or is_sharded(args.state):
        return _run_sharded(args)
    agent = load_agent(args.agent)
    config = _config(args)
    tty = sys.stderr.isatty()
    live = None
    on_progress = _status_reporter(args)
    if tty:
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        live = Live(console=console, refresh_per_second=4, transient=False)
        started = SYSTEM_CLOCK.monotonic()

        reporter = on_progress

        def on_progress(engine: Any) -> None:
            if reporter is not None:
                reporter(engine)
            s = engine.status()
            cp = s["checkpoints"]["counts"]
            rate = s["runs_completed"] / max(SYSTEM_CLOCK.monotonic() - started, 1e-6)
            live.update(
                f"[bold]ratchet[/] {args.agent}: inputs {s['inputs']}  done {s['runs_completed']} "
                f"({rate:,.0f}/s)  in flight {s['in_flight_runs']}  checkpoints {cp['completed']} "
                f"(failed {cp['failed']})"
            )

    job = Job(
        agent,
        inputs=args.input,
        output=args.output,
        state_dir=args.state,
        key=args.key,
        follow=args.follow,
        config=config,
        on_progress=on_progress,
        append_output=args.append_output,
    )
    code = 0
    end_startup()
    try:
        if live is not None:
            live.start()
        result = run_owned(job, handle_signals=True)
    except BadInputError as exc:
        print(f"ratchet: bad input: {exc}", file=sys.stderr)
        if args.json:  # what the job did before it stopped
            print(json.dumps(dict(_summary(job.engine.result), error=str(exc)), indent=2))
        return EXIT_BAD_INPUT
    except RatchetError as exc:
        if args.json:  # what the job did before it stopped; main() prints the error
            print(json.dumps(dict(_summary(job.engine.result), error=str(exc)), indent=2))
        raise
    finally:
        if live is not None:
            live.stop()
    summary = _summary(result)
    if result.runs_failed and (
        stopped_for_max_errors(result.stopped_by) or not (args.follow or args.allow_errors)
    ):
        code = EXIT_ERRORS
        print(_errors_line(result, args.state), file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    elif tty:
        print(_done_line(summary), file=sys.stderr)
    _say_parked(result, args)
    return code


def _say_parked(result: Any, args: argparse.Namespace) -> None:
    """The line of a bounded job that ended with runs parked on signals (one process or N)."""
    from ratchet.runtime._engine import runs_waiting_for_signals

    if runs_waiting_for_signals(result.stopped_by) and not args.json:
        print(
            f"ratchet: {result.stopped_by}; they stay parked in {args.state} and go on when the "
            f"job next runs after their signal is sent (`ratchet status --state {args.state}` "
            f"lists them; `ratchet signal --state {args.state} --key KEY NAME --value JSON`)",
            file=sys.stderr,
        )


def _run_sharded(args: argparse.Namespace) -> int:
    """`run --workers N` (or any N on a state sharded before): a coordinator and N workers."""
    from ratchet.agents._sharded import run_sharded
    from ratchet.cli import end_startup
    from ratchet.runtime._engine import stopped_for_max_errors

    end_startup()  # before the coordinator forks its workers (they freeze what they inherit)
    on_report = _job_reporter(args)
    live = None
    if sys.stderr.isatty():  # the same progress line as one worker's, from the shards' reports
        from rich.console import Console
        from rich.live import Live

        live = Live(console=Console(stderr=True), refresh_per_second=4, transient=False)
        started = SYSTEM_CLOCK.monotonic()
        supervisor_report = on_report

        def on_report(merged: dict[str, Any]) -> None:
            if supervisor_report is not None:
                supervisor_report(merged)
            s, cp = merged["status"], merged["checkpoints"]["counts"]
            rate = s["runs_completed"] / max(SYSTEM_CLOCK.monotonic() - started, 1e-6)
            live.update(
                f"[bold]ratchet[/] {args.agent} ({len(merged['shards'])} workers): inputs "
                f"{s['inputs']}  done {s['runs_completed']} ({rate:,.0f}/s)  in flight "
                f"{s['in_flight_runs']}  checkpoints {cp['completed']} (failed {cp['failed']})"
            )

        live.start()
    try:
        result = run_sharded(
            args.agent,
            inputs=args.input,
            output=args.output,
            state_dir=args.state,
            workers=args.workers,
            key=args.key,
            follow=args.follow,
            config=_config(args),
            append_output=args.append_output,
            handle_signals=True,
            # One of the two reports to a supervisor (they share its pipe): the engine's with
            # one worker, the whole job's from the coordinator with more.
            on_progress=_status_reporter(args) if args.workers == 1 else None,
            on_report=on_report,
        )
    except BadInputError as exc:
        print(f"ratchet: bad input: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        if live is not None:
            live.stop()
    summary = _summary(result)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    elif live is not None:
        print(_done_line(summary), file=sys.stderr)
    if result.runs_failed and (
        stopped_for_max_errors(result.stopped_by) or not (args.follow or args.allow_errors)
    ):
        print(_errors_line(result, args.state), file=sys.stderr)
        _say_parked(result, args)
        return EXIT_ERRORS
    _say_parked(result, args)
    return EXIT_OK


def _done_line(summary: dict[str, Any]) -> str:
    """The last line a job prints on a terminal."""
    restored = summary["restored_from_checkpoint"]
    return (
        f"done: {summary['runs_completed']} runs, {summary['outputs']} outputs, "
        f"{summary['tasks_executed']} tasks executed, {summary['tasks_replayed']} replayed "
        f"from the journal" + (f", restored from checkpoint {restored}" if restored else "")
    )


def _errors_line(result: Any, state: str) -> str:
    """The end line of a job whose runs ended in error, the same for one worker and N."""
    return (
        f"ratchet: {result.runs_failed} run(s) ended in error ({result.stopped_by}); their "
        f"inputs are dead letters (`ratchet dead-letters --state {state}`, `ratchet "
        f"redrive`); exit {EXIT_ERRORS} (--allow-errors to exit 0)"
    )


def cmd_status(args: argparse.Namespace) -> int:
    from ratchet.store._sqlite import SqliteStore

    # An empty value chose its way and named nothing: tested as `if args.url:` it fell through
    # to the state, which is None then (a TypeError traceback).
    for flag, value, example in (
        ("--state", args.state, "--state DIR, the job's state directory"),
        ("--url", args.url, "--url http://127.0.0.1:8765, the job's REST address"),
        ("--jobmanager", args.jobmanager, "--jobmanager HOST:PORT, the JobManager's REST port"),
    ):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag} is empty: give {example}")
    if args.url:
        return _status_url(args)
    if args.jobmanager:
        from ratchet.cli import _flink_ops

        return _flink_ops.cmd_status(args)
    if args.job:
        print("ratchet: --job goes with --jobmanager (a Flink job id)", file=sys.stderr)
        return EXIT_USAGE
    from ratchet.runtime._shards import is_sharded, sharded_summary

    if is_sharded(args.state):
        summary = sharded_summary(args.state)
    else:
        store = SqliteStore.open_readonly(args.state)
        try:
            summary = store.summary()
        finally:
            store.close()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    cp = summary["checkpoints"]
    table = Table(title=f"ratchet state {args.state}", show_header=False)
    table.add_row("agent", str(summary["agent"]))
    counts = cp["counts"]
    table.add_row(
        "checkpoints",
        f"completed {counts['completed']}, failed {counts['failed']}, restored {counts['restored']}",
    )
    latest = cp["latest_completed"]
    if latest:
        table.add_row(
            "latest completed",
            f"#{latest['id']} at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(latest['trigger_timestamp']))}, "
            f"{latest['duration_ms']:.1f} ms, {latest['size_bytes']} bytes",
        )
    restored = cp["latest_restored"]
    table.add_row("latest restored", f"#{restored['id']}" if restored else "-")
    table.add_row("keys", str(summary["keys"]))
    table.add_row("in-flight runs", str(summary["in_flight_runs"]))
    table.add_row("queued inputs", str(summary["queued_inputs"]))
    table.add_row("unreleased outputs", str(summary["unreleased_outputs"]))
    table.add_row("memory version", str(summary["memory_version"]))
    if summary["runs_on_earlier_versions"]:
        table.add_row(
            "runs on earlier versions",
            f"{summary['runs_on_earlier_versions']} (finishing as they started; `ratchet runs "
            f"list`)",
        )
    if summary["dead_letters"]:
        table.add_row(
            "dead letters",
            f"{summary['dead_letters']} ({summary['runs_failed']} runs that ended in error; "
            f"`ratchet dead-letters`)",
        )
    if summary["waiting"]:
        table.add_row(
            "waiting",
            "\n".join(
                f"key {w['key']} input {w['seq']}: {w['on']}"
                + (f" since {_when(w['since'])}" if w.get("since") else "")
                + (f" until {_when(w['until'])}" if w.get("until") else "")
                for w in summary["waiting"][:20]
            )
            + (
                f"\n... {len(summary['waiting']) - 20} more" if len(summary["waiting"]) > 20 else ""
            ),
        )
    for p in summary["paused"]:
        table.add_row(
            "paused",
            f"{p['resource']} unavailable since {_when(p['since'])}, next probe at "
            f"{_when(p['next_probe'])} ({p['error']}); no new input is admitted meanwhile",
        )
    if summary["pending_signals"]:
        table.add_row(
            "signals not taken yet",
            ", ".join(f"{p['name']} for {p['key']}" for p in summary["pending_signals"][:20]),
        )
    if "workers" in summary:
        table.add_row(
            "shards",
            f"{summary['workers']} (counts above are their sums; source: next input per shard)",
        )
    table.add_row("source", json.dumps(summary["source"]))
    Console().print(table)
    return EXIT_OK


def _when(ts: float) -> str:
    """A time as status shows it; one past what the platform's clock can show (a wait's
    deadline of `ctx.sleep(1e300)` or a timeout of sys.maxsize) as how far off it is, not a
    traceback (OverflowError, OSError)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        years = (ts - SYSTEM_CLOCK.now()) / (365.25 * 86400)
        return f"far in the future (in {years:.3g} years)" if years > 0 else "long ago"


def _key_forms(text: str) -> dict[str, bytes]:
    """The stored (encoded) keys a key's text names: the string key, and the integer key of
    a text like "1"."""
    from ratchet.runtime._shards import int_text
    from ratchet.store import codec

    forms = {"str": codec.encode(text)}
    if int_text(text):
        forms["int"] = codec.encode(int(text))
    return forms


def _flink_memory_rows(directory: str, only: str | None) -> list[tuple[bytes, bytes]]:
    """A Flink job's memory output as the (key, memory) rows a state's `memories` gives."""
    import os

    from ratchet.runtime._flink_files import latest_memory_records
    from ratchet.store import codec

    if not os.path.isdir(directory):
        raise ConfigError(
            f"--flink-memory {directory}: no such folder (give the job's --memory-output folder)"
        )
    try:
        found = latest_memory_records(directory)
    except ConfigError as exc:
        raise ConfigError(f"--flink-memory {exc}") from None
    if not found:  # a savepoint's folder, say: its files are hidden (`_metadata`)
        raise ConfigError(
            f"--flink-memory {directory} holds no memory records: only the folder a job's "
            "--memory-output names can be read (its records are committed at checkpoints)"
        )
    rows = []
    for key, raw in found.items():
        if only is None or str(key) == only:
            rows.append((codec.encode(key), raw))
    return rows


def cmd_inspect(args: argparse.Namespace) -> int:
    """Show committed short-term memory; a value of a type this process has not registered is
    shown in a generic form (its stored name and fields), never an error.

    ratchet's own registered types (the chat layer's `TokenUsage`, `ChatMessage`, ...) always
    decode; `--agent` loads the user's module so the types it registers decode too.
    """
    from pathlib import Path

    import ratchet.agents.chat  # noqa: F401 - registers ratchet's chat types; no provider SDK
    from ratchet._errors import StateError
    from ratchet._state_api import DAMAGED_FIX, _shown, memory_key_type, undecodable_memory
    from ratchet.agents._memory import nested
    from ratchet.runtime._memops import from_wire
    from ratchet.store import codec
    from ratchet.store._sqlite import DB_NAME, SqliteStore

    refuse_key_type_without_key(args.key_type, args.key)
    loaded_agent = None
    if args.agent is not None:
        from ratchet.agents._run import load_agent

        agent = load_agent(args.agent)  # imports the module: its register_type() calls run
        loaded_agent = f"{type(agent).__module__}.{type(agent).__qualname__}"
    from ratchet.runtime._shards import state_dirs

    rows: list[tuple[bytes, bytes, Path]] = []  # key, memory, and the file they are from
    owner = None
    held: set[str] = set()  # with --key: the types of the keys of its text the state holds
    forms = {} if args.key is None else _key_forms(args.key)
    if args.flink_memory is not None:
        where = Path(args.flink_memory)
        rows = [(k, m, where) for k, m in _flink_memory_rows(args.flink_memory, args.key)]
        held = {kind for kind, blob in forms.items() if any(k == blob for k, _m, _w in rows)}
    for sdir in state_dirs(args.state) if args.state is not None else []:
        # every shard of a sharded job: a key is in one (the string key "1" and the
        # integer key 1 may be in two)
        store = SqliteStore.open_readonly(sdir)
        try:
            rows += [(k, m, Path(sdir) / DB_NAME) for k, m in store.memories(args.key)]
            owner = store.meta("agent_name") if loaded_agent is not None else None
            if args.key is not None:
                held |= store.held_key_types(args.key)
        finally:
            store.close()
    what = f"key {args.key!r}"
    others = 0  # rows of the other key of --key's text, not shown
    if args.key is not None:
        # One key: the integer key 1 and the string key "1" are two (both were shown as the
        # one asked for); a state holding both is refused until --key-type says which.
        typed = memory_key_type(
            args.key, args.key_type, lambda: held, args.state or args.flink_memory
        )
        if typed is not None:
            kept = [r for r in rows if r[0] == forms[typed]]
            others, rows, what = len(rows) - len(kept), kept, f"the {typed} {what}"
    if owner is not None and owner != loaded_agent:
        print(
            f"ratchet: note: --agent {args.agent} is {loaded_agent}, but {args.state} was "
            f"written by {owner}; types only that agent's modules register are shown generically",
            file=sys.stderr,
        )
    if args.key is not None and not rows:
        # Asking for a key that is not there is a usage error (exit 2), not failed work (1).
        source = (
            f"--state {args.state}"
            if args.state is not None
            else f"--flink-memory {args.flink_memory}"
        )
        raise ConfigError(
            f"no committed memory for {what} in {source.split(' ', 1)[1]} (a key whose "
            f"first run is still in flight has none yet); `ratchet inspect {source}` lists the "
            f"keys that have"
        )
    # A row that does not decode is reported after the others are shown, not instead of
    # them: one damaged key must not hide a state's every other key.
    decoded: list[tuple[Any, Any]] = []
    damaged: list[tuple[str, Path, Exception]] = []
    for k, m, where in rows:
        try:
            key = codec.decode(k, unknown="generic")
        except (RatchetError, TypeError, KeyError, ValueError) as exc:
            damaged.append(("(a key whose stored name cannot be decoded either)", where, exc))
            continue
        try:
            decoded.append((key, nested(from_wire(codec.decode(m, unknown="generic")))))
        except (RatchetError, TypeError, KeyError, ValueError) as exc:
            damaged.append((str(key), where, exc))
    decoded.sort(key=lambda r: str(r[0]))
    # A key left out by --key-type still counts: each key is labelled as the whole list
    # labels it ("1 (int)" beside the string key "1").
    texts: dict[str, int] = {args.key: others} if others else {}
    for k, _m in decoded:
        texts[str(k)] = texts.get(str(k), 0) + 1

    def label(k: Any) -> str:
        """A key as text; a key that is not a string and reads as another key does (the
        integer 1 beside the string "1") says its type, so neither hides the other."""
        text = str(k)
        return text if type(k) is str or texts[text] == 1 else f"{text} ({type(k).__name__})"

    memories = {label(k): memory for k, memory in decoded}

    def report_damaged() -> int:
        if not damaged:
            return EXIT_OK
        key, where, exc = damaged[0]
        if not memories and len(damaged) == 1:
            raise undecodable_memory(where, key, exc) from exc
        files = ", ".join(sorted({str(w) for _k, w, _e in damaged}))
        if len(damaged) == 1:
            what = f"the memory of key {key!r} cannot be decoded ({exc})"
        else:
            names = ", ".join(repr(k) for k, _w, _e in damaged[:10])
            more = f" and {len(damaged) - 10} more" if len(damaged) > 10 else ""
            what = (
                f"the memory of {len(damaged)} keys cannot be decoded ({names}{more}; the "
                f"first: {exc})"
            )
        shown_too = "the other keys are shown above; " if memories else ""
        raise StateError(f"{files}: {what}; {shown_too}{DAMAGED_FIX}") from exc

    unregistered: set[str] = set()

    class Unregistered:
        """A stand-in as rich shows it: `stored.Name(field=..., ...)` (a class per name)."""

        def __init__(self, state: Any) -> None:
            self.state = state

        def __rich_repr__(self) -> Any:
            state = self.state
            if type(state) is dict and all(type(k) is str and k.isidentifier() for k in state):
                yield from state.items()
            else:
                yield (state,)

        def __repr__(self) -> str:
            return f"{type(self).__name__}({self.state!r})"

    shown_as: dict[str, type[Unregistered]] = {}

    def shown(value: Any) -> Any:
        """`value` with every stand-in as an Unregistered, which rich shows by its fields."""
        t = type(value)
        if t is codec.UnknownValue:
            unregistered.add(value.type_name)
            cls = shown_as.get(value.type_name)
            if cls is None:
                name = value.type_name.replace("\0", "?")
                cls = shown_as[value.type_name] = type(name, (Unregistered,), {})
            return cls(shown(value.state))
        if t is dict:
            return {shown(k): shown(v) for k, v in value.items()}
        if t is list or t is tuple or t is set or t is frozenset:
            return t(shown(v) for v in value)
        return value

    def note_unregistered() -> None:
        if not unregistered:
            return
        fix = (
            f"register them when {args.agent}'s module is imported (not inside an action)"
            if args.agent is not None
            else "pass --agent with the agent that wrote the state to load the module that "
            "registers them"
        )
        print(
            f"ratchet: note: {len(unregistered)} type(s) in this state are not registered in "
            f"this process and are shown generically ({', '.join(sorted(unregistered))}); {fix}",
            file=sys.stderr,
        )

    if not memories:  # every row asked for is damaged: the error alone
        return report_damaged()
    if args.json:
        print(to_json_text(_shown(memories, True, unregistered)))
        note_unregistered()
        return report_damaged()
    from rich.console import Console
    from rich.markup import escape
    from rich.pretty import Pretty

    console = Console()
    for key, memory in memories.items():
        console.print(f"[bold]{escape(key)}[/]", Pretty(shown(memory)))
    note_unregistered()
    return report_damaged()


def _get(url: str, model: Any, timeout: float = 5.0, token: str | None = None) -> Any:
    """One bounded GET; anything but a well-formed answer is an error, never a default."""
    import urllib.error
    import urllib.request

    from pydantic import ValidationError

    from ratchet._errors import ConfigError

    try:
        request = urllib.request.Request(url)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise ConfigError(
                f"GET {url}: 401, the job's API wants its token: set RATCHET_REST_TOKEN (or "
                f"pass --rest-token) to the token the job was started with"
            ) from exc
        raise ConfigError(f"GET {url} failed: {exc}") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise ConfigError(f"GET {url} failed: {exc}") from exc
    except ValueError as exc:  # not a URL urllib can take: "notaurl", "http://[bad"
        raise ConfigError(
            f"{url!r} is not a URL a job's API answers at ({exc}); give its address as "
            "http://HOST:PORT, as the job printed it"
        ) from exc
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise ConfigError(f"GET {url} returned an unexpected body: {exc}") from exc


def _status_url(args: argparse.Namespace) -> int:
    import os

    from ratchet.runtime._rest import CheckpointStatistics, JobConfig, JobInfo
    from ratchet.runtime._supervisor_env import REST_TOKEN_ENV, check_token

    # The supervisor prints its API as http://HOST:PORT/v1/job: take that form as well as
    # the base address (it asked .../v1/job/v1/job, a 404).
    base = args.url.rstrip("/").removesuffix("/v1/job").rstrip("/")
    token = args.rest_token or os.environ.get(REST_TOKEN_ENV)
    if token:
        check_token(token)
    job = _get(f"{base}/v1/job", JobInfo, token=token)
    checkpoints = _get(f"{base}/v1/job/checkpoints", CheckpointStatistics, token=token)
    config = _get(f"{base}/v1/job/config", JobConfig, token=token)
    if args.json:
        print(
            json.dumps(
                {
                    "job": job.model_dump(),
                    "checkpoints": checkpoints.model_dump(),
                    "config": config.model_dump(),
                },
                indent=2,
            )
        )
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ratchet job at {base}", show_header=False)
    table.add_row("state", job.state)
    table.add_row("worker", f"pid {job.worker_pid}, resource {job.resource_id}")
    table.add_row(
        "restarts",
        f"{job.restarts} in all"
        + (
            f", {job.restarts_counted} of {config.restart_strategy.attempts} counted now"
            if job.restarts_counted is not None
            else ""
        ),
    )
    table.add_row("last exit", job.last_exit or "-")
    table.add_row("uptime", f"{job.uptime_seconds:.1f} s")
    # The rows `status --state` has, as of the worker's last report (None: none yet).
    unknown = "- (no worker report yet)"
    in_flight, queued = job.in_flight_runs, job.queued_inputs
    table.add_row("in-flight runs", unknown if in_flight is None else str(in_flight))
    table.add_row("queued inputs", unknown if queued is None else str(queued))
    waiting = job.waiting or []
    if waiting:
        table.add_row(
            "waiting",
            "\n".join(
                f"key {w.key} input {w.seq}: {w.on}"
                + (f" since {_when(w.since)}" if w.since else "")
                + (f" until {_when(w.until)}" if w.until else "")
                for w in waiting[:20]
            )
            + (f"\n... {len(waiting) - 20} more" if len(waiting) > 20 else ""),
        )
    for p in job.paused or []:
        table.add_row(
            "paused",
            f"{p.resource} unavailable since {_when(p.since)}, next probe at "
            f"{_when(p.next_probe)} ({p.error}); no new input is admitted meanwhile",
        )
    for shard in job.shards or []:
        table.add_row(
            f"shard {shard.shard}",
            f"pid {shard.pid}, restarts {shard.restarts}, in flight "
            f"{'-' if shard.in_flight_runs is None else shard.in_flight_runs}, queued "
            f"{'-' if shard.queued_inputs is None else shard.queued_inputs}",
        )
    c = checkpoints.counts
    table.add_row(
        "checkpoints",
        f"completed {c.completed}, failed {c.failed}, in progress {c.in_progress}, restored {c.restored}",
    )
    latest = checkpoints.latest
    if latest.completed:
        table.add_row(
            "latest completed",
            f"#{latest.completed.id}, {latest.completed.duration_ms:.1f} ms, {latest.completed.size_bytes} bytes",
        )
    table.add_row("latest restored", f"#{latest.restored.id}" if latest.restored else "-")
    table.add_row("checkpoint interval", f"{config.checkpoint_interval_ms:g} ms")
    rs = config.restart_strategy
    strategy = f"{rs.type}, {rs.attempts} attempts, {rs.delay_seconds:g} s delay"
    if rs.unreachable_max_delay_seconds is not None:  # None: an older supervisor's answer
        strategy += (
            f" (doubling up to {rs.unreachable_max_delay_seconds:g} s while a server cannot be "
            f"reached)"
        )
    if rs.reset_after_seconds is not None:
        strategy += (
            f", the count starts again after {rs.reset_after_seconds:g} s of running"
            if rs.reset_after_seconds > 0
            else ", the count never starts again"
        )
    table.add_row("restart strategy", strategy)
    Console().print(table)
    return EXIT_OK
