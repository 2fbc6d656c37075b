"""The embedded engine in one process: checkpoints, outputs, durable calls, failures."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet import (
    Agent,
    CheckpointError,
    EngineConfig,
    Event,
    InputEvent,
    Job,
    NonDeterminismError,
    OutputEvent,
    SinkError,
    action,
    open_state,
    run,
)
from ratchet.agents._context import AgentBinding, install_task_factory
from ratchet.agents._run import run_owned
from ratchet.runtime._engine import Engine, EngineResult
from ratchet.runtime._io import CallbackSink, IterableSource, JsonlSink
from ratchet.runtime._memops import from_wire
from ratchet.store import codec
from ratchet.store._base import CallRecord, CheckpointRows
from ratchet.store._faulty import FaultyStore
from ratchet.store._sqlite import SqliteStore


class Step(Event):
    n: int


class ThreeSteps(Agent):
    @action(InputEvent)
    def first(self, event: InputEvent, ctx: Any) -> None:
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(Step(n=n))

    @action(Step)
    async def second(self, event: Step, ctx: Any) -> None:
        ctx.sensory_memory.set("seen", event.n)
        ctx.send_event(OutputEvent(output={"id": event.n}))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_input_gives_one_output_with_a_stable_id(tmp_path: Path) -> None:
    inputs = [{"key": f"k{i % 3}", "i": i} for i in range(300)]
    result = run(
        ThreeSteps(), inputs=inputs, output=tmp_path / "out.jsonl", state_dir=tmp_path / "s"
    )
    out = read_jsonl(tmp_path / "out.jsonl")
    assert result.runs_completed == 300 and len(out) == 300
    assert len({o["id"] for o in out}) == 300
    assert {o["key"] for o in out} == {"k0", "k1", "k2"}
    # A second run over the same state and input does nothing new.
    again = run(
        ThreeSteps(), inputs=inputs, output=tmp_path / "out.jsonl", state_dir=tmp_path / "s"
    )
    assert again.inputs == 0 and len(read_jsonl(tmp_path / "out.jsonl")) == 300


def test_memory_survives_restart_with_exact_types(tmp_path: Path) -> None:
    class Blob(Agent):
        @action(InputEvent, inline=True)
        def keep(self, event: InputEvent, ctx: Any) -> None:
            ctx.short_term_memory.set("blob", b"\xff\xfe\x00raw")
            ctx.short_term_memory.set("pair", (1, "a"))
            ctx.short_term_memory.set("tags", {"x"})
            ctx.short_term_memory.set("count", ctx.short_term_memory.get("count", 0) + 1)

    for _ in range(2):
        run(Blob(), inputs=[{"key": "k"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    seen: list[Any] = []

    class Reader(Blob):
        @action(InputEvent, inline=True)
        def keep(self, event: InputEvent, ctx: Any) -> None:
            m = ctx.short_term_memory
            seen.append((m.get("blob"), m.get("pair"), m.get("tags"), m.get("count")))

    # Same action names: the state belongs to this agent too. A new input, fresh process state.
    run(
        Reader(),
        inputs=[{"key": "k"}, {"key": "k"}],
        output=tmp_path / "o.jsonl",
        state_dir=tmp_path / "s",
    )
    blob, pair, tags, count = seen[0]
    assert type(blob) is bytes and blob == b"\xff\xfe\x00raw"
    assert type(pair) is tuple and pair == (1, "a")
    assert type(tags) is set and tags == {"x"}
    assert count == 1  # the first input was done already; the second sees the first run's count


def test_checkpoint_completes_while_an_action_awaits_a_10_second_call(tmp_path: Path) -> None:
    entered = asyncio.Event()

    class Slow(Agent):
        @action(InputEvent)
        async def call(self, event: InputEvent, ctx: Any) -> None:
            ctx.short_term_memory.set("before", True)
            entered.set()
            await asyncio.sleep(10)

    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"key": "a"}\n{"key": "b"}\n')

    async def scenario() -> dict[str, Any]:
        parked_checkpoints = asyncio.Event()
        counts: list[int] = []

        def on_progress(engine: Any) -> None:
            if entered.is_set():
                counts.append(engine.stats.completed)
                if len(counts) >= 3:
                    parked_checkpoints.set()

        job = Job(
            Slow(),
            inputs=inputs,
            output=tmp_path / "o.jsonl",
            state_dir=tmp_path / "s",
            follow=True,
            config=EngineConfig(checkpoint_interval=0.02),
            on_progress=on_progress,
        )
        task = asyncio.create_task(job.run_async())
        await asyncio.wait_for(entered.wait(), 5)
        # Three checkpoints complete while both actions are parked in their 10 s call.
        await asyncio.wait_for(parked_checkpoints.wait(), 5)
        stats = job.engine.stats.as_dict()
        job.engine.request_stop()
        await asyncio.wait_for(task, 5)
        return stats

    stats = asyncio.run(scenario())
    assert stats["counts"]["completed"] >= 3 and stats["counts"]["failed"] == 0
    store = SqliteStore.open_readonly(tmp_path / "s")
    try:
        summary = store.summary()
    finally:
        store.close()
    # Both runs are captured as in flight, not drained and not lost.
    assert summary["in_flight_runs"] == 2
    assert summary["source"]["position"]["line"] == 2


class FaultyJob:
    """An engine over a `FaultyStore` around the job's SQLite store, as `ratchet.run` would
    build it (`Job` opens its own store, so the engine is put together here)."""

    def __init__(
        self,
        agent: Agent,
        *,
        state_dir: Path,
        seed: int,
        config: EngineConfig | None = None,
        store_type: type[FaultyStore] = FaultyStore,
    ) -> None:
        self.binding = AgentBinding(agent)
        self.config = config or EngineConfig()
        b = self.binding
        inner = SqliteStore.open(
            state_dir, b.name, b.fingerprint, b.action_names, synchronous=self.config.synchronous
        )
        self.store = store_type(inner, seed)

    def run(self, inputs: Any, output: Path | Callable[[dict[str, Any]], None]) -> EngineResult:
        sink = JsonlSink(output) if isinstance(output, Path) else CallbackSink(output)
        engine = Engine(self.binding, self.store, IterableSource(inputs), sink, self.config)

        async def main() -> EngineResult:
            install_task_factory(asyncio.get_running_loop())
            return await engine.run()

        try:
            return asyncio.run(main())
        finally:
            self.store.close()

    def why(self) -> str:
        """For assertion messages: what to replay a failure with."""
        return f"seed={self.store.seed} injected={self.store.injected}"


def test_failed_checkpoints_are_counted_and_retried_then_stop_the_job(tmp_path: Path) -> None:
    run(
        ThreeSteps(),
        inputs=[{"key": "k", "i": 0}],
        output=tmp_path / "o.jsonl",
        state_dir=tmp_path / "s",
    )
    job = FaultyJob(
        ThreeSteps(),
        state_dir=tmp_path / "s",
        seed=1,
        config=EngineConfig(checkpoint_interval=0.001),
    )
    job.store.fail("write_checkpoint", calls=[1, 2])
    # The same stream, continued: an iterable source resumes after the items it already took.
    items = [{"key": "k", "i": 0}] + [{"key": f"k{i % 4}", "i": i} for i in range(1, 201)]
    result = job.run(items, tmp_path / "o.jsonl")
    # Two failures were tolerated; every output still arrived exactly once.
    assert result.checkpoints["counts"]["failed"] == 2, job.why()
    assert result.runs_completed == 200, job.why()
    assert len(read_jsonl(tmp_path / "o.jsonl")) == 201, job.why()

    broken = FaultyJob(
        ThreeSteps(),
        state_dir=tmp_path / "s2",
        seed=2,
        config=EngineConfig(checkpoint_interval=0.001, tolerable_checkpoint_failures=3),
    )
    broken.store.fail("write_checkpoint", rate=1.0)
    with pytest.raises(CheckpointError, match=r"4 checkpoint\(s\) failed in a row.*intact"):
        broken.run(iter([{"key": "z", "i": i} for i in range(10)]), tmp_path / "o2.jsonl")
    for state, failed in ((tmp_path / "s", 2), (tmp_path / "s2", 4)):
        store = SqliteStore.open_readonly(state)
        try:
            assert store.summary()["checkpoints"]["counts"]["failed"] == failed, (
                f"{state.name}: {job.why()} / {broken.why()}"
            )
        finally:
            store.close()


def test_outputs_reach_the_sink_only_after_their_checkpoint(tmp_path: Path) -> None:
    written: list[str] = []
    order: list[str] = []

    class Tracking(FaultyStore):
        def write_checkpoint(self, rows: CheckpointRows, triggered_at: float) -> dict[str, Any]:
            info = super().write_checkpoint(rows, triggered_at)
            order.extend(f"checkpoint:{oid}" for oid, _, _ in rows.outbox)
            return info

    def sink(rec: dict[str, Any]) -> None:
        written.append(rec["id"])
        order.append(f"sink:{rec['id']}")

    job = FaultyJob(
        ThreeSteps(),
        state_dir=tmp_path / "s",
        seed=3,
        config=EngineConfig(checkpoint_interval=0.001, tolerable_checkpoint_failures=50),
        store_type=Tracking,
    )
    # Failed checkpoints too: their outputs wait for the next one that completes.
    job.store.fail("write_checkpoint", calls=[1], rate=0.3)
    job.run([{"key": "k", "i": i} for i in range(20)], sink)
    assert len(written) == 20, job.why()
    for oid in written:
        assert order.index(f"checkpoint:{oid}") < order.index(f"sink:{oid}"), job.why()


class Counting(Agent):
    """Inline: its runs are pure Python in the loop's thread, as a busy job's are."""

    @action(InputEvent, inline=True)
    def one(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("i", event.input["i"])
        ctx.send_event(OutputEvent(output={"i": event.input["i"]}))


@pytest.mark.parametrize("slow", ["write_checkpoint", "put_calls"])
def test_no_input_is_admitted_while_the_writer_works(tmp_path: Path, slow: str) -> None:
    """The writer's thread needs the GIL between every row it writes; a source loop admitting
    inline runs meanwhile starved it (a checkpoint due every 0.2 s took 12 s under load, and
    every output waited as long). Admission waits for it: at most one batch of inputs (64)
    is taken while a write is in progress, however long the write takes."""
    writing = threading.Event()
    taken_during: list[int] = []  # inputs read while each slow write was in progress

    class Slow(FaultyStore):
        def _slowly(self, method: str, *args: Any) -> Any:
            taken_during.append(0)
            writing.set()
            try:
                time.sleep(0.03)  # a slow disk: the GIL is free meanwhile
                return getattr(super(), method)(*args)
            finally:
                writing.clear()

        def write_checkpoint(self, rows: CheckpointRows, triggered_at: float) -> dict[str, Any]:
            if slow == "write_checkpoint":
                return self._slowly("write_checkpoint", rows, triggered_at)  # type: ignore[no-any-return]
            return super().write_checkpoint(rows, triggered_at)

        def put_calls(self, records: list[CallRecord]) -> None:
            if slow == "put_calls":
                self._slowly("put_calls", records)
            else:
                super().put_calls(records)

    def inputs() -> Iterator[dict[str, Any]]:
        for i in range(3000):
            if writing.is_set():
                taken_during[-1] += 1
            yield {"key": f"k{i % 10}", "i": i}

    class Calling(Agent):
        """A durable call every 50th input, so call records are written meanwhile."""

        @action(InputEvent)
        async def one(self, event: InputEvent, ctx: Any) -> None:
            i = event.input["i"]
            if i % 50 == 0:
                await ctx.durable_execute_async(double, i)
            ctx.send_event(OutputEvent(output={"i": i}))

    agent = Counting() if slow == "write_checkpoint" else Calling()
    job = FaultyJob(
        agent,
        state_dir=tmp_path / "s",
        seed=1,
        config=EngineConfig(checkpoint_interval=0.005),
        store_type=Slow,
    )
    out = tmp_path / "out.jsonl"
    job.run(inputs(), out)
    assert len(read_jsonl(out)) == 3000
    assert max(taken_during) <= 64, f"inputs read during each slow {slow}: {taken_during}"
    assert len(taken_during) >= 3, f"only {len(taken_during)} slow write(s): nothing measured"


def double(i: int) -> int:
    return 2 * i


class Doubling(Agent):
    """A durable call (so call records are written through) and memory that remembers order."""

    @action(InputEvent)
    async def first(self, event: InputEvent, ctx: Any) -> None:
        n = await ctx.durable_execute_async(double, event.input["i"])
        m = ctx.short_term_memory
        m.set("sum", m.get("sum", 0) + n)
        m.set("seen", [*m.get("seen", []), event.input["i"]])
        ctx.send_event(Step(n=n))

    @action(Step, inline=True)
    def second(self, event: Step, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output={"n": event.n}))


def outputs_and_memory(out: Path, state: Path) -> tuple[list[Any], dict[Any, Any]]:
    records = sorted(read_jsonl(out), key=lambda r: r["id"])
    for r in records:
        r.pop("job", None)  # the job id differs between the reference and the faulty job
    store = SqliteStore.open_readonly(state)
    try:
        memory = {codec.decode(k): from_wire(codec.decode(m)) for k, m in store.memories()}
    finally:
        store.close()
    return records, memory


@pytest.mark.parametrize("faulty", ["write_checkpoint", "put_calls"])
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_random_store_faults_below_the_tolerance_change_no_output_and_no_memory(
    tmp_path: Path, seed: int, faulty: str
) -> None:
    items = [{"key": f"k{i % 5}", "i": i} for i in range(60)]
    config = EngineConfig(checkpoint_interval=0.001, tolerable_checkpoint_failures=20)
    run(Doubling(), inputs=items, output=tmp_path / "ref.jsonl", state_dir=tmp_path / "ref")
    expected = outputs_and_memory(tmp_path / "ref.jsonl", tmp_path / "ref")

    job = FaultyJob(Doubling(), state_dir=tmp_path / "s", seed=seed, config=config)
    job.store.delay("put_calls", (0.0, 0.002), rate=0.3)
    job.store.fail(faulty, calls=[1], rate=0.2)
    if faulty == "write_checkpoint":
        job.store.fail(faulty, calls=[2], rate=0.1, after=True)  # committed, reported failed
    result = job.run(items, tmp_path / "o.jsonl")
    got = outputs_and_memory(tmp_path / "o.jsonl", tmp_path / "s")

    assert any(i.fault.startswith("fail") for i in job.store.injected), job.why()
    assert len(got[0]) == len({r["id"] for r in got[0]}) == len(items), job.why()
    assert got == expected, job.why()
    assert result.runs_completed == len(items), job.why()


def test_call_records_that_cannot_be_written_stop_the_job_not_the_action(tmp_path: Path) -> None:
    """A storage fault under a durable call is the engine's: retried up to the tolerance, then
    the job stops with CheckpointError — no action turns it into an error output — and the
    next start resumes from the last checkpoint to the same outputs and memory."""
    items = [{"key": f"k{i % 3}", "i": i} for i in range(12)]
    run(Doubling(), inputs=items, output=tmp_path / "ref.jsonl", state_dir=tmp_path / "ref")
    expected = outputs_and_memory(tmp_path / "ref.jsonl", tmp_path / "ref")
    config = EngineConfig(checkpoint_interval=0.001, tolerable_checkpoint_failures=2)
    job = FaultyJob(Doubling(), state_dir=tmp_path / "s", seed=5, config=config)
    job.store.fail("put_calls", calls=[4, 5, 6])  # three failures in a row: one past tolerance
    with pytest.raises(CheckpointError, match=r"durable-call records could not be written 3 time"):
        job.run(items, tmp_path / "o.jsonl")
    assert [i.call for i in job.store.injected if i.fault == "fail"] == [4, 5, 6], job.why()
    partial = (
        [r for r in read_jsonl(tmp_path / "o.jsonl")] if (tmp_path / "o.jsonl").exists() else []
    )
    assert all("error" not in r for r in partial), partial
    run(Doubling(), inputs=items, output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    assert outputs_and_memory(tmp_path / "o.jsonl", tmp_path / "s") == expected


class Calls(Agent):
    """Durable calls whose effects are counted outside ratchet's state."""

    log: list[str] = []

    @action(InputEvent)
    async def go(self, event: InputEvent, ctx: Any) -> None:
        value = await ctx.durable_execute_async(self.fetch, event.input["i"])
        try:
            ctx.durable_execute(self.explode, event.input["i"])
        except KeyError as exc:
            ctx.short_term_memory.set("error", str(exc))
        ctx.short_term_memory.set("value", value)

    def fetch(self, i: int) -> bytes:
        self.log.append(f"fetch {i}")
        return b"\x00" + bytes([i])

    def explode(self, i: int) -> None:
        self.log.append(f"explode {i}")
        raise KeyError(f"missing {i}")


