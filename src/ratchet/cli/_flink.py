"""`ratchet flink run`: an agent as a PyFlink job (local mini-cluster or a running cluster).

PyFlink is imported only when the command runs, so `ratchet` works without the extra.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK
from ratchet._errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_USAGE


def register(sub: Any) -> argparse.ArgumentParser:
    """Add the `flink` command group to the top-level subparsers; `func` returns the exit code."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "flink", help="run agents on Apache Flink (needs ratchet[flink])", description=__doc__
    )
    group = parser.add_subparsers(dest="flink_command", required=True, metavar="COMMAND")
    run = group.add_parser("run", help="run an agent over a JSONL file/folder as a Flink job")
    run.add_argument("agent", help="package.module:Class or path/file.py:Class")
    run.add_argument("--input", required=True, help="JSON Lines file or folder of them")
    run.add_argument(
        "--output", required=True, help="folder for the output part files (exactly once)"
    )
    run.add_argument(
        "--jobmanager", default=None, metavar="HOST:PORT", help="REST endpoint of a cluster"
    )
    run.add_argument("--key", default="key", help="input field that holds the key (default: key)")
    run.add_argument("--checkpoint-interval", type=int, default=1000, metavar="MS")
    run.add_argument("--checkpoint-dir", default=None, help="checkpoint storage (path or URI)")
    run.add_argument("--parallelism", type=int, default=1)
    run.add_argument("--state-backend", choices=["rocksdb", "hashmap"], default="rocksdb")
    run.add_argument(
        "--restart-strategy",
        choices=["fixed-delay", "exponential-delay", "none"],
        default="fixed-delay",
    )
    run.add_argument("--restart-attempts", type=int, default=10)
    run.add_argument("--restart-delay", type=int, default=1000, metavar="MS")
    run.add_argument("--aligned-checkpoints", action="store_true", help="disable unaligned ones")
    run.add_argument("--bundle-size", type=int, default=100, help="python.fn-execution.bundle.size")
    run.add_argument("--bundle-time", type=int, default=10, metavar="MS")
    run.add_argument(
        "--execution-mode",
        choices=["process", "thread"],
        default=None,
        help="where the Python code runs: in the TaskManager's JVM (thread, Pemja: faster "
        "per record) or in separate Python worker processes (process). Default: "
        "$RATCHET_FLINK_EXECUTION_MODE, else the mode --from-savepoint was taken in, else "
        "thread on the local mini-cluster and process with --jobmanager (thread mode on a "
        "cluster needs its classpath settings: docs/flink.md)",
    )
    run.add_argument("--max-concurrent-tasks", type=int, default=64, help="per subtask")
    run.add_argument(
        "--max-concurrent-runs",
        type=int,
        default=None,
        metavar="N",
        help="keys with a run in flight, per subtask (default: no limit)",
    )
    run.add_argument(
        "--on-bad-input",
        choices=["stop", "skip", "dead-letter"],
        default="stop",
        help="a bad line: refuse the input (exit 3), skip it, or keep it in OUTPUT/_bad-input",
    )
    run.add_argument("--sync-workers", type=int, default=16, help="threads per subtask")
    run.add_argument(
        "--follow", type=int, default=None, metavar="MS", help="watch the input; unbounded job"
    )
    run.add_argument("--from-savepoint", default=None, metavar="PATH", help="restore from it")
    run.add_argument(
        "--allow-non-restored-state", action="store_true", help="ignore unmatched savepoint state"
    )
    run.add_argument(
        "--memory-output",
        default=None,
        metavar="DIR",
        help="each key's final memory (end of input)",
    )
    run.add_argument(
        "--call-journal",
        default=None,
        metavar="URI",
        help="postgresql://... journal of durable-call results, written before a result returns "
        "(default: $RATCHET_CALL_JOURNAL; none: calls after the last checkpoint may repeat)",
    )
    run.add_argument(
        "--call-journal-namespace",
        default=None,
        metavar="NAME",
        help="this job's records in the journal (default: agent + checkpoint dir or output)",
    )
    run.add_argument(
        "--call-journal-margin",
        type=float,
        default=60.0,
        metavar="S",
        help="prune records of runs completed this long before the latest checkpoint",
    )
    run.add_argument("--tmp-dir", default=None, help="Flink temp files (io.tmp.dirs)")
    run.add_argument("--job-name", default=None)
    run.add_argument("--detach", action="store_true", help="submit, print the job id, exit")
    run.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE", help="any Flink option"
    )
    run.set_defaults(func=cmd_run)
    from ratchet.cli import _flink_ops

    _flink_ops.register(group)
    return parser


