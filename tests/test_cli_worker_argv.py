"""A supervised `ratchet run` starts its worker with every option the user passed: the worker's
command line is derived from the parser, so this test sets every `run` option automatically."""

from __future__ import annotations

import argparse
import sys

from ratchet.cli import _agents, build_parser


def _non_default(action: argparse.Action) -> list[str]:
    opt = action.option_strings[-1]
    if isinstance(action, argparse._StoreTrueAction):
        return [opt]
    if action.choices:
        return [opt, next(c for c in action.choices if c != action.default)]
    if action.type in (int, _agents._workers_arg, _agents._port):  # a number (or auto)
        return [opt, str((action.default or 0) + 7)]
    if action.type is float:
        return [opt, repr((action.default or 0.0) + 0.25)]
    return [opt, f"value-of-{action.dest}"]


def test_the_worker_gets_every_run_option_but_supervision() -> None:
    parser = build_parser("run")
    argv = ["-v", "run", "pkg.mod:Agent"]
    run_actions = [a for a in _agents._RUN_PARSER._actions if a.option_strings]  # type: ignore[union-attr]
    for action in run_actions:
        if isinstance(action, argparse._HelpAction):
            continue
        argv += _non_default(action)
    args = parser.parse_args(argv)
    worker = _agents._worker_argv(args)
    assert worker[:3] == [sys.executable, "-m", "ratchet.cli"]
    again = build_parser("run").parse_args(worker[3:])
    expected = {k: v for k, v in vars(args).items() if k not in _agents._SUPERVISION_DESTS}
    got = {k: v for k, v in vars(again).items() if k not in _agents._SUPERVISION_DESTS}
    assert got == expected
    # Supervision options stay with the supervisor: a worker that supervised would fork again.
    assert "--supervise" not in worker and "--rest-port" not in worker
    assert not again.supervise
