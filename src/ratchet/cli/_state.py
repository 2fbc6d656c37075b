"""`ratchet savepoint`, `ratchet checkpoints`, `ratchet fork`: copies and history of a job's state."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ratchet._argtypes import add_key_type, refuse_key_type_without_key
from ratchet._errors import EXIT_OK

_SAVEPOINT_HELP = """\
Write a consistent copy of the job's state to PATH, one self-contained SQLite file.

It works while the job runs (a read-only snapshot; the job's writer is not blocked) or while
it is stopped, and holds exactly what a crash at that moment would have left: the latest
completed checkpoint plus the durable-call results recorded since. PATH appears only once the
copy is complete, verified and synced to disk, so an interrupted savepoint leaves nothing at
PATH (what it left beside PATH is removed by the next savepoint, never blocks it). PATH must
not exist. The savepoint is also listed by `ratchet checkpoints --state DIR`.

The job's state is updated in place, so its earlier checkpoints cannot be gone back to: a
savepoint is how you keep a point to return to, e.g. before shipping a new agent version.
Restoring one into a new state directory continues the same job (same job id: outputs it
writes again are deduplicated against the job's output file).
"""

_CHECKPOINTS_HELP = """\
List the checkpoints a state retains and the savepoints taken of it.

The state is updated in place: only the latest completed checkpoint can be restored (it is
what `ratchet run --state DIR` resumes from). The earlier rows (up to 100) are history, the
statistics of checkpoints whose state has since been overwritten. Savepoints are listed with
whether their file still exists. Read-only; works while the job runs.
"""

_FORK_HELP = """\
Copy the job's state into a new job at NEW: all keys, or only the keys given with --key.

The copy is consistent (as a savepoint) and works while the job runs. With --key, every row
of the other keys is left out: their memory, queued and in-flight inputs, durable-call
records and unreleased outputs. The fork is a different job with a new job id: run it with
a new --output file (or --append-output). It keeps the original's input position, so it
reads on from the same --input; inputs of keys it does not hold start those keys anew.
NEW must not exist or be an empty directory. Keys are named as `ratchet inspect` shows them.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    savepoint = sub.add_parser(
        "savepoint",
        help="write a consistent copy of a job's state to one file (also while it runs)",
        description=_SAVEPOINT_HELP,
        formatter_class=fmt,
    )
    savepoint.add_argument("--state", required=True, help="the job's state directory")
    savepoint.add_argument("path", metavar="PATH", help="the savepoint file to write (new)")
    savepoint.add_argument("--json", action="store_true", help="print what was written as JSON")
    savepoint.set_defaults(func=cmd_savepoint)

    checkpoints = sub.add_parser(
        "checkpoints",
        help="the checkpoints a state retains and the savepoints taken of it",
        description=_CHECKPOINTS_HELP,
        formatter_class=fmt,
    )
    checkpoints.add_argument("--state", required=True, help="the job's state directory")
    checkpoints.add_argument("--json", action="store_true", help="print one JSON document")
    checkpoints.set_defaults(func=cmd_checkpoints)

    fork = sub.add_parser(
        "fork",
        help="copy a job's state (all keys or some) into a new job",
        description=_FORK_HELP,
        formatter_class=fmt,
    )
    fork.add_argument("--state", required=True, help="the job's state directory")
    fork.add_argument(
        "--to", required=True, metavar="NEW", help="the new job's state directory (new or empty)"
    )
    fork.add_argument(
        "--key",
        action="append",
        dest="keys",
        metavar="K",
        default=None,
        help="copy only this key (repeat for more); default: all keys",
    )
    add_key_type(fork, "K")
    fork.add_argument("--json", action="store_true", help="print what was copied as JSON")
    fork.set_defaults(func=cmd_fork)


def _checkpoint_text(cid: Any) -> str:
    return f"checkpoint #{cid}" if cid is not None else "no checkpoint completed yet"


def _counts_text(result: dict[str, Any]) -> str:
    text = (
        f"{result['keys']} key(s), {result['in_flight_runs']} in-flight run(s), "
        f"{result['queued_inputs']} queued input(s), {result['unreleased_outputs']} unreleased "
        f"output(s)"
    )
    if "dead_letters" in result:
        text += f", {result['dead_letters']} dead letter(s)"
    return text


def cmd_savepoint(args: argparse.Namespace) -> int:
    from ratchet.runtime._savepoints import iso_utc, take_savepoint

    result = take_savepoint(args.state, args.path)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return EXIT_OK
    print(f"savepoint written: {result['path']} ({result['size_bytes']} bytes)")
    print(
        f"  {_checkpoint_text(result['checkpoint_id'])} of job {result['job'] or '(no job id)'} "
        f"({result['agent_name']}), taken {iso_utc(result['taken_at'])}"
    )
    print(f"  holds {_counts_text(result)}")
    if result["logged"]:
        print(f"  listed by: ratchet checkpoints --state {args.state}")
    else:
        print(f"  note: it is not listed by `ratchet checkpoints`: {result['log_error']}")
    print(
        "  restore it into a new state directory (the same job, continued): "
        f"ratchet run AGENT --state NEW --from-savepoint {result['path']} ..."
    )
    return EXIT_OK


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from ratchet.runtime._savepoints import list_checkpoints

    listing = list_checkpoints(args.state)
    if args.json:
        print(json.dumps(listing, indent=2, default=str))
        return EXIT_OK
    counts = listing["counts"] or {}
    print(
        f"checkpoints of {listing['state_dir']} (agent {listing['agent']}, job "
        f"{listing['job'] or '-'}): completed {counts.get('completed', '?')}, failed "
        f"{counts.get('failed', '?')}, restored {counts.get('restored', '?')}"
    )
    latest = listing["restorable_checkpoint"]
    if latest is None:
        print("no checkpoint has completed yet: nothing is restorable")
    else:
        print(
            f"only the latest completed checkpoint, #{latest}, is restorable: the state is "
            f"updated in place (it is what `ratchet run --state {args.state}` resumes from); "
            f"the earlier rows are history. Keep a point to go back to with: ratchet "
            f"savepoint --state {args.state} PATH"
        )
        print(f"  {'id':>8}  {'time (UTC)':<24}  {'duration':>11}  {'size':>12}")
        for row in reversed(listing["checkpoints"]):
            print(
                f"  {row['id']:>8}  {row['time']:<24}  {row['duration_ms']:>8.1f} ms  "
                f"{row['size_bytes']:>6} bytes  "
                + ("restorable (latest)" if row["restorable"] else "history")
            )
    savepoints = listing["savepoints"]
    print(f"savepoints: {len(savepoints)}")
    for sp in savepoints:
        where = "present" if sp["exists"] else "missing (the file is gone)"
        print(
            f"  {sp['path']}  taken {sp.get('taken_at_iso') or '?'}  "
            f"{_checkpoint_text(sp.get('checkpoint_id'))}  {sp.get('size_bytes', '?')} bytes  "
            f"{where}"
        )
    if listing["unreadable_savepoint_lines"]:
        print(
            f"  ({listing['unreadable_savepoint_lines']} unreadable line(s) of savepoints.jsonl "
            f"skipped)"
        )
    return EXIT_OK


def cmd_fork(args: argparse.Namespace) -> int:
    from ratchet.runtime._savepoints import fork_state

    refuse_key_type_without_key(args.key_type, args.keys, "K")
    result = fork_state(args.state, args.to, args.keys, key_type=args.key_type)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return EXIT_OK
    which = (
        "all keys"
        if result["selected_keys"] is None
        else "key(s) "
        + ", ".join(
            repr(int(k) if t == "int" else k)
            for k, t in zip(result["selected_keys"], result["selected_key_types"], strict=True)
        )
    )
    print(f"forked {result['from']} into {result['to']}: {which}")
    print(
        f"  new job {result['job']} (from job {result['from_job'] or '-'}, "
        f"{_checkpoint_text(result['checkpoint_id'])})"
    )
    print(f"  holds {_counts_text(result)}")
    removed = {t: n for t, n in result["removed_rows"].items() if n}
    if removed:
        print("  left out: " + ", ".join(f"{n} {t} row(s)" for t, n in removed.items()))
    print(
        f"  run it with a new --output file: ratchet run AGENT --input <the same input> "
        f"--output NEW.jsonl --state {args.to}"
    )
    return EXIT_OK
