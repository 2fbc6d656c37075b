"""The end of a bounded job whose sink's server is away (a NATS server restarting, a database
that does not answer): the job waits for it, as it does mid-run, instead of giving up after
five quick tries (about 3 s) with `SinkError` and exit 1. A sink that refuses for any other
reason still ends the job with `SinkError` after those tries (tests/runtime/test_engine.py).
A stop asked for while it waits ends the job with the outputs kept in the state.

The real servers (NATS, PostgreSQL, one process and two workers) are in
tests/connectors/test_connector_sink_away_at_end.py.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from ratchet import (
    Agent,
    InputEvent,
    Job,
    OutputEvent,
    ServerUnreachableError,
    action,
    open_state,
    run,
)
from ratchet.agents._run import run_owned
from ratchet.runtime import _engine

INPUTS = [{"key": f"k{i}", "n": i} for i in range(3)]


class Echo(Agent):
    @action(InputEvent, inline=True)
    def echo(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output=event.input["n"]))


class AwaySink:
    """An output callback whose server is away for its first `fails` calls."""

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.calls = 0
        self.got: list[dict[str, Any]] = []
        self.on_call: Any = None

    def __call__(self, record: dict[str, Any]) -> None:
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        if self.fails:
            self.fails -= 1
            raise ServerUnreachableError(
                "NATS at 127.0.0.1:4222 is away; the client reconnects",
                server="NATS",
                address="127.0.0.1:4222",
            )
        self.got.append(record)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_engine, "_LEFT_FIRST_DELAY", 0.002)
    monkeypatch.setattr(_engine, "_LEFT_MAX_DELAY", 0.02)


def test_the_end_of_the_input_waits_for_a_sink_whose_server_is_away(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Twenty refusals: four times what the end of a job tried before it raised SinkError.
    sink = AwaySink(fails=20)
    state = tmp_path / "s"
    with caplog.at_level(logging.WARNING, logger="ratchet"):
        result = run(Echo(), inputs=INPUTS, output=sink, state_dir=state)
    assert sorted(r["output"] for r in sink.got) == [0, 1, 2]
    assert result.outputs == 3
    assert open_state(state).summary()["unreleased_outputs"] == 0
    said = caplog.text
    assert "the input is done, but NATS at 127.0.0.1:4222 is away" in said, said
    assert "waiting for it to take the last 3 output(s) before the job ends" in said, said
    assert "the sink took the outputs it was waiting for" in said, said


def test_a_stop_while_it_waits_keeps_the_outputs_for_the_next_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = AwaySink(fails=10_000)
    state = tmp_path / "s"
    job = Job(Echo(), inputs=INPUTS, output=sink, state_dir=state)
    asked = threading.Event()

    def stop_after_many(calls: int) -> None:
        # Called in the sink's thread; well past the five tries of a plain refusal.
        if calls == 12 and not asked.is_set():
            asked.set()
            loop = job.engine._loop
            assert loop is not None
            loop.call_soon_threadsafe(job.engine.request_stop, "signal SIGTERM")

    sink.on_call = stop_after_many
    with caplog.at_level(logging.WARNING, logger="ratchet"):
        result = run_owned(job)
    assert asked.is_set()
    assert result.stopped_by == "signal SIGTERM"
    assert sink.got == []
    assert "3 output(s) the sink refused (ServerUnreachableError: " in caplog.text
    assert open_state(state).summary()["unreleased_outputs"] == 3
    back = AwaySink(fails=0)  # the server is back: the next run writes them, once each
    run(Echo(), inputs=INPUTS, output=back, state_dir=state)
    assert sorted(r["output"] for r in back.got) == [0, 1, 2]
    assert open_state(state).summary()["unreleased_outputs"] == 0
