"""The fused path for inline actions (issue 19) gives what the generic path gives.

The embedded engine (and the Flink core, below) runs an inline action without a retry policy at dispatch and commits it
at once, making the task's durable-call journal only if the action makes a call. Here the
crash-equivalence suite's generator draws agents (inline, threaded and async actions, chains
and fan-out, durable calls, failures and error handlers, memory writes of every admitted
type, outputs) and each is run twice in this process: through the fused path, and through
the generic one (a binding that offers no fused runner). Both must store the same bytes for
every key's memory, the same traces (without their timings), the same dead letters, and
write the same outputs, in the same order within each run.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ratchet import EngineConfig
from ratchet.agents._run import Job, run_owned
from ratchet.runtime._journal import encode_memory
from ratchet.store._sqlite import DB_NAME
from ratchet.store._traces import unpack_trace

# `import crash_equiv` (appended: nothing of tests/kill shadows another test folder's modules)
sys.path.append(str(Path(__file__).resolve().parent.parent / "kill"))

from crash_equiv import Case, Features, cases, render_agent, render_inputs  # noqa: E402
from crash_equiv.oracle import compare_outputs, read_outputs  # noqa: E402
from crash_equiv.render import AGENT_CLASS  # noqa: E402
from crash_equiv.run import TASK_BUDGET  # noqa: E402

from support.engines import FlinkSim  # noqa: E402

# Timings differ between any two runs; everything else of a trace is the run's own.
_TIMINGS = frozenset(("started", "duration", "at"))


def _untimed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in _TIMINGS}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _stored(state: Path) -> dict[str, Any]:
    """What the state holds once the job is done, as comparable values."""
    db = sqlite3.connect(state / DB_NAME)
    try:
        keys = db.execute("SELECT key, next_dispatch, memory FROM keys ORDER BY key").fetchall()
        traces = [
            (key, seq, status, _untimed(unpack_trace(blob)[1]))
            for key, seq, status, blob in db.execute(
                "SELECT key_text, seq, status, trace FROM traces ORDER BY key_text, seq"
            )
        ]
        dead = db.execute(
            "SELECT key, seq, event, reason FROM dead_letters ORDER BY seq, reason"
        ).fetchall()
        left = {
            table: db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # noqa: S608
            for table in ("inputs", "runs", "outbox")
        }
    finally:
        db.close()
    return {"keys": keys, "traces": traces, "dead": dead, "left": left}


def _run(case: Case, agent_cls: Any, where: Path, fused: bool) -> tuple[list[Any], dict[str, Any]]:
    where.mkdir()
    (where / "in.jsonl").write_text(render_inputs(case))
    job = Job(
        agent_cls(),
        inputs=str(where / "in.jsonl"),
        output=str(where / "out.jsonl"),
        state_dir=where / "state",
        config=EngineConfig(
            checkpoint_interval=case.interval_ms / 1000,
            max_concurrent_runs=case.max_runs,
            max_tasks_per_run=TASK_BUDGET,
        ),
    )
    if not fused:
        job.binding.inline_runner = None  # type: ignore[method-assign]  # the generic path
    run_owned(job)
    return read_outputs(where / "out.jsonl"), _stored(where / "state")


def _agent(case: Case) -> Any:
    module = types.ModuleType("fused_path_agent")  # one name: each case redefines its events
    sys.modules[module.__name__] = module  # where pydantic resolves the fields' annotations
    exec(compile(render_agent(case), "<generated agent>", "exec"), module.__dict__)  # noqa: S102
    return getattr(module, AGENT_CLASS)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=cases(features=Features(), max_inputs=6, max_kills=0), sync_inline=st.booleans())
def test_the_fused_path_stores_what_the_generic_path_stores(
    case: Case, sync_inline: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if sync_inline:  # every sync action inline (their steps are the same): more fused runs
        actions = tuple(
            dataclasses.replace(a, mode="inline") if a.mode == "thread" else a for a in case.actions
        )
        case = dataclasses.replace(case, actions=actions)
    agent_cls = _agent(case)
    base = tmp_path_factory.mktemp("fused")
    ref_out, ref_state = _run(case, agent_cls, base / "generic", fused=False)
    got_out, got_state = _run(case, agent_cls, base / "fused", fused=True)
    diffs = compare_outputs(ref_out, got_out, ordered=True)
    assert not diffs, f"{diffs}\n{render_agent(case)}"
    assert got_state == ref_state, render_agent(case)
    if all(a.mode == "inline" for a in case.actions) and case.max_runs == 1:
        # One run at a time, all inline: the two paths write the very same lines.
        assert got_out == ref_out
    assert json.dumps(ref_state["left"]) == json.dumps({"inputs": 0, "runs": 0, "outbox": 0})


def _encoded(memories: dict[Any, Any]) -> dict[Any, bytes]:
    return {key: encode_memory(memory) for key, memory in memories.items()}


def _flink(agent_cls: Any, case: Case, fused: bool) -> tuple[list[Any], dict[Any, Any], Any]:
    """The case through the Flink core (as the PyFlink operator drives it), fused or not."""
    sim = FlinkSim(agent_cls())
    if not fused:
        sim.core.binding.inline_runner = None  # type: ignore[attr-defined]  # the generic path
    try:
        for key, v in case.inputs:
            sim.element(key, {"key": key, "v": v})
            sim.poll()
        sim.end()
        slots = {k: dataclasses.astuple(sim.state._slots[k]) for k in sim.state.keys()}
        return sim.outputs, sim.memory(), slots
    finally:
        sim.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=cases(features=Features(), max_inputs=6, max_kills=0), sync_inline=st.booleans())
def test_the_flink_cores_fused_path_gives_what_its_generic_path_gives(
    case: Case, sync_inline: bool
) -> None:
    """The Flink core takes the same fused path: the same outputs (each run's in the same
    order), memories and keyed-state bytes as its generic path."""
    if sync_inline:
        actions = tuple(
            dataclasses.replace(a, mode="inline") if a.mode == "thread" else a for a in case.actions
        )
        case = dataclasses.replace(case, actions=actions)
    agent_cls = _agent(case)
    ref_out, ref_mem, ref_slots = _flink(agent_cls, case, fused=False)
    got_out, got_mem, got_slots = _flink(agent_cls, case, fused=True)
    diffs = compare_outputs(ref_out, got_out, ordered=True)
    assert not diffs, f"{diffs}\n{render_agent(case)}"
    # As stored bytes: a memory may hold Decimal('NaN') or a float NaN, never equal to itself.
    assert _encoded(got_mem) == _encoded(ref_mem), render_agent(case)
    assert got_slots == ref_slots, render_agent(case)
    assert len(ref_out) == len(got_out)