def test_durable_calls_are_written_through_before_they_return(tmp_path: Path) -> None:
    Calls.log = []
    run(
        Calls(),
        inputs=[{"key": "k", "i": 7}],
        output=tmp_path / "o.jsonl",
        state_dir=tmp_path / "s",
    )
    assert Calls.log == ["fetch 7", "explode 7"]
    conn = sqlite3.connect(tmp_path / "s" / "ratchet.db")
    # The run completed and was checkpointed, so its call records were dropped with it.
    assert conn.execute("SELECT COUNT(*) FROM calls").fetchone()[0] == 0
    conn.close()


def test_replayed_durable_calls_return_recorded_values_and_raise_recorded_errors(
    tmp_path: Path,
) -> None:
    """A crash after both calls returned: the replay must not call either again."""
    Calls.log = []
    state = tmp_path / "s"
    captured: dict[str, Any] = {}

    class Crashing(Calls):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            await Calls.go(self, event, ctx)
            captured["task"] = ctx.task_id
            raise SystemExit("simulated crash after the calls")  # not an Exception: kills the job

    with pytest.raises(BaseException):  # noqa: B017, PT011 - any crash will do
        run(Crashing(), inputs=[{"key": "k", "i": 3}], output=tmp_path / "o.jsonl", state_dir=state)
    assert Calls.log == ["fetch 3", "explode 3"]
    Calls.log = []
    seen: dict[str, Any] = {}

    class Resumed(Calls):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            await Calls.go(self, event, ctx)
            seen["value"] = ctx.short_term_memory.get("value")
            seen["error"] = ctx.short_term_memory.get("error")

    result = run(
        Resumed(), inputs=[{"key": "k", "i": 3}], output=tmp_path / "o.jsonl", state_dir=state
    )
    assert Calls.log == []  # neither function ran again
    assert result.metrics == {"durable_calls.replayed": 2}
    assert type(seen["value"]) is bytes and seen["value"] == b"\x00\x03"
    assert seen["error"] == "'missing 3'"  # the recorded KeyError was raised again


