"""The `ratchet` command line: `run`, `status`, `inspect`, and `checks`."""

from __future__ import annotations

import gc
import os
import sys
import threading

from ratchet._errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, RatchetError, exit_code_for

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from types import SimpleNamespace

_GROUPS = {
    "checks": "run checks incrementally with sealed receipts",
    "flink": "run agents on Apache Flink (needs ratchet[flink])",
}


def build_parser(
    command: str | None = None, rest: list[str] | None = None
) -> argparse.ArgumentParser:
    """The whole CLI; for a known `command`, the other groups are stubs (not imported).

    `ratchet run` is what a restarted worker executes, so its start-up should not pay for
    importing the check runner or the Flink front end; `ratchet checks` registers only the
    checks group, so it imports nothing of the agent side. `rest`, the arguments after the
    command, lets `checks` build only the subcommand they name.
    """
    from ratchet._argparse import Parser

    parser: argparse.ArgumentParser = Parser(
        prog="ratchet",
        description="Durable, event-driven agents and incremental, verified checks.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log engine activity (also after COMMAND)"
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="json: one JSON object per log line, for log shippers (also after COMMAND)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if command != "checks":
        # `ratchet checks` never touches an agent: skip the agent side's imports (the
        # runtime, the codec, asyncio) so the check runner starts fast.
        from ratchet.cli import _agents, _state

        _agents.register(sub)
        _state.register(sub)
    for group, help_text in _GROUPS.items():
        if command is not None and command != group:
            sub.add_parser(group, help=help_text)
        elif group == "checks":
            from ratchet.cli import _checks

            _checks.register(sub, rest)
        else:
            from ratchet.cli import _flink

            _flink.register(sub)  # imports PyFlink only when a flink command runs
    return parser


def _command_of(argv: list[str]) -> str | None:
    at = _command_index(argv)
    return None if at is None else argv[at]


def _command_index(argv: list[str]) -> int | None:
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--log-format":
            skip = True
            continue
        if not arg.startswith("-"):
            return i
    return None


def _global_flags(argv: list[str]) -> list[str]:
    """Move the global logging flags in front of the command, wherever they were given, so
    `ratchet run -v ...` works as `ratchet -v run ...` does."""
    front: list[str] = []
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--":
            rest.append(arg)
            rest.extend(it)
            break
        if arg in ("-v", "--verbose") or arg.startswith("--log-format="):
            front.append(arg)
        elif arg == "--log-format":
            front.append(arg)
            front.append(next(it, ""))
        else:
            rest.append(arg)
    return front + rest


def __getattr__(name: str) -> object:
    # `logging` is imported only when logging is configured: `ratchet checks` never logs.
    if name == "JsonLogFormatter":
        from ratchet.cli._logging import JsonLogFormatter

        return JsonLogFormatter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _configure_logging(verbose: bool, fmt: str) -> None:
    from ratchet.cli._logging import configure_logging

    configure_logging(verbose, fmt)


# Whether `main` turned the garbage collector off for the start-up (see `end_startup`).
_gc_paused = False


def _pause_gc() -> None:
    global _gc_paused
    if gc.isenabled():
        gc.disable()
        _gc_paused = True


def end_startup() -> None:
    """The command's start-up is over: freeze what it made and turn the collector back on.

    Start-up makes ~57,000 objects that live as long as the process (modules, classes,
    functions, the parser, the agent); collecting while they are made finds almost nothing
    to free, and once made every full collection would walk them again. So `main` turns the
    collector off for `ratchet run` and `ratchet checks`, and the command calls this when
    its imports are done and its agent is loaded (`ratchet run`: before the job runs, before
    a supervisor starts its worker, before a coordinator forks its workers). What start-up
    left as cyclic garbage (`ratchet run`: ~1,000 objects, ~0.2 MB, most of them argparse's
    formatters) is frozen with the rest, once, rather than collected by a full collection
    that would cost 13-15 ms here. A no-op when `main` did not turn the collector off (a
    caller's own settings are left alone)."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    """Run the command in `argv` (default: the process's arguments) and return its exit
    code. Called as the program (no `argv`), `ratchet checks` ends the process itself once
    its output is flushed, skipping the interpreter's teardown (see `ratchet._exit`)."""
    as_program = argv is None
    argv = _global_flags(sys.argv[1:] if argv is None else argv)
    at = _command_index(argv)
    command = None if at is None else argv[at]
    if as_program and command in ("checks", "run"):
        # `ratchet checks` start-up makes ~14,000 objects that live as long as the process;
        # collecting them while they are made found nothing to free and cost 5-6 ms.
        # `ratchet run` makes ~57,000 (pydantic, asyncio, the agent): 32M instructions of
        # collections (about 4% of its start-up) found next to nothing to free.
        _pause_gc()
    args: argparse.Namespace | SimpleNamespace | None = None
    if at == 0 and command == "checks":
        # A plain `ratchet checks run ...` is read without argparse (see `read_plain_run`);
        # anything else, help and errors included, goes to the parser.
        from ratchet.checks._cli import read_plain_run

        args = read_plain_run(argv[1:])
    if args is None:
        parser = build_parser(
            command if command in ("run", "status", "inspect", "checks") else None,
            None if at is None else argv[at + 1 :],
        )
        args = parser.parse_args(argv)
    if command == "checks":
        end_startup()
    if args.command != "checks" or args.verbose or args.log_format != "text":
        # `ratchet checks` logs nothing: without -v or --log-format json it does not pay
        # for importing `logging` at start-up.
        _configure_logging(args.verbose, args.log_format)
    try:
        state = getattr(args, "state", None)
        if command not in ("run", "status", "inspect", "checks") and isinstance(state, str):
            from ratchet.runtime._shards import refuse_sharded

            refuse_sharded(state, command or "")  # not one shard silently
        code = int(args.func(args) or 0)
    except RatchetError as exc:
        print(f"ratchet: error: {exc}", file=sys.stderr)
        code = exit_code_for(exc)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`ratchet trace --json | head`): not an error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_OK
    except Exception as exc:
        # A state database damaged past what opening it checks, met while a command reads
        # it (`status`, `runs list`, `dead-letters` on a page SQLite finds malformed).
        sqlite3 = sys.modules.get("sqlite3")
        if sqlite3 is None or not isinstance(exc, sqlite3.DatabaseError):
            raise
        from ratchet.store._files import state_write_error

        # A full or failing disk is not damage: its fix is the disk's, not a backup's.
        failed = state_write_error(state if isinstance(state, str) else "", exc, "used")
        where = f" in {state}" if isinstance(state, str) else ""
        print(
            f"ratchet: error: {failed}"
            if failed is not None
            else f"ratchet: error: the state database{where} could not be read ({exc}): it is "
            "damaged, and nothing was changed; restore it from a backup or a savepoint, or "
            "point --state at another directory",
            file=sys.stderr,
        )
        code = EXIT_USAGE
    finally:
        end_startup()  # a command that ended before its start-up was over
    if as_program and args.command == "run" and threading.active_count() > 1:
        # A thread still blocked in a user's call would hold the interpreter's exit; the job's
        # state is already committed, so leave without waiting for it. Only as the program:
        # called as a function, `main` returns to its caller (a test run would end silently).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if as_program and args.command == "checks":
        from ratchet._exit import exit_process

        exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
