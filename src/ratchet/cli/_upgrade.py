"""`ratchet migrate` and `ratchet runs`: upgrading an agent's state (docs/runtime.md)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ratchet._argtypes import add_key_type
from ratchet._errors import EXIT_OK
from ratchet.cli._trace import seq_number


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    migrate = sub.add_parser(
        "migrate",
        help="bring every key's memory to the agent's memory_version now (job stopped)",
        description="Run the agent's @ratchet.migration methods on every key whose memory is "
        "older than the agent's memory_version. Without this, a key is migrated when its first "
        "run after the upgrade starts. Batches are committed as they finish: a killed migrate "
        "loses only the batch in progress, and no key is migrated twice.",
    )
    migrate.add_argument("--state", required=True, help="the stopped job's state directory")
    migrate.add_argument(
        "--agent", required=True, help="the new agent: package.module:Class or path/file.py:Class"
    )
    migrate.add_argument("--json", action="store_true", help="print the result as JSON")
    migrate.set_defaults(func=cmd_migrate)

    runs = sub.add_parser("runs", help="list, restart or abandon runs in flight")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True, metavar="SUBCOMMAND")
    listing = runs_sub.add_parser(
        "list", help="runs in flight (with the agent version each runs under) and dead letters"
    )
    listing.add_argument("--state", required=True)
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_runs_list)
    for name, help_text in (
        (
            "restart",
            "discard a run's journal so it starts again from its input at the next `ratchet "
            "run` (its durable calls may be made again; the signals it took are pending again, "
            "for it to take again)",
        ),
        (
            "abandon",
            "move a run's input to the dead letters and discard the run (the signals it took "
            "stay with the dead letter, and are pending again when it is redriven)",
        ),
    ):
        p = runs_sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--state", required=True, help="the stopped job's state directory")
        p.add_argument("--key", required=True, help="the run's key, as `ratchet runs list` shows")
        add_key_type(p, unless=", unless --seq names the run")
        p.add_argument(
            "--seq", type=seq_number, default=None, help="the run's input seq (optional)"
        )
        if name == "abandon":
            p.add_argument(
                "--reason", default="abandoned by `ratchet runs abandon`", help="kept with it"
            )
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=cmd_runs_discard, runs_action=name)


def cmd_migrate(args: argparse.Namespace) -> int:
    from ratchet.agents._context import AgentBinding
    from ratchet.agents._run import load_agent
    from ratchet.runtime._upgrade import migrate_state

    binding = AgentBinding(load_agent(args.agent))
    progress = None
    on_progress = None
    if sys.stderr.isatty() and not args.json:
        from rich.progress import Progress

        progress = Progress(transient=True)
        task = progress.add_task("migrating keys", total=None)

        def on_progress(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        progress.start()
    try:
        result = migrate_state(args.state, binding, on_progress=on_progress)
    finally:
        if progress is not None:
            progress.stop()
    out = {
        "state": args.state,
        "memory_version": result.to_version,
        "migrated": result.migrated,
        "waiting_for_their_run": result.waiting,
        "agent_changed_from": result.upgraded_from,
    }
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return EXIT_OK
    print(f"migrated {result.migrated} key(s) to memory version {result.to_version}")
    if result.waiting:
        shown = ", ".join(result.waiting[:10]) + (" ..." if len(result.waiting) > 10 else "")
        print(
            f"{len(result.waiting)} key(s) have a run in flight and keep their memory until it "
            f"completes; they are migrated when their next run starts: {shown}"
        )
    return EXIT_OK


def cmd_runs_list(args: argparse.Namespace) -> int:
    from ratchet.runtime._upgrade import list_runs
    from ratchet.store._base import signal_key_type

    found = list_runs(args.state)
    if args.json:
        print(json.dumps(found, indent=2, default=str))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"runs in flight in {args.state}")
    for col in ("key", "input seq", "journaled tasks", "call records", "agent version"):
        table.add_column(col)
    # The integer key 7 and the string key "7" read alike: typed where both are in flight.
    types: dict[str, set[str]] = {}
    for r in found["in_flight"]:
        types.setdefault(str(r["key"]), set()).add(signal_key_type(r["key"]))
    for r in found["in_flight"]:
        text = str(r["key"])
        table.add_row(
            f"{text} ({signal_key_type(r['key'])})" if len(types[text]) > 1 else text,
            str(r["seq"]),
            "?" if r["journaled_tasks"] is None else str(r["journaled_tasks"]),
            f"{r['call_records']} ({r['calls_returned']} returned)",
            r["agent_version"] or "current",
        )
    console = Console()
    console.print(table)
    letters = found["dead_letters"]
    console.print(f"dead letters: {len(letters)}")
    for d in letters[-10:]:
        console.print(f"  key {d['key']} input {d['seq']}: {d['reason']}")
    return EXIT_OK


def cmd_runs_discard(args: argparse.Namespace) -> int:
    from ratchet.runtime._upgrade import discard_run
    from ratchet.store._base import int_text

    abandon = args.runs_action == "abandon"
    done: dict[str, Any] = discard_run(
        args.state,
        args.key,
        args.seq,
        dead_letter_reason=args.reason if abandon else None,
        key_type=args.key_type,
    )
    if args.json:
        print(json.dumps(dict(done, action=args.runs_action), indent=2, default=str))
        return EXIT_OK
    kind = f" ({done['key_type']})" if int_text(done["key"]) else ""  # as `trace` shows it
    head = f"key {done['key']}{kind} input {done['seq']}"
    tasks = done["journaled_tasks"]
    lost = (
        f"discarded its journal of {'?' if tasks is None else tasks} task(s), "
        f"{done['call_records']} durable-call record(s) ({done['calls_returned']} had returned) "
        f"and {done['unreleased_outputs']} unreleased output(s)"
    )
    if abandon:
        kept = done["signals_kept"]
        signals = (
            f"the {kept} signal(s) the run had taken are kept with the dead letter, and go "
            f"back to the key's pending signals when it is redriven (`ratchet redrive`), for "
            f"the redriven run to take again"
            if kept
            else "the run had taken no signal"
        )
        print(
            f"{head}: abandoned; its input is in the dead letters (`ratchet runs list`); {lost}; "
            f"{signals}. The key's memory is as before the run; its later inputs run as usual"
        )
    else:
        back = done["signals_put_back"]
        signals = (
            f"put back the {back} signal(s) the run had taken, pending again as they were "
            f"sent, for the restarted run to take again"
            if back
            else "the run had taken no signal"
        )
        print(
            f"{head}: {lost}; {signals}. The run starts again from its input at the next "
            f"`ratchet run`: its actions run again, and durable calls that had returned may be "
            f"made again (outputs it already wrote keep their ids, so the output file does not "
            f"repeat them)"
        )
    return EXIT_OK
