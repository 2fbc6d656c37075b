"""`ratchet dead-letters` and `ratchet redrive` (docs/runtime.md, "Dead letters")."""

from __future__ import annotations

import argparse
import json
import time

from ratchet._argtypes import add_key_type, refuse_key_type_without_key, whole_number
from ratchet._errors import EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    listing = sub.add_parser(
        "dead-letters",
        help="inputs kept instead of lost: bad lines, runs that ended in error, abandoned runs",
    )
    listing.add_argument("--state", required=True)
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_dead_letters)

    redrive = sub.add_parser(
        "redrive",
        help="admit dead letters again, each exactly once (the job running or stopped)",
        description="Mark dead letters to be admitted again as new inputs: a running job picks "
        "them up at its next checkpoint tick, a stopped one when it next starts. Each is "
        "admitted once: the checkpoint that holds the new input records it as redriven. Bad "
        "lines are not redriven (fix the line and send it as new input).",
    )
    which = redrive.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="every dead letter not redriven yet")
    which.add_argument(
        "--key", help="those of one key, as `ratchet dead-letters` shows it (see --key-type)"
    )
    which.add_argument(
        "--id",
        type=whole_number(
            0, (1 << 63) - 1, out_of_range="{n} is not a dead letter id (0 to 2**63 - 1)"
        ),
        help="one, by its id (`ratchet dead-letters`)",
    )
    redrive.add_argument("--state", required=True)
    add_key_type(redrive, when="with --key: ")
    redrive.add_argument("--json", action="store_true")
    redrive.set_defaults(func=cmd_redrive)


def cmd_dead_letters(args: argparse.Namespace) -> int:
    from ratchet.runtime._deadletters import list_dead_letters

    letters = list_dead_letters(args.state)
    if args.json:
        print(json.dumps(letters, indent=2, default=str))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"dead letters of {args.state}")
    for col in ("id", "kind", "key", "key type", "input", "reason", "when", "redrive"):
        table.add_column(col)
    for d in letters:
        redriven = d.get("redriven_as")
        state = (
            f"as input {redriven}"
            if redriven is not None
            else "asked"
            if d.get("redrive_requested")
            else ""
        )
        table.add_row(
            str(d["id"]),
            d["kind"],
            str(d["key"]),
            d.get("key_type") or "",  # the integer key 1 and the string key "1" read alike
            "" if d["seq"] is None or d["seq"] < 0 else str(d["seq"]),
            d["reason"],
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["at"])),
            state,
        )
    Console().print(table)
    return EXIT_OK


def cmd_redrive(args: argparse.Namespace) -> int:
    from ratchet.runtime._deadletters import request_redrive

    refuse_key_type_without_key(args.key_type, args.key)
    done = request_redrive(
        args.state, all_letters=args.all, key=args.key, dead_id=args.id, key_type=args.key_type
    )
    if args.json:
        print(json.dumps(done))
        return EXIT_OK
    if args.key is not None and not done["marked"] and not done["bad_lines_skipped"]:
        # "0 dead letter(s) marked" said nothing of why: say what the key has, and which keys
        # have dead letters waiting. Exit 0: nothing is wrong with the state, and a redrive run
        # again (marking twice is harmless) must not fail.
        print(_nothing_marked(args.state, args.key, args.key_type))
        return EXIT_OK
    print(
        f"{done['marked']} dead letter(s) marked for redrive in {done['state']}; the job admits "
        f"each once, at its next checkpoint tick if it runs, or when it next starts"
        + (
            f" ({done['bad_lines_skipped']} bad line(s) not redriven: fix them and send them "
            f"as new input)"
            if done["bad_lines_skipped"]
            else ""
        )
    )
    return EXIT_OK


def _nothing_marked(state: str, text: str, key_type: str) -> str:
    """Why `redrive --key` marked nothing: the key's dead letters were all redriven (or asked
    for) already, or it has none; and which keys have dead letters waiting."""
    from ratchet.runtime._deadletters import list_dead_letters

    letters = list_dead_letters(state)
    what = f"key {text!r}" if key_type == "auto" else f"the {key_type} key {text!r}"
    # The one of the two keys of a text like "1" that redrive chose (a state holding both was
    # refused unless --key-type said which).
    own = [
        d
        for d in letters
        if d["kind"] != "bad-input"
        and str(d["key"]) == text
        and key_type in ("auto", d.get("key_type"))
    ]
    if own:
        return (
            f"{what} has no dead letter waiting for a redrive in {state}: its {len(own)} dead "
            f"letter(s) were redriven or asked for already; nothing marked"
        )
    waiting = sorted(
        {
            (str(d["key"]), d.get("key_type") or "str")
            for d in letters
            if d["kind"] != "bad-input"
            and d.get("redriven_as") is None
            and not d.get("redrive_requested")
        }
    )
    shown = ", ".join(repr(int(k) if t == "int" else k) for k, t in waiting[:10])
    more = f" and {len(waiting) - 10} more" if len(waiting) > 10 else ""
    others = (
        f"dead letters wait for a redrive for {len(waiting)} key(s): {shown}{more}"
        if waiting
        else "no dead letter waits for a redrive there"
    )
    return (
        f"{what} has no dead letters in {state}: nothing marked; {others} "
        f"(`ratchet dead-letters --state {state}` lists them)"
    )
