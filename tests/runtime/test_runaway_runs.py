"""Runs that would grow forever (issue 11, item 9): an ErrorEvent handler's own failure is not
delivered back to it; a run has a task budget and ends with a clear error output past it;
task ids stay bounded however deep a chain of events goes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ratchet
from ratchet import Agent, EngineConfig, ErrorEvent, Event, InputEvent, OutputEvent, action
from ratchet.runtime._machine import MAX_TASK_ID


class Boom(Event):
    event_name = "runaway.Boom"


class RaisingHandler(Agent):
    @action(InputEvent)
    def start(self, event: InputEvent, ctx: Any) -> None:
        raise ValueError("first failure")

    @action(ErrorEvent)
    def handle(self, event: ErrorEvent, ctx: Any) -> None:
        ctx.short_term_memory.set(
            "handled", [*ctx.short_term_memory.get("handled", []), event.action]
        )
        raise RuntimeError(f"the handler failed on {event.action}'s error")


def test_a_raising_error_handler_does_not_get_its_own_error_back(tmp_path: Path) -> None:
    got: list[dict[str, Any]] = []
    res = ratchet.run(
        RaisingHandler(), inputs=[{"key": "k"}], output=got.append, state_dir=tmp_path
    )
    assert res.runs_completed == 1
    assert [(r["error"]["action"], r["error"]["message"]) for r in got] == [
        ("handle", "the handler failed on start's error")
    ]
    assert (tmp_path / "ratchet.db").stat().st_size < 1_000_000


class PingPong(Agent):
    """Two handlers that each fail on the other's error: a loop only the budget ends."""

    @action(InputEvent)
    def start(self, event: InputEvent, ctx: Any) -> None:
        raise ValueError("start")

    @action(ErrorEvent)
    def ping(self, event: ErrorEvent, ctx: Any) -> None:
        raise ValueError("ping")

    @action(ErrorEvent)
    def pong(self, event: ErrorEvent, ctx: Any) -> None:
        raise ValueError("pong")


def test_a_run_past_its_task_budget_ends_with_an_error_output(tmp_path: Path) -> None:
    got: list[dict[str, Any]] = []
    res = ratchet.run(
        PingPong(),
        inputs=[{"key": "k"}, {"key": "j"}],
        output=got.append,
        state_dir=tmp_path,
        config=EngineConfig(max_tasks_per_run=60),
    )
    assert res.runs_completed == 2
    budget = [r for r in got if r["task"] == "r!budget"]
    assert sorted(r["key"] for r in budget) == ["j", "k"]  # the two runs race: any order
    assert budget[0]["error"]["type"] == "ratchet.TaskBudgetExceeded"
    assert "raise max_tasks_per_run (--max-tasks-per-run)" in budget[0]["error"]["message"]
    assert res.tasks_executed == 2 * 60
    # The failures that reached nobody before the budget ran out are outputs too: none is lost.
    assert all(r["output"] is None for r in got)


class Tick(Event):
    event_name = "runaway.Tick"
    n: int


class Deep(Agent):
    @action(InputEvent)
    def start(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(Tick(n=event.input["depth"]))

    @action(Tick, inline=True)
    def tick(self, event: Tick, ctx: Any) -> None:
        if event.n == 0:
            ctx.send_event(OutputEvent(output="bottom"))
        else:
            ctx.send_event(Tick(n=event.n - 1))


def test_task_ids_stay_bounded_down_a_deep_chain(tmp_path: Path) -> None:
    got: list[dict[str, Any]] = []
    ratchet.run(Deep(), inputs=[{"key": "k", "depth": 3000}], output=got.append, state_dir=tmp_path)
    assert [r["output"] for r in got] == ["bottom"]
    assert len(got[0]["task"]) <= MAX_TASK_ID + 40
    assert got[0]["task"].startswith("~")