def _config(args: argparse.Namespace) -> Any:
    from ratchet.flink import CoreConfig, FlinkConfig

    extra: dict[str, str] = {}
    for item in args.conf:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SystemExit(f"ratchet flink run: --conf {item!r} must be KEY=VALUE")
        extra[k.strip()] = v.strip()
    if args.from_savepoint:
        extra.setdefault("execution.state-recovery.path", args.from_savepoint)
    if args.allow_non_restored_state:
        extra.setdefault("execution.state-recovery.ignore-unclaimed-state", "true")
    if args.call_journal and not args.jobmanager:
        # The local mini-cluster's REST API on a known port: the pruner reads checkpoints there.
        extra.setdefault("rest.port", str(_free_port()))
    return FlinkConfig(
        checkpoint_interval_ms=args.checkpoint_interval,
        state_backend=args.state_backend,
        checkpoint_dir=_checkpoint_dir(args),
        parallelism=args.parallelism,
        restart_strategy=args.restart_strategy,
        restart_attempts=args.restart_attempts,
        restart_delay_ms=args.restart_delay,
        unaligned_checkpoints=not args.aligned_checkpoints,
        bundle_size=args.bundle_size,
        bundle_time_ms=args.bundle_time,
        **({"execution_mode": args.execution_mode} if args.execution_mode else {}),
        tmp_dir=args.tmp_dir,
        core=CoreConfig(
            max_concurrent_tasks=args.max_concurrent_tasks,
            max_concurrent_runs=args.max_concurrent_runs,
            sync_workers=args.sync_workers,
        ),
        extra=extra,
        call_journal=args.call_journal,
        journal_namespace=journal_namespace(args) if args.call_journal else None,
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def journal_namespace(args: argparse.Namespace) -> str:
    """The job's namespace in the call journal: given, or the agent's class and a digest of
    where its checkpoints (else its outputs) live, so that a resumed job finds its records."""
    if args.call_journal_namespace:
        return str(args.call_journal_namespace)
    import hashlib

    where = args.checkpoint_dir or args.output
    if "://" not in where:
        where = os.path.abspath(where)
    cls = args.agent.rpartition(":")[2]
    return f"{cls}@{hashlib.sha256(where.encode()).hexdigest()[:16]}"


def _open_journal(args: argparse.Namespace, config: Any) -> Any:
    """The call journal, checked (reachable, table there); a fresh job (no --from-savepoint)
    starts its namespace empty: no restore of it can need older records."""
    from ratchet.connectors._pg_journal import PostgresCallJournal

    journal = PostgresCallJournal(config.call_journal, config.journal_namespace)
    if not args.from_savepoint:
        journal.clear()
    return journal


def _pruner(args: argparse.Namespace, journal: Any, rest: str, job_id: str) -> Any:
    from ratchet.runtime._journal_prune import JournalPruner

    pruner = JournalPruner(journal, rest, job_id, margin_s=args.call_journal_margin)
    pruner.start()
    return pruner


def execution_mode(args: argparse.Namespace) -> str:
    """The mode the job runs in (see --execution-mode's help). A savepoint's keyed state is laid
    out for the mode it was taken in, and Flink's refusal of the other mode is a page of Java
    stack trace: a mode named for a savepoint of the other mode is refused here instead."""
    from ratchet._errors import ConfigError
    from ratchet.runtime._flink_savepoint import MODE_ENV, savepoint_mode

    named = args.execution_mode or os.environ.get(MODE_ENV) or None
    if args.from_savepoint:
        taken = savepoint_mode(args.from_savepoint)
        if taken is not None and named is not None and named != taken:
            how = "--execution-mode" if args.execution_mode else f"${MODE_ENV}"
            raise ConfigError(
                f"the savepoint {args.from_savepoint} was taken in {taken} mode and cannot be "
                f"restored in {named} mode ({how}): a job's keyed state is laid out for its "
                f"execution mode. Run it with --execution-mode {taken}"
            )
        if taken is not None:
            return taken
    if named is not None:
        return named
    return "process" if args.jobmanager else "thread"


LOCAL_CHECKPOINTS = "_checkpoints"  # under the output folder, hidden from the outputs


def _checkpoint_dir(args: argparse.Namespace) -> str | None:
    """Where the job's checkpoints go: `--checkpoint-dir`; for a local run without it, the
    output folder's `_checkpoints`, so that a run killed with its mini-cluster (kill -9 of this
    command) can be continued from its last retained checkpoint. A cluster job without it
    uses the cluster's own setting."""
    if args.checkpoint_dir or args.jobmanager:
        return args.checkpoint_dir  # type: ignore[no-any-return]
    out = _local_output(args)
    return None if out is None else os.path.join(out, LOCAL_CHECKPOINTS)


def _local_output(args: argparse.Namespace) -> str | None:
    """The output folder as an absolute local path (a `file:` URI's path); None for another
    file system."""
    from ratchet.runtime._flink_savepoint import local_path

    path = local_path(args.output)
    return None if path is None else os.path.abspath(path)


OUTPUT_LOCK = "_lock"  # in a local output folder, held by the run writing into it
_held: list[Any] = []  # the lock of this process's run, held until it exits


def _hold_output(args: argparse.Namespace) -> None:
    """A local run holds its output folder for as long as it runs (the OS lets go when the
    process dies, kill -9 too): a second run into the same folder meanwhile is refused rather
    than writing beside it, or being pointed at the first one's live checkpoints."""
    if args.jobmanager or args.detach:
        return  # the job outlives this command: nothing here could hold the folder for it
    out = _local_output(args)
    if out is None:
        return
    from ratchet._errors import ConfigError
    from ratchet.store._sqlite import StateLock

    def busy(holder: str) -> ConfigError:
        return ConfigError(
            f"--output {args.output} is being written by another ratchet flink run ({holder}); "
            "let it finish or stop it (SIGTERM stops it with a savepoint), or write to another "
            "--output"
        )

    lock = StateLock(Path(out), OUTPUT_LOCK, busy)
    try:
        os.makedirs(out, exist_ok=True)
        lock.acquire()
    except OSError as exc:
        raise ConfigError(
            f"--output {args.output} cannot be used as the output folder ({exc}); name a "
            "folder this user can write"
        ) from None
    _held.append(lock)


def _refuse_earlier_outputs(args: argparse.Namespace) -> None:
    """A new run (no --from-savepoint) into an output folder that holds an earlier run's
    outputs would write them again: refused, naming what continues that run."""
    from ratchet._errors import ConfigError
    from ratchet.runtime._flink_savepoint import (
        earlier_outputs,
        newest_restore_point,
        output_jobs,
        read_marker,
    )

    if args.from_savepoint:
        return
    files = earlier_outputs(args.output)
    if not files:
        return
    # Where this command keeps them, and where it would without --checkpoint-dir (the earlier
    # run may have been given other flags); only the jobs that wrote this folder, if it says.
    where = [_savepoint_target(args), *filter(None, [_checkpoint_dir(args)])]
    out = _local_output(args)
    if out is not None:
        where += [os.path.join(out, "_savepoints"), os.path.join(out, LOCAL_CHECKPOINTS)]
    where = list(dict.fromkeys(where))
    newest = newest_restore_point(where, output_jobs(args.output))
    if newest is None:
        how = (
            "no savepoint or retained checkpoint of it was found in "
            f"{' or '.join(where)} (an earlier run given another --checkpoint-dir keeps them "
            "there): write to another --output, or empty this one to run everything again"
        )
    else:
        marker = read_marker(str(newest))
        if marker is not None and marker.get("drained"):
            how = (
                f"its savepoint {newest} ended that job for good (--memory-output drains it), "
                "so it reads no new input: write to another --output, or empty this one to "
                "run everything again"
            )
        else:
            finished = marker is not None
            how = (
                f"continue it with the same command and --from-savepoint {newest}"
                + ("" if finished else " --follow MS (it stopped before the end of its input)")
                + ", or write to another --output"
            )
    raise ConfigError(
        f"--output {args.output} holds {files} output file(s) of an earlier run, which a new "
        f"run would write again; {how}"
    )


def _restores_to_completion(args: argparse.Namespace) -> bool:
    """Whether this is a local run of a bounded input from a savepoint, which runs to completion
    like a fresh one: its source watches --input, skips the files the savepoint names as read
    and reads the rest. Only a savepoint that ended such a run (its marker says so) names every
    file its job read; from any other one, files read to the end would be read again."""
    if not args.from_savepoint or args.follow is not None or args.jobmanager or args.detach:
        return False
    from ratchet._errors import ConfigError
    from ratchet.runtime._flink_savepoint import MARKER, read_marker

    marker = read_marker(args.from_savepoint)
    if marker is None:
        raise ConfigError(
            f"the savepoint {args.from_savepoint} has no {MARKER}: it was not taken at the end "
            "of a local `ratchet flink run` to completion, so its source state need not name "
            "the files its job read, and a run to completion could read them again. Restore it "
            "with --follow MS (the job keeps watching --input), or where it was taken "
            "(--jobmanager)"
        )
    if marker.get("drained"):
        raise ConfigError(
            f"the savepoint {args.from_savepoint} ended its job for good: that run wrote "
            "--memory-output, which drains the job (the final watermark writes each key's "
            "memory), and Flink restores a drained source as finished, so no new input would be "
            "read. Run a job without --memory-output to continue it later"
        )
    return True


def _warn_unread_inputs(args: argparse.Namespace) -> None:
    """A bounded job restored from a savepoint on a cluster (or detached) reads only the files
    its savepoint was still reading: Flink restores a bounded FileSource from its pending splits
    alone. Files of --input that the savepoint does not name are either read to the end by the
    job that took it or new; new ones would not be read, so say so (not refused: finishing the
    savepoint's own input is what such a restore is for)."""
    if not args.from_savepoint or args.follow is not None or not (args.jobmanager or args.detach):
        return
    from ratchet.runtime._flink_savepoint import unread_inputs

    if not Path(args.input).exists():
        return
    unread = unread_inputs(args.from_savepoint, args.input)
    if unread:
        more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
        print(
            f"ratchet flink: warning: {unread[0]}{more} not named in the savepoint: a bounded "
            "job restored from a savepoint reads only the files its savepoint was still "
            "reading, so a new file there will not be read; pass --follow MS to read new files",
            file=sys.stderr,
        )


def cmd_run(args: argparse.Namespace) -> int:
    try:
        import pyflink  # noqa: F401
    except ImportError:
        print(
            "ratchet flink: PyFlink is not installed; pip install 'ratchet[flink]' "
            "(apache-flink 2.3.0, Python 3.9-3.12)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.max_concurrent_runs is not None and args.max_concurrent_runs < 1:
        print("ratchet flink: --max-concurrent-runs must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    from ratchet.connectors._pg_journal import DSN_ENV

    if args.call_journal is None:
        args.call_journal = os.environ.get(DSN_ENV) or None
    try:
        return _checked_run(args)
    finally:
        _let_go()


def _checked_run(args: argparse.Namespace) -> int:
    """Check what can be checked before a JVM starts (exit 2 with the reason), then run."""
    from ratchet._errors import RatchetError
    from ratchet.agents._run import load_agent

    journal = None
    if args.jobmanager:
        code = _check_jobmanager(args.jobmanager)
        if code != EXIT_OK:
            return code
    try:
        agent = load_agent(args.agent)  # fail here, with a clear message, not in a worker
        args.execution_mode = execution_mode(args)
        _hold_output(args)
        _refuse_earlier_outputs(args)
        restoring = _restores_to_completion(args)
        _warn_unread_inputs(args)
        config = _config(args)
        config.validate()
        from ratchet.flink._function import agent_core

        agent_core(agent, config.core)  # what a worker would refuse, refused here
        if config.call_journal:
            journal = _open_journal(args, config)  # a bad URI or a server down: exit 2 here
    except RatchetError as exc:
        print(f"ratchet flink: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _run(args, config, journal, restoring)
    finally:
        if journal is not None:
            journal.close()


def _check_jobmanager(address: str) -> int:
    """Ask the cluster's REST API before submitting: `flink run -m` to nothing, or to a port
    that is not Flink's, retries for a minute and ends in a Java stack trace."""
    from ratchet.cli._flink_ops import JobManager, JobManagerError

    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        print(
            f"ratchet flink: --jobmanager {address!r} must look like host:port (the "
            "JobManager's REST port)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        JobManager(address, env_hint=False).jobs()
    except JobManagerError as exc:
        print(f"ratchet flink: {exc}", file=sys.stderr)
        return exc.code
    return EXIT_OK


def _let_go() -> None:
    """The output folder is free again once the run is over (a process that dies lets go
    anyway): a caller that runs the command as a function may run it again."""
    while _held:
        _held.pop().release()


def _run(args: argparse.Namespace, config: Any, journal: Any, restoring: bool) -> int:
    from ratchet.flink import build_job, environment
    from ratchet.runtime._flink_savepoint import note_job, unread_inputs

    bad: list[str] = []
    inputs = 0
    if args.follow is None:
        # A bounded input is read here first: a bad line is refused before anything runs
        # (a Flink job keeps no state for a second `flink run` to continue from, so stopping
        # half way would make the run after the fix repeat the first half).
        if not Path(args.input).exists():
            print(f"ratchet flink: --input {args.input} does not exist", file=sys.stderr)
            return EXIT_USAGE
        # Restoring: only the files the savepoint's source has not read (it skips the others).
        only = unread_inputs(args.from_savepoint, args.input) if restoring else None
        try:
            bad, inputs = scan_input(Path(args.input), args.key, only)
        except UndecodableLine as exc:
            print(
                f"ratchet flink: bad input: {exc}; nothing was submitted: Flink's line reader "
                "cannot tell these bytes from text (it reads them as U+FFFD), so the line is "
                "refused whatever --on-bad-input says: fix its encoding and run again",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
        except OSError as exc:
            print(f"ratchet flink: --input {args.input} cannot be read: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if bad and args.on_bad_input == "stop":
            more = f" (and {len(bad) - 1} more bad line(s))" if len(bad) > 1 else ""
            print(
                f"ratchet flink: bad input: {bad[0]}{more}; nothing was submitted: fix the "
                f"line and run again, or pass --on-bad-input skip or dead-letter",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
    agent = args.agent
    target, _, attr = agent.rpartition(":")
    if target.endswith(".py") or os.sep in target:
        agent = f"{os.path.abspath(target)}:{attr}"
    name = args.job_name or f"ratchet {args.agent}"
    if args.jobmanager:
        code = _submit(args, agent, config, name, journal)
        _report_bad(args, bad)
        return code
    # A bounded input runs as a stream (the source keeps watching) until every input's run is
    # done, then the job stops with a savepoint (`_run_to_completion`): keys keep running concurrently
    # and checkpoints keep completing to the last input (a bounded source's end would make
    # the operator finish every key's work in one callback, with no checkpoint meanwhile).
    # Restored from such a run's savepoint (`_restores_to_completion`), it runs the same way,
    # and its progress lines also name each input it admits: the savepoint's own runs finish
    # in it too, and only its own inputs say when it is done. Any other restored job keeps the
    # progress sink and writes nothing to it: Flink refuses a savepoint whose stateful operator
    # the job lacks.
    import uuid

    to_completion = (
        args.follow is None and not args.detach and (not args.from_savepoint or restoring)
    )
    progress_dir = None
    if to_completion or args.from_savepoint:
        progress_dir = os.path.join(args.output, PROGRESS_DIR, uuid.uuid4().hex)
    # The handlers are in place before the mini-cluster starts: a signal from here on stops
    # the job with a savepoint once its tasks run (a detached run's command ends at once).
    with _StopSignals(enabled=not args.detach) as stop:
        env = environment(config)
        build_job(
            env,
            agent,
            args.input,
            args.output,
            key_field=args.key,
            config=config,
            follow_ms=(_RESTORED_WATCH_MS if restoring else _WATCH_MS)
            if to_completion
            else args.follow,
            memory_dir=args.memory_output,
            on_bad_input=args.on_bad_input,
            progress_dir=progress_dir,
            emit_progress=to_completion,
            progress_admissions=restoring,
        )
        started = SYSTEM_CLOCK.monotonic()
        try:
            client = env.execute_async(name)
        except Exception as exc:  # the job did not start: a savepoint it cannot restore, say
            return _job_failed("(not started)", exc, args)
        job_id = str(client.get_job_id())
        note_job(args.output, job_id)
        print(json.dumps({"job_id": job_id, "name": name}), flush=True)
        if args.detach:
            return EXIT_OK
        savepoint = None
        pruner = None
        stopped = False
        try:
            if journal is not None:
                rest = f"http://127.0.0.1:{config.extra['rest.port']}"
                pruner = _pruner(args, journal, rest, job_id)
            if to_completion and progress_dir is not None:
                savepoint = _run_to_completion(
                    client, args, progress_dir, inputs - len(bad), restoring, stop.requested
                )
            if savepoint is not None:  # done, and stopped with its savepoint
                client.get_job_execution_result().result()
            else:
                stopped = stop.requested.is_set() or _wait_or_stop(client, stop.requested)
            if stopped:
                # SIGINT or SIGTERM: the job stops with a savepoint (not drained, so it can be
                # continued); what its runs committed is in it, nothing is lost.
                print("ratchet flink: stopping with a savepoint ...", file=sys.stderr, flush=True)
                savepoint = _stop_when_running(client, _savepoint_target(args))
        except Exception as exc:  # py4j's error, with the Java cause chain as text
            return _job_failed(job_id, exc, args)
        finally:
            if pruner is not None:
                pruner.stop()
    summary: dict[str, Any] = {
        "job_id": job_id,
        "status": "STOPPED" if stopped else "FINISHED",
        "seconds": round(SYSTEM_CLOCK.monotonic() - started, 3),
        "execution_mode": config.execution_mode,
    }
    if savepoint is not None:
        summary["savepoint"] = savepoint
    if pruner is not None:
        summary["call_journal"] = {
            "namespace": config.journal_namespace,
            "pruned": pruner.pruned,
        }
    if bad:
        summary["bad_inputs"] = bad
    print(json.dumps(summary), flush=True)
    _report_bad(args, bad)
    if stopped:
        follow = args.follow if args.follow is not None else 1000
        print(
            f"ratchet flink: stopped; continue with the same command and --from-savepoint "
            f"{savepoint} --follow {follow} (a run that stopped before the end of its input "
            "continues as a watching one)",
            file=sys.stderr,
        )
    return EXIT_OK


PROGRESS_DIR = "_progress"  # under the output folder: one committed line per finished run
_WATCH_MS = 3_600_000  # how often a bounded input run as a stream looks for new files
# A fresh source lists its files when the job starts; a restored one first lists them one
# interval after its start (Flink's ContinuousFileSplitEnumerator), so a restored run looks soon.
_RESTORED_WATCH_MS = 500
_POLL_S = 0.25
_REPORT_S = 5.0


class _StopSignals:
    """SIGINT and SIGTERM during a local run: the command stops the job with a savepoint
    (`requested` is set); a second signal ends the command at once, without one."""

    def __init__(self, enabled: bool = True) -> None:
        self.requested = threading.Event()
        self._enabled = enabled
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        # Only the main thread can set handlers.
        if self._enabled and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.requested.is_set():
            print("ratchet flink: stopped without a savepoint", file=sys.stderr, flush=True)
            os._exit(128 + signum)  # the mini-cluster's JVM ends with this process
        self.requested.set()

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _wait_or_stop(client: Any, stop: threading.Event) -> bool:
    """Wait for the job's end (its failure raised here); True when a stop was asked first.
    The wait itself is a thread's: a signal handled during a call into the JVM would leave
    the gateway's connection half read."""
    ended = threading.Event()
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            client.get_job_execution_result().result()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            failed.append(exc)
        finally:
            ended.set()

    threading.Thread(target=wait, name="ratchet-flink-wait", daemon=True).start()
    while not ended.is_set():
        if stop.wait(_POLL_S):
            return True
    if failed:
        raise failed[0]
    return False


def _savepoint_target(args: argparse.Namespace) -> str:
    """Where a local run's savepoints go: beside its checkpoints, or in the output folder
    (hidden from the outputs)."""
    where = args.checkpoint_dir
    if where and "://" in where:
        return str(where).rstrip("/") + "/savepoints"
    if where:
        return os.path.abspath(os.path.join(where, "savepoints"))
    out = _local_output(args)
    if out is None:  # an output on another file system, and no --checkpoint-dir
        return str(args.output).rstrip("/") + "/_savepoints"
    return os.path.join(out, "_savepoints")


def _run_to_completion(
    client: Any,
    args: argparse.Namespace,
    progress: str,
    inputs: int,
    restored: bool,
    stop: threading.Event,
) -> Any:
    """Wait until `inputs` runs are done for good (their progress lines are committed), printing
    a progress line now and then, then stop the job with a savepoint; returns its
    path (None when the job ended by itself, which the caller then reports, or when `stop` was
    set first). `restored`: count only the runs of inputs this job admitted, once all `inputs`
    are admitted."""
    from ratchet.flink._job import count_admitted_progress, count_progress

    terminal = {"FINISHED", "FAILED", "CANCELED"}
    started = last = SYSTEM_CLOCK.monotonic()
    reported = -1
    while True:
        if restored:
            admitted, done = count_admitted_progress(progress)
            finished = admitted >= inputs and done == admitted
        else:
            done = count_progress(progress)
            finished = done >= inputs
        now = SYSTEM_CLOCK.monotonic()
        if finished:
            break
        try:
            status = _status(client)
        except Exception:  # a local job that failed took its mini-cluster down with it
            client.get_job_execution_result().result()  # raises the job's own failure
            raise
        if status in terminal:
            return None
        if now - last >= _REPORT_S and done != reported:
            rate = done / (now - started) if now > started else 0.0
            print(
                f"ratchet flink: {done}/{inputs} inputs done ({rate:.0f}/s)",
                file=sys.stderr,
                flush=True,
            )
            reported, last = done, now
        if stop.wait(_POLL_S):
            return None
    target = _savepoint_target(args)
    # Every input's run is done and committed: the stop only takes the savepoint. It drains
    # (the final watermark fires each key's end-of-input timer) only to write --memory-output;
    # a drained savepoint ends the job for good (Flink restores its finished source as
    # finished: nothing new would be read), so without that option it does not drain and the
    # savepoint can be continued from (`_restores_to_completion`).
    drain = bool(args.memory_output)
    savepoint = _stop_with_savepoint(client, target, drain=drain)
    from ratchet.runtime._flink_savepoint import write_marker

    write_marker(
        savepoint,
        {
            "input": os.path.abspath(args.input),
            "execution_mode": args.execution_mode,
            "drained": drain,
        },
    )
    return savepoint


_NOT_RUNNING = "Not all required tasks are currently running"
_STOP_WAIT_S = 120.0


def _stop_when_running(client: Any, target: str) -> str:
    """Stop with a savepoint, once the job's tasks run: Flink refuses one while any is still
    starting (a stop asked during the job's start) or restarting."""
    deadline = SYSTEM_CLOCK.monotonic() + _STOP_WAIT_S
    while True:
        try:
            return _stop_with_savepoint(client, target, drain=False)
        except Exception as exc:  # py4j's error: the Java cause chain as text
            if _NOT_RUNNING not in str(exc) or SYSTEM_CLOCK.monotonic() > deadline:
                _raise_job_failure(client)  # a job that failed meanwhile: its own cause
                raise
        SYSTEM_CLOCK.sleep_sync(_POLL_S)


def _raise_job_failure(client: Any) -> None:
    """Raise the job's own failure if it ended with one (a job that ran out of restarts while
    a stop waited for its tasks): that, not the refused stop, is what the user needs to see."""
    try:
        status = _status(client)
    except Exception:  # noqa: BLE001 - no status: the stop's own error says what there is
        return
    if status in ("FAILED", "CANCELED"):
        client.get_job_execution_result().result()  # raises the job's failure


def _status(client: Any) -> str:
    """The job's status by name (`FAILED`): PyFlink's `JobStatus` is an enum, whose str is
    `JobStatus.FAILED`."""
    status = client.get_job_status().result()
    return str(getattr(status, "name", status))


def _stop_with_savepoint(client: Any, target: str, *, drain: bool) -> str:
    """`JobClient.stopWithSavepoint` called on the Java client: PyFlink's wrapper passes two
    arguments, Flink 2's method takes three (the savepoint format too)."""
    from pyflink.java_gateway import get_gateway

    fmt = get_gateway().jvm.org.apache.flink.core.execution.SavepointFormatType.CANONICAL
    return str(client._j_job_client.stopWithSavepoint(drain, target, fmt).get())


class UndecodableLine(Exception):
    """A line of a bounded input that is not UTF-8: Flink's line reader would read it with
    U+FFFD in place of its bytes, so the job could neither skip nor dead-letter it."""


def scan_input(path: Path, key_field: str, only: list[Path] | None = None) -> tuple[list[str], int]:
    """The bad lines of a bounded input (a file, or the files under a folder that Flink's file
    source reads: names starting with `.` or `_` are skipped; `only` some of them), as the
    embedded engine words them (`path:line: ...`), and how many non-blank lines it has."""
    from ratchet.flink._function import parse_line
    from ratchet.runtime._flink_files import input_files

    bad: list[str] = []
    lines = 0
    for f in input_files(path) if only is None else only:
        with f.open("rb") as fh:
            for n, raw in enumerate(fh, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    # The embedded engine's words for it; Flink's reader would have put U+FFFD
                    # in place of the bytes and taken the line.
                    _key, _line, error = parse_line(raw, str(f), key_field, n)
                    raise UndecodableLine(error or f"{f}:{n}: invalid UTF-8") from None
                _key, line, error = parse_line(text, str(f), key_field, n)
                if error is not None:
                    bad.append(error)
                    lines += 1
                elif line is not None:
                    lines += 1
    return bad, lines


def _report_bad(args: argparse.Namespace, bad: list[str]) -> None:
    if not bad:
        return
    what = (
        "skipped"
        if args.on_bad_input == "skip"
        else "kept in " + os.path.join(args.output, "_bad-input")
    )
    print(
        f"ratchet flink: {len(bad)} bad input line(s) {what} (--on-bad-input "
        f"{args.on_bad_input}); the first: {bad[0]}",
        file=sys.stderr,
    )


UNMAPPED_STATE = "Cannot map checkpoint/savepoint state for operator"  # Flink's refusal


def _job_failed(job_id: str, exc: BaseException | str, args: argparse.Namespace) -> int:
    """One line for a job that failed (`exc`: py4j's error, or what `flink run` printed),
    with the exit code of what failed it: a bad line 3, a savepoint it cannot restore or an
    error ratchet raised in a worker its own code, anything else 1."""
    from ratchet.flink._function import BAD_INPUT_MARK

    text = str(exc)
    at = text.find(BAD_INPUT_MARK)
    if at >= 0:
        line = text[at + len(BAD_INPUT_MARK) :].splitlines()[0].strip()
        print(f"ratchet flink: bad input: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if UNMAPPED_STATE in text:
        print(
            f"ratchet flink: the savepoint {args.from_savepoint} holds state of an operator "
            "this job does not have, so Flink will not restore it: run with the options of the "
            "job that took it (--memory-output, --on-bad-input dead-letter and --execution-mode "
            "add or change operators), or pass --allow-non-restored-state to drop that "
            "operator's state (its uncommitted output is lost)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    found = _ratchet_error(text)
    if found is not None:  # what ratchet refused in a worker says more than Java's wrapping
        name, message, code = found
        print(f"ratchet flink: job {job_id} failed: {message}", file=sys.stderr)
        return code
    cause = [ln for ln in text.splitlines() if "Error" in ln or "Exception" in ln]
    print(
        f"ratchet flink: job {job_id} failed: {cause[-1].strip() if cause else text[:500]}",
        file=sys.stderr,
    )
    return EXIT_FAILED


def _ratchet_error(text: str) -> tuple[str, str, int] | None:
    """The last ratchet error in a failed job's text: its class name, its message, and the
    exit code the embedded engine gives it; None if there is none."""
    import re

    import ratchet._errors as errors

    # As a process-mode traceback ends (`ratchet._errors.ConfigError: ...`), or as thread
    # mode's pemja words it (`<class 'ratchet._errors.ConfigError'>: ...`).
    found = list(re.finditer(r"ratchet\._errors\.(\w+)(?:'>)?: (.+)", text))
    if not found:
        return None
    name, message = found[-1].group(1), found[-1].group(2).strip()
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.RatchetError)):
        return None
    return name, message, errors.exit_code_for(cls.__new__(cls))


def _submit(args: argparse.Namespace, agent: str, config: Any, name: str, journal: Any) -> int:
    """Submit to a running cluster with the pip package's `flink run -py` (a context
    environment bound to the cluster), running `ratchet.flink._entry` as the job script."""
    import dataclasses
    import re
    import subprocess
    from collections import deque
    from pathlib import Path

    import pyflink

    import ratchet.flink._entry as entry
    from ratchet.connectors._pg_journal import DSN_ENV

    spec = {
        "agent": agent,
        "input": os.path.abspath(args.input),
        "output": os.path.abspath(args.output),
        "key": args.key,
        "follow_ms": args.follow,
        "memory_dir": os.path.abspath(args.memory_output) if args.memory_output else None,
        "on_bad_input": args.on_bad_input,
        "name": name,
        "config": dataclasses.asdict(config),
    }
    env = dict(os.environ)
    env.pop(DSN_ENV, None)
    if config.call_journal:  # through the environment: argv is visible to every user (ps)
        env[DSN_ENV] = spec["config"].pop("call_journal")
    else:
        spec["config"].pop("call_journal", None)
    flink = Path(pyflink.__file__).parent / "bin" / "flink"
    cmd = [
        "bash",
        str(flink),
        "run",
        "-m",
        args.jobmanager,
        "-pyclientexec",
        sys.executable,
        "-pyexec",
        config.python_executable,
        "-py",
        entry.__file__,
        json.dumps(spec),
    ]
    if args.detach:
        cmd.insert(3, "-d")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    job_id = None
    pruner = None
    said_lines: deque[str] = deque(maxlen=5000)  # enough for a Java cause chain or two
    try:
        for line in proc.stdout:
            said_lines.append(line)
            m = re.search(r"JobID ([0-9a-f]{32})", line)
            if m and job_id is None:
                job_id = m.group(1)
                said: dict[str, Any] = {"job_id": job_id, "name": name}
                if journal is not None:  # what `ratchet flink prune-journal` needs
                    said["call_journal_namespace"] = config.journal_namespace
                print(json.dumps(said), flush=True)
                if journal is not None and not args.detach:
                    pruner = _pruner(args, journal, f"http://{args.jobmanager}", job_id)
        code = proc.wait()
    finally:
        if pruner is not None:
            pruner.stop()
    if code != 0 and job_id is not None:  # an attached job that failed: say why, in a line
        return _job_failed(job_id, "".join(said_lines), args)
    if code != 0 or job_id is None:
        tail = list(said_lines)[-40:]
        print("ratchet flink: submission failed:\n" + "".join(tail), file=sys.stderr)
        return code or 1
    return EXIT_OK