def test_a_recorded_call_the_code_no_longer_makes_is_a_nondeterminism_error(
    tmp_path: Path,
) -> None:
    state = tmp_path / "s"

    class First(Agent):
        @action(InputEvent)
        def go(self, event: InputEvent, ctx: Any) -> None:
            ctx.durable_execute(str.upper, "a")
            raise SystemExit("crash")

    with pytest.raises(BaseException):  # noqa: B017, PT011
        run(First(), inputs=[{"key": "k"}], output=tmp_path / "o.jsonl", state_dir=state)

    class Second(Agent):
        @action(InputEvent)
        def go(self, event: InputEvent, ctx: Any) -> None:
            ctx.durable_execute(str.lower, "a")

    with pytest.raises(
        NonDeterminismError,
        match=r"task r>go: recorded durable call\(s\) #0 builtins\.str\.upper .* were not made again",
    ):
        run(Second(), inputs=[{"key": "k"}], output=tmp_path / "o.jsonl", state_dir=state)


def test_reconciler_is_asked_about_an_intent_without_a_result(tmp_path: Path) -> None:
    state = tmp_path / "s"
    calls: list[str] = []

    class Hang(Agent):
        @action(InputEvent)
        def go(self, event: InputEvent, ctx: Any) -> None:
            ctx.durable_execute(self.charge, 10, reconciler=self.lookup)

        def charge(self, amount: int) -> str:
            calls.append("charge")
            raise SystemExit("crash while the charge is in flight")

        def lookup(self, amount: int) -> str:
            calls.append("lookup")
            return "charged-already"

    with pytest.raises(BaseException):  # noqa: B017, PT011
        run(Hang(), inputs=[{"key": "k"}], output=tmp_path / "o.jsonl", state_dir=state)
    run(Hang(), inputs=[{"key": "k"}], output=tmp_path / "o.jsonl", state_dir=state)
    assert calls == ["charge", "lookup"]


