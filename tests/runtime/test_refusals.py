"""Bad input, bad state and bad values: clear errors that name the problem, nothing lost."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ratchet
from ratchet import Agent, InputEvent, OutputEvent, StateError, action, run
from ratchet.agents._memory import MemoryBuffer, MemoryObject
from ratchet.store._sqlite import DB_NAME, SCHEMA_VERSION, SqliteStore

RATCHET = [sys.executable, "-m", "ratchet.cli"]


class Echo(Agent):
    @action(InputEvent, inline=True)
    def echo(self, event: InputEvent, ctx: Any) -> None:
        ctx.short_term_memory.set("n", ctx.short_term_memory.get("n", 0) + 1)
        ctx.send_event(OutputEvent(output=event.input))


class Renamed(Agent):
    @action(InputEvent, inline=True)
    def shout(self, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output=event.input))


def test_public_names_are_pinned() -> None:
    assert ratchet.__all__ == sorted(ratchet.__all__)
    for name in ratchet.__all__:  # every public name resolves, the lazily loaded ones too
        assert getattr(ratchet, name) is not None
    assert ratchet.__all__ == [
        "Agent",
        "AnthropicChatModel",
        "BadInputError",
        "ChatAgent",
        "ChatError",
        "ChatMessage",
        "ChatModel",
        "ChatModelSetup",
        "ChatRequestEvent",
        "ChatResponseEvent",
        "CheckpointError",
        "Clock",
        "CodecError",
        "ConfigError",
        "CorruptDataError",
        "EngineConfig",
        "EngineResult",
        "ErrorEvent",
        "Event",
        "IncompatibleChangeError",
        "InputEvent",
        "InternalError",
        "InvalidArgumentError",
        "InvalidTypeError",
        "Job",
        "LegacyReceiptError",
        "LongTermMemory",
        "LongTermMemoryConfig",
        "MemoryObject",
        "MessageRole",
        "MigrationError",
        "ModelCallError",
        "NonDeterminismError",
        "OllamaChatModel",
        "OpenAIChatModel",
        "OutputEvent",
        "ProjectError",
        "Prompt",
        "PromptArgumentError",
        "RatchetError",
        "RateLimit",
        "ReActAgent",
        "ReceiptError",
        "ReplayedCallError",
        "Resource",
        "ResourceDescriptor",
        "ResourceType",
        "ResumeRefusedError",
        "Retry",
        "RetryPolicy",
        "RunnerContext",
        "ScriptedChatModel",
        "ServerUnreachableError",
        "SignalTimeout",
        "SinkError",
        "StageTimeoutError",
        "State",
        "StateError",
        "StateInUseError",
        "StateWriteError",
        "StructuredOutputError",
        "TokenBudget",
        "TokenBudgetExceededError",
        "TokenUsage",
        "Tool",
        "ToolApprovalRequestEvent",
        "ToolCall",
        "ToolContext",
        "ToolRequestEvent",
        "ToolResponseEvent",
        "TurnLimitError",
        "UnknownTypeError",
        "action",
        "chat_model_connection",
        "chat_model_setup",
        "chat_usage",
        "migration",
        "open_state",
        "prompt",
        "register_type",
        "run",
        "send_signal",
        "tool",
    ]


def memory() -> MemoryObject:
    return MemoryObject(MemoryBuffer({}, "short_term"))


def test_set_rejects_inadmissible_values_naming_the_path() -> None:
    class Custom:
        pass

    m = memory()
    with pytest.raises(TypeError, match=r"'order\.items\[1\]'.*Custom.*register"):
        m.set("order", {"items": [1, Custom()]})

    class MyBytes(bytes):
        pass

    with pytest.raises(TypeError, match=r"'blob'.*MyBytes"):
        m.set("blob", MyBytes(b"x"))

    @dataclasses.dataclass
    class Point:
        x: int

    with pytest.raises(TypeError, match=r"'p'.*Point.*register_type"):
        m.set("p", Point(1))
    assert m.keys() == []  # nothing half-written


def test_memory_paths_objects_and_read_your_writes() -> None:
    m = memory()
    m.set("order.total", 10)
    assert m.get("order.total") == 10
    order = m.get("order")
    assert isinstance(order, MemoryObject) and order.keys() == ["total"]
    order.set("items", [1, 2])
    items = m.get("order.items")
    items.append(3)  # a copy: memory changes only through set()
    assert m.get("order.items") == [1, 2]
    with pytest.raises(TypeError, match=r"cannot set memory path 'order\.total\.x'"):
        m.set("order.total.x", 1)
    m.new_object("cart")
    assert m.exists("cart") and m.get("cart").keys() == []
    with pytest.raises(ValueError, match="already exists"):
        m.new_object("cart")
    m.delete("order")
    assert not m.exists("order.total") and m.keys() == ["cart"]
    with pytest.raises(ValueError, match="empty segment"):
        m.set("a..b", 1)


def test_a_second_engine_on_one_state_directory_is_refused(tmp_path: Path) -> None:
    from ratchet.store._sqlite import StateLock

    lock = StateLock(tmp_path)
    lock.acquire()
    try:
        with pytest.raises(StateError, match=f"in use by pid {os.getpid()}"):
            run(Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=tmp_path)
    finally:
        lock.release()


def test_state_of_another_agent_is_refused_and_left_untouched(tmp_path: Path) -> None:
    run(Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    before = (tmp_path / "s" / DB_NAME).read_bytes()
    with pytest.raises(StateError, match=r"actions \['echo'\].*shout"):
        run(Renamed(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    assert (tmp_path / "s" / DB_NAME).read_bytes() == before


def test_state_of_an_unknown_schema_is_refused(tmp_path: Path) -> None:
    run(Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    store = SqliteStore.open(
        tmp_path / "s", "x", ratchet.agents._run.AgentBinding(Echo()).fingerprint, []
    )
    store._set_meta("schema_version", 99)
    store.close()
    with pytest.raises(
        StateError, match=rf"state schema 99; this ratchet reads schema {SCHEMA_VERSION}"
    ):
        run(Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupted_database_is_refused_naming_the_file(tmp_path: Path, damage: str) -> None:
    inputs = [{"key": f"k{i}"} for i in range(3000)]
    run(Echo(), inputs=inputs, output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    db = tmp_path / "s" / DB_NAME
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    data = db.read_bytes()
    if damage == "garbage":
        db.write_bytes(b"this is not sqlite" + data[18:])
    else:
        db.write_bytes(data[: len(data) // 2])
    damaged = db.read_bytes()
    with pytest.raises(StateError, match=rf"{db}.*(corrupted|integrity)"):
        run(Echo(), inputs=inputs, output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    assert db.read_bytes() == damaged  # nothing was overwritten


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RATCHET, *args], capture_output=True, text=True, cwd=cwd)


def _agent_file(tmp_path: Path) -> str:
    path = tmp_path / "echo_agent.py"
    path.write_text(
        "from ratchet import Agent, InputEvent, OutputEvent, action\n"
        "class Echo(Agent):\n"
        "    @action(InputEvent, inline=True)\n"
        "    def echo(self, event, ctx):\n"
        "        ctx.send_event(OutputEvent(output=event.input))\n"
    )
    return f"{path}:Echo"


def test_bad_input_stops_before_it_and_keeps_what_came_before(tmp_path: Path) -> None:
    agent = _agent_file(tmp_path)
    src = tmp_path / "in.jsonl"
    src.write_text('{"key": "a", "i": 1}\n{"key": "b", "i": 2}\n{not json\n{"key": "c", "i": 4}\n')
    args = [
        "run",
        agent,
        "--input",
        str(src),
        "--output",
        str(tmp_path / "o.jsonl"),
        "--state",
        str(tmp_path / "s"),
    ]
    proc = _cli(*args)
    assert proc.returncode == 3
    assert f"{src}:3: invalid JSON" in proc.stderr
    assert [
        json.loads(x)["output"]["i"] for x in (tmp_path / "o.jsonl").read_text().splitlines()
    ] == [1, 2]
    # Fix the line and run again: it resumes at line 3, nothing before is repeated.
    src.write_text(
        '{"key": "a", "i": 1}\n{"key": "b", "i": 2}\n{"key": "x", "i": 3}\n{"key": "c", "i": 4}\n'
    )
    proc = _cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert [
        json.loads(x)["output"]["i"] for x in (tmp_path / "o.jsonl").read_text().splitlines()
    ] == [1, 2, 3, 4]


def test_bad_input_can_be_skipped_and_a_missing_key_is_named(tmp_path: Path) -> None:
    agent = _agent_file(tmp_path)
    src = tmp_path / "in.jsonl"
    src.write_text('{"key": "a"}\n{"id": 2}\n[1]\n{"key": [1]}\n{"key": "d"}\n')
    proc = _cli(
        "run", agent, "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
        "--state", str(tmp_path / "s"), "--on-bad-input", "skip", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["bad_inputs"] == [
        f"{src}:2: missing key field 'key'",
        f"{src}:3: expected a JSON object, got list",
        f"{src}:4: key field 'key' is list; keys must be strings or integers",
    ]
    assert summary["runs_completed"] == 2


def test_cli_status_and_inspect(tmp_path: Path) -> None:
    run(
        Echo(),
        inputs=[{"key": "a"}, {"key": "a"}, {"key": 7}],
        output=tmp_path / "o.jsonl",
        state_dir=tmp_path / "s",
    )
    status = json.loads(_cli("status", "--state", str(tmp_path / "s"), "--json").stdout)
    assert status["keys"] == 2 and status["in_flight_runs"] == 0 and status["queued_inputs"] == 0
    assert status["checkpoints"]["counts"]["completed"] >= 1
    assert status["source"]["next_seq"] == 3
    assert json.loads(_cli("inspect", "--state", str(tmp_path / "s"), "--json").stdout) == {
        "7": {"n": 1},
        "a": {"n": 2},
    }
    missing = _cli("status", "--state", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no ratchet state" in missing.stderr


def test_cli_names_a_bad_agent_spec(tmp_path: Path) -> None:
    proc = _cli("run", "nocolon", "--input", "x", "--output", "y", "--state", str(tmp_path))
    assert proc.returncode == 2
    assert "must look like 'package.module:Class'" in proc.stderr


async def _later() -> int:
    return 1


@pytest.mark.parametrize("retried", [False, True])
def test_a_sync_action_that_returns_an_awaitable_fails_naming_the_fix(
    tmp_path: Path, retried: bool
) -> None:
    """Both ways a sync action is called (a first execution without retries takes a short
    path; with a retry policy, the retry loop) refuse an awaitable it returns, and close it."""
    from ratchet import Retry

    policy = Retry(max_attempts=2, initial_delay=0, on=(RuntimeError,)) if retried else None

    class Forgot(Agent):
        @action(InputEvent, retry=policy)
        def go(self, event: InputEvent, ctx: Any) -> Any:
            return _later()

    out = tmp_path / "out.jsonl"
    result = run(Forgot(), inputs=[{"key": "a"}], output=out, state_dir=tmp_path / "s")
    assert result.runs_failed == 1
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert (
        line["error"]["message"] == "sync action go returned an awaitable; declare it `async def`"
    )


class NoContext(Agent):
    @action(InputEvent)
    def go(self, event: InputEvent) -> None: ...


class NoSelf(Agent):
    @action(InputEvent)
    def go(event: InputEvent, ctx: Any) -> None: ...  # type: ignore[misc]  # noqa: N805


class Yields(Agent):
    @action(InputEvent)
    def go(self, event: InputEvent, ctx: Any) -> Any:
        yield OutputEvent(output=1)


class YieldsAsync(Agent):
    @action(InputEvent)
    async def go(self, event: InputEvent, ctx: Any) -> Any:
        yield OutputEvent(output=1)


@pytest.mark.parametrize(
    ("agent", "message"),
    [
        (
            NoContext,
            "action NoContext.go has parameters (self, event: 'InputEvent') -> 'None', but an "
            "action is called with an event and a context: write (self, event, ctx), or "
            "(event, ctx) under @staticmethod",
        ),
        (NoSelf, "action NoSelf.go has parameters (event: 'InputEvent', ctx: 'Any')"),
        (
            Yields,
            "action Yields.go is a generator function (it yields), and nothing iterates an "
            "action's result; send each event with ctx.send_event(...) instead of yield",
        ),
        (YieldsAsync, "action YieldsAsync.go is a generator function (it yields)"),
    ],
)
def test_an_action_that_cannot_take_event_and_ctx_or_yields_is_refused_at_load(
    tmp_path: Path, agent: type[Agent], message: str
) -> None:
    """Each of these failed every input into a dead letter (a generator: silently did
    nothing; an async one ran as a sync action)."""
    with pytest.raises(ratchet.ConfigError) as e:
        run(agent(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    assert str(e.value).startswith(message)
    assert not (tmp_path / "s").exists()


def test_the_cli_refuses_an_action_without_ctx_in_one_line_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bad_agent.py"
    path.write_text(
        "from ratchet import Agent, InputEvent, action\n"
        "class Bad(Agent):\n"
        "    @action(InputEvent)\n"
        "    def go(self, event):\n"
        "        pass\n"
    )
    (tmp_path / "in.jsonl").write_text('{"key": "a"}\n')
    proc = _cli(
        "run", f"{path}:Bad", "--input", str(tmp_path / "in.jsonl"),
        "--output", str(tmp_path / "o.jsonl"), "--state", str(tmp_path / "s"),
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == (
        "ratchet: error: action Bad.go has parameters (self, event), but an action is called "
        "with an event and a context: write (self, event, ctx), or (event, ctx) under "
        "@staticmethod\n"
    )


class EveryForm(Agent):
    """The forms an action may take: each sends one output."""

    @action(InputEvent)
    @staticmethod
    def static(event: InputEvent, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output="static"))

    @action(InputEvent)
    @classmethod
    def klass(cls, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output="classmethod"))

    @action(InputEvent)
    @classmethod
    async def klass_async(cls, event: InputEvent, ctx: Any) -> None:
        ctx.send_event(OutputEvent(output="async classmethod"))

    @action(InputEvent)
    def star(self, *args: Any, extra: int = 1) -> None:
        args[1].send_event(OutputEvent(output="*args"))

    @action(InputEvent)
    def defaulted(self, event: InputEvent, ctx: Any, more: int = 2) -> None:
        ctx.send_event(OutputEvent(output="default"))


def test_static_class_star_and_defaulted_actions_run(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    result = run(EveryForm(), inputs=[{"key": "a"}], output=out, state_dir=tmp_path / "s")
    assert result.runs_failed == 0
    assert sorted(json.loads(x)["output"] for x in out.read_text().splitlines()) == [
        "*args",
        "async classmethod",
        "classmethod",
        "default",
        "static",
    ]


@pytest.mark.parametrize("mode", ["thread", "inline", "async"])
def test_an_action_that_returns_a_value_fails_naming_it(tmp_path: Path, mode: str) -> None:
    """A returned OutputEvent was dropped without a word: no output, no error."""

    class Returns(Agent):
        if mode == "async":

            @action(InputEvent)
            async def go(self, event: InputEvent, ctx: Any) -> Any:
                return OutputEvent(output=1)

        else:

            @action(InputEvent, inline=mode == "inline")
            def go(self, event: InputEvent, ctx: Any) -> Any:
                return OutputEvent(output=1)

    out = tmp_path / "o.jsonl"
    result = run(Returns(), inputs=[{"key": "a"}], output=out, state_dir=tmp_path / "s")
    assert result.runs_failed == 1
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["output"] is None
    assert line["error"]["message"] == (
        "action go returned a value (OutputEvent), and an action's return value is not used; "
        "send it with ctx.send_event(...) and return None"
    )


def test_a_memory_object_sent_in_an_event_fails_saying_to_pass_to_dict(tmp_path: Path) -> None:
    """The message listed the admitted types; a memory view is sent by its .to_dict()."""

    class SendsView(Agent):
        @action(InputEvent)
        def go(self, event: InputEvent, ctx: Any) -> None:
            ctx.short_term_memory.set("p.x", 1)
            ctx.send_event(OutputEvent(output=ctx.short_term_memory.get("p")))

    out = tmp_path / "out.jsonl"
    result = run(SendsView(), inputs=[{"key": "a"}], output=out, state_dir=tmp_path / "s")
    assert result.runs_failed == 1
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["error"]["message"] == (
        "value at 'event ratchet.OutputEvent.output' is a MemoryObject (a view of memory, not "
        "a value); pass its .to_dict() (a plain-dict copy) instead"
    )
    m = memory()
    with pytest.raises(TypeError, match=r"'q\[0\]' is a MemoryObject.*\.to_dict\(\)"):
        m.set("q", [m.new_object("p")])


def test_a_bad_input_from_python_names_the_engine_config_setting(tmp_path: Path) -> None:
    """`ratchet.run()` was told to pass --on-bad-input skip, a flag of the CLI."""
    inputs = [{"key": "a"}, 1, {"key": "b"}]
    with pytest.raises(ratchet.BadInputError) as e:
        run(Echo(), inputs=inputs, output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    assert "config=EngineConfig(on_bad_input='skip')" in str(e.value)
    result = run(
        Echo(),
        inputs=inputs,
        output=tmp_path / "o.jsonl",
        state_dir=tmp_path / "s",
        config=ratchet.EngineConfig(on_bad_input="skip"),
    )
    assert result.bad_inputs == ["input item 2: expected a JSON object, got int"]


@pytest.mark.parametrize("static", [False, True])
def test_a_bare_action_decorator_says_how_to_write_it(static: bool) -> None:
    with pytest.raises(ratchet.ConfigError) as e:

        class Bare(Agent):
            if static:

                @action  # type: ignore[arg-type]
                @staticmethod
                def go(event: InputEvent, ctx: Any) -> None: ...

            else:

                @action  # type: ignore[arg-type]
                def go(self, event: InputEvent, ctx: Any) -> None: ...

    assert str(e.value) == (
        "@action needs the event types it handles: write @action(InputEvent) (or other Event "
        "subclasses) above test_a_bare_action_decorator_says_how_to_write_it.<locals>.Bare.go, "
        "not a bare @action"
    )


def test_run_inside_an_event_loop_is_refused_and_job_run_async_is_the_way(tmp_path: Path) -> None:
    """`ratchet.run()` in a running loop raised asyncio's RuntimeError after locking the state
    directory, and a second call found it 'in use by pid' this very process."""
    import asyncio

    async def main() -> ratchet.EngineResult:
        for _ in range(2):
            with pytest.raises(ratchet.ConfigError) as e:
                run(Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=state)
            assert "cannot be called from a running event loop" in str(e.value)
            assert "await ratchet.Job(agent, inputs=..., output=..., state_dir=...)" in str(e.value)
        assert not state.exists()
        job = ratchet.Job(
            Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=state
        )
        return await job.run_async()

    state = tmp_path / "s"
    assert asyncio.run(main()).runs_completed == 1
    assert json.loads((tmp_path / "o.jsonl").read_text())["output"] == {"key": "a"}


def test_a_job_whose_loop_cannot_start_lets_go_of_its_state(tmp_path: Path) -> None:
    import asyncio

    from ratchet.agents._run import Job, run_owned

    def build() -> Job:
        return Job(Echo(), inputs=[{"key": "a"}], output=tmp_path / "o.jsonl", state_dir=state)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="running event loop"):
            run_owned(build())

    state = tmp_path / "s"
    asyncio.run(main())
    assert run_owned(build()).runs_completed == 1  # the lock and the output were released


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "max_concurrent_runs",
            0,
            "--max-concurrent-runs (max_concurrent_runs=) must be at least 1, not 0",
        ),
        (
            "max_tasks_per_run",
            -2,
            "--max-tasks-per-run (max_tasks_per_run=) must be at least 1, not -2",
        ),
        ("sync_batch", 0, "(sync_batch=) must be at least 1, not 0"),
        (
            "tolerable_checkpoint_failures",
            -1,
            "(tolerable_checkpoint_failures=) must be at least 0",
        ),
    ],
)
def test_a_limit_out_of_range_is_named_alone_as_the_user_gave_it(
    field: str, value: int, message: str
) -> None:
    """The message named five settings at once (one of them no flag); -1 tolerable failures
    was accepted."""
    from ratchet import ConfigError, EngineConfig

    with pytest.raises(ConfigError) as e:
        EngineConfig(**{field: value}).validate()
    assert message in str(e.value)
    if field == "sync_batch":
        assert "--" not in str(e.value)


class KeepsItsCtx(Agent):
    """The first input's action keeps its ctx; the second one's uses that ctx."""

    kept: Any = None

    @action(InputEvent)
    def go(self, event: InputEvent, ctx: Any) -> None:
        if KeepsItsCtx.kept is None:
            KeepsItsCtx.kept = ctx
            ctx.short_term_memory.set("first", True)
            return
        refused = {}
        for what, use in (
            ("memory", lambda old: old.short_term_memory.set("late", 1)),
            ("sensory", lambda old: old.sensory_memory.set("late", 1)),
            ("event", lambda old: old.send_event(OutputEvent(output="late"))),
            ("call", lambda old: old.durable_execute(str.upper, "stale")),
        ):
            try:
                use(KeepsItsCtx.kept)
            except Exception as exc:  # noqa: BLE001 - what the stale ctx raised
                refused[what] = f"{type(exc).__name__}: {exc}"
        ctx.send_event(OutputEvent(output=refused))


def test_a_ctx_used_after_its_action_returned_is_refused_not_silently_dropped(
    tmp_path: Path,
) -> None:
    # Its memory writes and events vanished, and its durable call left a record of a
    # completed run in the state that no checkpoint ever deleted.
    KeepsItsCtx.kept = None
    out: list[dict[str, Any]] = []
    run(KeepsItsCtx(), inputs=[{"key": "a"}, {"key": "b"}], output=out.append,
        state_dir=tmp_path / "s")  # fmt: skip
    (refused,) = [o["output"] for o in out]
    assert sorted(refused) == ["call", "event", "memory", "sensory"], refused
    for what, message in refused.items():
        assert message.startswith(
            "InvalidArgumentError: the ctx of action go (key 'a', input 0) was used after the "
            "action returned"
        ), (what, message)
    conn = sqlite3.connect(tmp_path / "s" / "ratchet.db")
    try:
        assert conn.execute("SELECT COUNT(*) FROM calls").fetchone()[0] == 0
    finally:
        conn.close()


class Greets(Agent):
    @action(InputEvent, inline=True)
    def greet(self, event: InputEvent, ctx: Any) -> None:
        n = ctx.short_term_memory.get("n", 0) + 1
        ctx.short_term_memory.set("n", n)
        ctx.send_event(OutputEvent(output=f"hello {event.input['name']} ({n})"))


@pytest.mark.parametrize("changed", ["first", "last"])
def test_an_edited_input_list_is_refused_and_an_extended_one_resumes(
    tmp_path: Path, changed: str
) -> None:
    # The edited items were skipped silently as "already taken" (the CLI refuses a different
    # input file; a Python list was taken for the one it replaced).
    out: list[Any] = []
    first = [{"key": "a", "name": "Ann"}, {"key": "b", "name": "Bo"}, {"key": "c", "name": "Cy"}]
    run(Greets(), inputs=first, output=out.append, state_dir=tmp_path / "s")
    edited = [dict(x) for x in first]
    edited[0 if changed == "first" else -1]["name"] = "Zed"
    with pytest.raises(ratchet.ConfigError, match=r"item (1|3) is not the item it took there"):
        run(Greets(), inputs=[*edited, {"key": "d", "name": "Di"}], output=out.append,
            state_dir=tmp_path / "s")  # fmt: skip
    run(Greets(), inputs=[*first, {"key": "a", "name": "Ann"}], output=out.append,
        state_dir=tmp_path / "s")  # fmt: skip
    assert [o["output"] for o in out] == [
        "hello Ann (1)", "hello Bo (1)", "hello Cy (1)", "hello Ann (2)",
    ]  # fmt: skip


_SAME_LIST = """
import sys
from ratchet import Agent, InputEvent, OutputEvent, action, run

class Tags(Agent):
    @action(InputEvent, inline=True)
    def go(self, event, ctx):
        ctx.send_event(OutputEvent(output=sorted(event.input["tags"])))

items = [{"key": k, "tags": {f"t{i}" for i in range(20)}} for k in ("a", "b")]
run(Tags(), inputs=items[: int(sys.argv[2])], output=sys.argv[1] + "/o.jsonl",
    state_dir=sys.argv[1] + "/s")
"""


def test_the_same_input_list_holding_sets_resumes_in_another_process(tmp_path: Path) -> None:
    # The digests were of codec.encode, whose set order follows the hash seed: a restart of
    # the same list in a new process was refused as an edited one.
    script = tmp_path / "same.py"
    script.write_text(_SAME_LIST)
    for seed, count in (("1", 1), ("2", 2), ("3", 2)):
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path), str(count)],
            env=dict(os.environ, PYTHONHASHSEED=seed), capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2
