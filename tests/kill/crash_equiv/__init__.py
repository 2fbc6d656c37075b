"""A generative crash-equivalence suite for ratchet agents.

Hypothesis draws a `Case` (an agent spec, its inputs, a checkpoint interval and a kill
schedule), `render` writes it as a real agent module, and `run_case` runs it in real
`ratchet run` processes: once without crashes (the reference), once with SIGKILLs at the
schedule's points, restarting the same command until it exits 0. `compare` then holds the
crashed run to the reference: outputs exactly once with the same ids and the same order in
each run, committed memory equal with exact types, and nothing that a killed process had
committed (a journaled task, a recorded durable call, a completed input) executed again.

`Features` switches the parts of the generator that exercise defects being fixed (issue 11);
each one is on by default. The harness imports as `crash_equiv` (tests/kill on sys.path), and
the generated agents import `crash_equiv.agentlib` the same way, so that the types they store
in memory are registered in this process too.
"""

from crash_equiv.gen import cases
from crash_equiv.oracle import compare
from crash_equiv.render import render_agent, render_inputs
from crash_equiv.run import CaseRun, run_case
from crash_equiv.spec import Case, Features

__all__ = [
    "Case",
    "CaseRun",
    "Features",
    "cases",
    "compare",
    "render_agent",
    "render_inputs",
    "run_case",
]