def test_an_action_that_raises_becomes_an_error_output(tmp_path: Path) -> None:
    class Boom(Agent):
        @action(InputEvent)
        def go(self, event: InputEvent, ctx: Any) -> None:
            ctx.short_term_memory.set("touched", True)
            raise ValueError("bad order 7")

    run(Boom(), inputs=[{"key": "k"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    (rec,) = read_jsonl(tmp_path / "o.jsonl")
    assert rec["output"] is None
    assert rec["error"] == {
        "action": "go",
        "type": "builtins.ValueError",
        "message": "bad order 7",
        "event_type": "ratchet.InputEvent",
    }
    store = SqliteStore.open_readonly(tmp_path / "s")
    try:
        assert store.memories() == [] or b"touched" not in store.memories()[0][1]
    finally:
        store.close()


def test_input_admission_is_capped(tmp_path: Path) -> None:
    pulled = {"n": 0}
    peak = {"buffered": 0}

    def source() -> Any:
        for i in range(500):
            pulled["n"] += 1
            yield {"key": f"k{i % 50}", "i": i}

    class Watch(Agent):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            await asyncio.sleep(0.001)
            peak["buffered"] = max(peak["buffered"], pulled["n"] - event.input["i"])

    run(
        Watch(),
        inputs=source(),
        output=tmp_path / "o.jsonl",
        state_dir=tmp_path / "s",
        config=EngineConfig(max_buffered_inputs=40, max_concurrent_runs=8),
    )
    # The source is read no further ahead than the cap allows.
    assert 0 < peak["buffered"] <= 41
    assert pulled["n"] == 500


def test_sync_actions_do_not_stall_other_keys(tmp_path: Path) -> None:
    import threading

    release = threading.Event()
    done: list[str] = []

    class Blocking(Agent):
        @action(InputEvent)
        def go(self, event: InputEvent, ctx: Any) -> None:
            if event.input["key"] == "slow":
                assert release.wait(10)
            else:
                done.append(event.input["key"])
                if len(done) == 20:
                    release.set()

    inputs = [{"key": "slow"}] + [{"key": f"k{i}"} for i in range(20)]
    run(Blocking(), inputs=inputs, output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    assert len(done) == 20  # the fast keys finished while the slow one was blocked


def test_plain_asyncio_inside_actions_and_unawaited_tasks_are_cancelled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    Calls.log = []
    cancelled: list[str] = []
    leftovers: list[asyncio.Task[None]] = []

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append("forever")
            raise

    class Gather(Agent):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            a, b = await asyncio.gather(
                ctx.durable_execute_async(Calls().fetch, 1),
                asyncio.wait_for(ctx.durable_execute_async(Calls().fetch, 2), 5),
            )
            ctx.short_term_memory.set("ab", [a, b])
            leftovers.append(asyncio.create_task(forever()))  # started, never awaited
            await asyncio.sleep(0)

    with caplog.at_level("WARNING", logger="ratchet.agents"):
        run(Gather(), inputs=[{"key": "k"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    assert sorted(Calls.log) == ["fetch 1", "fetch 2"]
    assert cancelled == ["forever"] and leftovers[0].cancelled()
    assert "did not await; they were cancelled" in caplog.text


def test_staticmethod_actions_and_definition_order(tmp_path: Path) -> None:
    order: list[str] = []

    class Ping(Event):
        event_name = "tests.Ping"

    class Multi(Agent):
        @action(InputEvent, inline=True)
        @staticmethod
        def start(event: InputEvent, ctx: Any) -> None:
            ctx.send_event(Ping())

        @action(Ping, inline=True)
        def second(self, event: Ping, ctx: Any) -> None:
            order.append("second")

        @action(Ping, inline=True)
        @staticmethod
        def third(event: Ping, ctx: Any) -> None:
            order.append("third")

    run(Multi(), inputs=[{"key": "k"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    assert order == ["second", "third"]


def test_event_names_are_stable_and_collisions_are_refused() -> None:
    from ratchet import ConfigError
    from ratchet.agents._events import event_class

    class Shipped(Event):
        event_name = "orders.Shipped.v1"
        order_id: int

    assert event_class("orders.Shipped.v1") is Shipped
    with pytest.raises(ConfigError, match="event name 'orders.Shipped.v1' is used by"):
        type(
            "Other",
            (Event,),
            {"__module__": "elsewhere", "event_name": "orders.Shipped.v1", "__annotations__": {}},
        )


def test_actions_count_metrics_in_total_and_per_key(tmp_path: Path) -> None:
    class Counting(Agent):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            ctx.metrics.inc("orders")
            ctx.metrics.inc("amount", event.input["amount"])
            await ctx.durable_execute_async(str.upper, "x")

    agent = Counting()
    job = Job(
        agent,
        inputs=[{"key": "a", "amount": 5}, {"key": "b", "amount": 7}, {"key": "a", "amount": 1}],
        output=tmp_path / "o.jsonl",
        state_dir=tmp_path / "s",
    )
    result = asyncio.run(job.run_async())
    assert result.metrics == {"amount": 13, "durable_calls.made": 3, "orders": 3}
    assert job.binding.metrics.for_key("a") == {"amount": 6, "durable_calls.made": 2, "orders": 2}


class Hoarder(Agent):
    """Keeps (or outputs) a value as large as its input asks."""

    @action(InputEvent, inline=True)
    def keep(self, event: InputEvent, ctx: Any) -> None:
        size = event.input["size"]
        if event.input.get("where") == "output":
            ctx.send_event(OutputEvent(output="x" * size))
        else:
            ctx.short_term_memory.set("blob", b"x" * size)
            ctx.send_event(OutputEvent(output=size))


@pytest.mark.parametrize("where", ["memory", "output"])
def test_a_value_too_large_to_store_stops_at_once_naming_it_and_the_fix(
    tmp_path: Path, where: str
) -> None:
    # SQLite stores at most SQLITE_LIMIT_LENGTH bytes in one value (1e9 by default; lowered
    # here). Such a checkpoint was retried four times, then the job said "restart to resume",
    # and every restart redid the same runs into the same failure.
    inputs = [{"key": "small", "size": 10}, {"key": "big", "size": 60_000, "where": where}]
    job = Job(
        Hoarder(), inputs=inputs, output=tmp_path / "o.jsonl", state_dir=tmp_path / "s",
        config=EngineConfig(checkpoint_interval=60),
    )  # fmt: skip
    job.store.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 50_000)
    with pytest.raises(CheckpointError) as info:
        run_owned(job)
    message = str(info.value)
    if where == "memory":
        assert "the memory of key 'big' is 60,0" in message and "over the 50,000 bytes" in message
    else:
        assert "string or blob too big" in message
    assert "redone at restart" in message and "keep large data outside its memory" in message
    assert job.engine.stats.failed == 0, "it was retried"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "refunds",
            -1,
            r"ctx.metrics.inc\('refunds', value\): value must be a finite int or float >= 0.*got -1$",
        ),
        ("refunds", float("nan"), r"got nan$"),
        ("refunds", float("inf"), r"got inf$"),
        ("refunds", True, r"got True$"),
        ("refunds", "3", r"got '3'$"),
        (
            "chat.model_calls[gpt]",
            1,
            r"ctx.metrics.inc\('chat.model_calls\[gpt\]', value\): names starting with 'chat.'.*are ratchet's own counters; choose another name",
        ),
        ("durable_calls.made", 1, r"are ratchet's own counters"),
    ],
)
def test_metrics_inc_refuses_a_value_a_counter_cannot_take_and_ratchets_own_names(
    tmp_path: Path, name: str, value: Any, message: str
) -> None:
    """A negative, NaN, infinite, bool or str value, or a name ratchet counts itself under
    (it would show as ratchet's model metrics in /metrics), fails the action with a message
    naming ctx.metrics.inc; nothing is counted."""

    class Counting(Agent):
        @action(InputEvent)
        async def go(self, event: InputEvent, ctx: Any) -> None:
            ctx.metrics.inc("fine", 2.5)
            ctx.metrics.inc(name, value)

    job = Job(
        Counting(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s"
    )
    result = asyncio.run(job.run_async())
    assert result.runs_failed == 1
    [line] = (tmp_path / "o.jsonl").read_text().splitlines()
    error = json.loads(line)["error"]
    assert error["type"] == "ratchet._errors.InvalidArgumentError"
    assert re.search(message, error["message"]), error["message"]
    assert result.metrics == {"fine": 2.5}


class FlakySink:
    """An output callback that refuses its first `fails` calls (a sink that is down)."""

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.got: list[dict[str, Any]] = []

    def __call__(self, record: dict[str, Any]) -> None:
        if self.fails:
            self.fails -= 1
            raise ConnectionError("sink down")
        self.got.append(record)


@pytest.mark.parametrize("fails", [2, 10_000])
def test_a_job_does_not_end_as_done_with_outputs_its_sink_refused(
    tmp_path: Path, fails: int
) -> None:
    # It logged "will retry after the next checkpoint" and returned as if done: exit 0 with
    # the outputs missing from the sink (kept in the outbox until some later run).
    inputs = [{"key": f"k{i}", "n": i} for i in range(3)]
    sink = FlakySink(fails)
    state = tmp_path / "s"
    if fails < 5:  # the sink comes back within the end's retries: every output, once
        run(Hoarder(), inputs=[dict(i, size=1) for i in inputs], output=sink, state_dir=state)
        assert sorted(r["output"] for r in sink.got) == [1, 1, 1]
        assert open_state(state).summary()["unreleased_outputs"] == 0
        return
    with pytest.raises(
        SinkError, match=r"3 output\(s\) .* \(ConnectionError: sink down\); they are kept"
    ):
        run(Hoarder(), inputs=[dict(i, size=1) for i in inputs], output=sink, state_dir=state)
    assert sink.got == []
    sink.fails = 0  # back: the next run writes them, once each
    run(Hoarder(), inputs=[dict(i, size=1) for i in inputs], output=sink, state_dir=state)
    assert sorted(r["output"] for r in sink.got) == [1, 1, 1]


def test_metric_names_and_keys_kept_in_memory_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A name per id (`orders.<id>`) and counters for every key ever counted grew without end
    # in a long-running job's memory (and on /metrics).
    from ratchet.runtime import _metrics

    monkeypatch.setattr(_metrics, "MAX_NAMES", 3)
    monkeypatch.setattr(_metrics, "MAX_KEYS", 2)

    class PerId(Agent):
        @action(InputEvent, inline=True)
        def go(self, event: InputEvent, ctx: Any) -> None:
            ctx.metrics.inc(f"seen.{event.input['id']}")
            ctx.metrics.inc("seen")

    inputs = [{"key": f"k{i}", "id": i} for i in range(5)]
    job = Job(PerId(), inputs=inputs, output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    result = asyncio.run(job.run_async())
    assert result.metrics == {
        "actions.metric_names_dropped": 3, "seen": 5, "seen.0": 1, "seen.1": 1,
    }  # fmt: skip
    assert [r.message for r in caplog.records].count(
        next(r.message for r in caplog.records if "counter names already" in r.message)
    ) == 1
    assert job.binding.metrics.for_key("k0") == {}  # the oldest keys' counters went
    assert job.binding.metrics.for_key("k4") == {"actions.metric_names_dropped": 1, "seen": 1}
