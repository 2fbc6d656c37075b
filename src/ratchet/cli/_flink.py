"""`ratchet flink run`: an agent as a PyFlink job (local mini-cluster or a running cluster).

PyFlink is imported only when the command runs, so `ratchet` works without the extra.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ratchet._clock import SYSTEM_CLOCK
from ratchet._errors import EXIT_OK, EXIT_USAGE


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
    run.add_argument("--max-concurrent-tasks", type=int, default=64, help="per subtask")
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
    run.add_argument("--tmp-dir", default=None, help="Flink temp files (io.tmp.dirs)")
    run.add_argument("--job-name", default=None)
    run.add_argument("--detach", action="store_true", help="submit, print the job id, exit")
    run.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE", help="any Flink option"
    )
    run.set_defaults(func=cmd_run)
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
    return FlinkConfig(
        checkpoint_interval_ms=args.checkpoint_interval,
        state_backend=args.state_backend,
        checkpoint_dir=args.checkpoint_dir,
        parallelism=args.parallelism,
        restart_strategy=args.restart_strategy,
        restart_attempts=args.restart_attempts,
        restart_delay_ms=args.restart_delay,
        unaligned_checkpoints=not args.aligned_checkpoints,
        bundle_size=args.bundle_size,
        bundle_time_ms=args.bundle_time,
        tmp_dir=args.tmp_dir,
        core=CoreConfig(
            max_concurrent_tasks=args.max_concurrent_tasks, sync_workers=args.sync_workers
        ),
        extra=extra,
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
    import os

    from ratchet.agents._run import load_agent
    from ratchet.flink import build_job, environment

    load_agent(args.agent)  # fail here, with a clear message, rather than in a worker
    agent = args.agent
    target, _, attr = agent.rpartition(":")
    if target.endswith(".py") or os.sep in target:
        agent = f"{os.path.abspath(target)}:{attr}"
    config = _config(args)
    name = args.job_name or f"ratchet {args.agent}"
    if args.jobmanager:
        return _submit(args, agent, config, name)
    env = environment(config)
    build_job(
        env,
        agent,
        args.input,
        args.output,
        key_field=args.key,
        config=config,
        follow_ms=args.follow,
        memory_dir=args.memory_output,
    )
    started = SYSTEM_CLOCK.monotonic()
    client = env.execute_async(name)
    job_id = str(client.get_job_id())
    print(json.dumps({"job_id": job_id, "name": name}), flush=True)
    if args.detach:
        return EXIT_OK
    client.get_job_execution_result().result()
    print(
        json.dumps(
            {
                "job_id": job_id,
                "status": "FINISHED",
                "seconds": round(SYSTEM_CLOCK.monotonic() - started, 3),
            }
        ),
        flush=True,
    )
    return EXIT_OK


def _submit(args: argparse.Namespace, agent: str, config: Any, name: str) -> int:
    """Submit to a running cluster with the pip package's `flink run -py` (a context
    environment bound to the cluster), running `ratchet.flink._entry` as the job script."""
    import dataclasses
    import os
    import re
    import subprocess
    from pathlib import Path

    import pyflink

    import ratchet.flink._entry as entry

    host, sep, port = args.jobmanager.rpartition(":")
    if not sep or not host or not port.isdigit():
        print(
            f"ratchet flink: --jobmanager {args.jobmanager!r} must look like host:port",
            file=sys.stderr,
        )
        return EXIT_USAGE
    spec = {
        "agent": agent,
        "input": os.path.abspath(args.input),
        "output": os.path.abspath(args.output),
        "key": args.key,
        "follow_ms": args.follow,
        "memory_dir": os.path.abspath(args.memory_output) if args.memory_output else None,
        "name": name,
        "config": dataclasses.asdict(config),
    }
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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    job_id = None
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        m = re.search(r"JobID ([0-9a-f]{32})", line)
        if m and job_id is None:
            job_id = m.group(1)
            print(json.dumps({"job_id": job_id, "name": name}), flush=True)
    code = proc.wait()
    if code != 0 or job_id is None:
        print("ratchet flink: submission failed:\n" + "".join(tail), file=sys.stderr)
        return code or 1
    return EXIT_OK
