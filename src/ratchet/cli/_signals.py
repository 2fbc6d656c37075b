"""`ratchet signal`: send a signal to a key of a job, running or stopped (docs/runtime.md)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ratchet._argtypes import add_key_type
from ratchet._errors import EXIT_OK, BadInputError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "signal",
        help="send a signal to a key: a run waiting in ctx.wait_for_signal(NAME) gets the value",
        description="Store a signal durably in the job's state. A run of KEY waiting for NAME "
        "receives VALUE (at the running job's next checkpoint tick, or when a stopped job next "
        "starts); one nobody waits for yet is kept until a run of KEY waits for it. Signals of "
        "a key and name are delivered in the order sent, each exactly once.",
    )
    p.add_argument("--state", required=True, help="the job's state directory")
    p.add_argument("--key", required=True, help="the key, as `ratchet runs list` shows it")
    p.add_argument("name", metavar="NAME", help="the signal's name, e.g. approval:<call id>")
    p.add_argument(
        "--value", default="null", metavar="JSON", help="the value, as JSON (default: null)"
    )
    add_key_type(p)
    p.add_argument("--json", action="store_true", help="print what was stored as JSON")
    p.set_defaults(func=cmd_signal)


def cmd_signal(args: argparse.Namespace) -> int:
    from ratchet.runtime._signals import non_finite, send_signal

    try:
        value: Any = json.loads(args.value)
    except RecursionError:
        raise BadInputError(
            f"--value {args.value[:40]!r}... nests too deeply to be stored; send flatter JSON"
        ) from None
    except ValueError as exc:
        raise BadInputError(
            f"--value {args.value!r} is not JSON ({exc}); quote it for the shell, e.g. "
            f"--value '{{\"approved\": true}}' or --value '\"text\"'"
        ) from None
    where = non_finite(value)  # json.loads takes NaN and Infinity (Python's); JSON has neither
    if where is not None:
        raise BadInputError(
            f"--value {args.value[:40]!r} holds {where}, which is not JSON (so does a number "
            f"too large for a float, such as 1e999); send null, a finite number or a string"
        )
    sent = send_signal(args.state, args.key, args.name, value, key_type=args.key_type)
    if args.json:
        print(json.dumps(sent))
    else:
        where = f"{sent['state']} (shard {sent['shard']})" if "shard" in sent else sent["state"]
        print(
            f"signal {sent['name']!r} for key {sent['key']} stored in {where} (id "
            f"{sent['id']}); a run of the key waiting for it gets it at the job's next "
            f"checkpoint tick, or when the job next starts"
        )
    return EXIT_OK
