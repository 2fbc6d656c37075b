"""`ratchet trace`: what a completed run did, as a tree (docs/runtime.md, "Run traces")."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ratchet._argtypes import add_key_type, whole_number
from ratchet._errors import EXIT_OK, ConfigError

# An input seq as the state stores it: a whole number from 0 to 2**63 - 1.
seq_number = whole_number(0, (1 << 63) - 1, out_of_range="{n} is not an input seq (0 to 2**63 - 1)")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "trace",
        help="what a completed run of a key did: tasks, durable calls, model calls, memory",
        description="Print a completed run as a tree: its tasks in commit order (action, the "
        "event it heard, executed or replayed from the journal, start, duration, attempts), "
        "their durable calls (recorded or replayed, duration, error), model calls (tokens) "
        "and memory writes. Traces are kept per --trace-retention of `ratchet run`.",
    )
    p.add_argument("--state", required=True)
    p.add_argument("--key", required=True, help="the key, as `ratchet inspect` shows it")
    p.add_argument(
        "--seq", type=seq_number, default=None, help="the run's input seq (default: latest)"
    )
    add_key_type(p, unless=", unless --seq names the run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args: argparse.Namespace) -> int:
    from ratchet._state_api import read_traces, trace_key_type, undecodable_trace
    from ratchet.runtime._shards import int_text, state_dirs
    from ratchet.store._sqlite import DB_NAME, SqliteStore

    dirs = state_dirs(args.state)  # a sharded job: the key's runs are in its shard

    def held() -> set[str]:
        """The types of the keys of the text that the state holds, over every shard (the
        string key "1" and the integer key 1 may live in two)."""
        types: set[str] = set()
        for sdir in dirs:
            store = SqliteStore.open_readonly(sdir)
            try:
                types |= store.held_key_types(args.key)
            finally:
                store.close()
        return types

    key_type = trace_key_type(args.key, args.key_type, args.seq, held, args.state)
    found: list[dict[str, Any]] = []
    damaged: list[tuple[int, Path, Exception]] = []
    for sdir in dirs:
        store = SqliteStore.open_readonly(sdir)
        try:
            good, bad = read_traces(store, args.key, args.seq, key_type)
        finally:
            store.close()
        found += good
        damaged += [(seq, Path(sdir) / DB_NAME, exc) for seq, exc in bad]
    found.sort(key=lambda t: t["seq"], reverse=True)  # newest first, as one database gives
    # The run asked for (or the newest) is the one shown: an error if it is damaged; a
    # damaged older one does not hide it.
    newest_bad = max(damaged, key=lambda d: d[0], default=None)
    if newest_bad is not None and (not found or newest_bad[0] > found[0]["seq"]):
        seq, db, exc = newest_bad
        raise undecodable_trace(db, args.key, seq, exc) from exc
    if not found:
        # Asking for what is not there is a usage error (exit 2), not failed work (exit 1).
        what = f"key {args.key!r}" if key_type is None else f"{key_type} key {args.key!r}"
        types = held()
        if not types or (key_type is not None and key_type not in types):
            raise ConfigError(
                f"{args.state} holds no {what}; `ratchet "
                f"inspect --state {args.state}` lists the keys (`ratchet dead-letters` those "
                f"whose runs ended in error)"
            )
        which = f"the {what}" if key_type is not None else what
        if args.seq is not None:
            which = f"input {args.seq} of {which}"
        raise ConfigError(
            f"no trace kept for {which} in {args.state} (runs in flight have none yet; older "
            f"ones go by --trace-retention)"
        )
    run = found[0]
    if args.json:
        print(json.dumps(run, indent=2, default=str))
        return EXIT_OK
    from rich.console import Console
    from rich.markup import escape as e
    from rich.tree import Tree

    starts = [t["started"] for t in run["tasks"] if t.get("started") is not None]
    origin = min(starts) if starts else None
    # Of the two keys of a text like "1", which one ran (a trace kept before types were
    # does not say).
    kind = f" ({run['key_type']})" if run.get("key_type") and int_text(run["key"]) else ""
    title = (
        f"[bold]key {e(str(run['key']))}{kind} input {run['seq']}[/]: {run['status']}, "
        f"{len(run['tasks'])} "
        f"task(s), completed {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(run['completed_at']))}"
    )
    tree = Tree(title)
    for t in run["tasks"]:
        tree_task(tree, t, origin)
    console = Console()
    if not console.is_terminal:  # piped: whole lines, not cut at 80 columns
        console = Console(width=1000)
    console.print(tree)
    return EXIT_OK


def _ms(seconds: Any) -> str:
    return f"{seconds * 1000:.1f} ms" if isinstance(seconds, int | float) else "?"


def tree_task(tree: Any, t: dict[str, Any], origin: float | None) -> None:
    """One task as tree nodes: rich markup is ratchet's own; every text of the user's (keys,
    events, values, errors, notes) is escaped, so `[bold]x` prints as it was stored."""
    from rich.markup import escape

    def e(value: Any) -> str:
        return escape(str(value))

    if t.get("replayed"):
        how = "[dim]replayed from the journal[/]"
    else:
        at = t.get("started")
        offset = f"+{_ms(at - origin)}" if origin is not None and at is not None else ""
        how = f"executed {offset}, took {_ms(t.get('duration'))}"
        if t.get("attempts"):
            how += f", in {t['attempts']} attempts"
    node = tree.add(
        f"[bold]{e(t['action'])}[/] on {e(t['on'])} ({e(t['task'])}, #{t['index']}): {how}"
    )
    for c in t.get("calls", []):
        state = "[dim]replayed[/]" if c.get("replayed") else f"{_ms(c.get('duration'))}"
        err = f" [red]{e(c['error'])}[/]" if c.get("error") else ""
        node.add(f"call {e(c['fn'])}: {state}{err}")
    for n in t.get("notes", []):
        fields = ", ".join(f"{k}={v}" for k, v in n.items() if k != "kind" and v is not None)
        node.add(f"{e(n['kind'])}: {e(fields)}")
    for op in t.get("memory", []):
        kind = {"s": "set", "d": "delete", "o": "new object", "e": "expire"}.get(op[0], op[0])
        value = f" = {op[2]!r}" if len(op) > 2 else ""
        node.add(f"memory {e(kind)} {e(op[1])}{e(value)}")
    if t.get("events"):
        node.add(f"sent {e(', '.join(t['events']))}")
