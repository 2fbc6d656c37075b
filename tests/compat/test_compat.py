"""The Flink Agents compatibility layer, behaviour by behaviour."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import compat_fixtures as fixtures
import pytest
from pydantic import BaseModel

import ratchet
from ratchet.compat.flink_agents import to_ratchet
from ratchet.compat.flink_agents.api.agents.agent import Agent
from ratchet.compat.flink_agents.api.chat_message import ChatMessage, MessageRole
from ratchet.compat.flink_agents.api.decorators import action
from ratchet.compat.flink_agents.api.events.event import Event, InputEvent, OutputEvent
from ratchet.compat.flink_agents.api.events.event_type import EventType
from ratchet.compat.flink_agents.api.events.tool_event import ToolResponseEvent
from ratchet.compat.flink_agents.api.execution_environment import AgentsExecutionEnvironment
from ratchet.compat.flink_agents.api.memory_object import MemoryObject
from ratchet.compat.flink_agents.api.memory_reference import MemoryRef
from ratchet.compat.flink_agents.api.prompts.prompt import Prompt
from ratchet.compat.flink_agents.api.resource import ResourceDescriptor, ResourceType
from ratchet.compat.flink_agents.api.runner_context import RunnerContext
from ratchet.compat.flink_agents.runtime import _wire


def _run(agent: Agent, inputs: list[dict[str, Any]], **config: Any) -> list[dict[Any, Any]]:
    env = AgentsExecutionEnvironment.get_execution_environment()
    for k, v in config.items():
        env.get_config().set(k, v)
    out = env.from_list(inputs).apply(agent).to_list()
    env.execute()
    return out


# -- events -----------------------------------------------------------------------------------


def test_event_id_is_a_hash_of_the_content() -> None:
    a = Event(type="t", attributes={"x": 1})
    b = Event(type="t", attributes={"x": 1})
    c = Event(type="t", attributes={"x": 2})
    assert a.id == b.id != c.id
    assert a.id is not None and a.id.version == 3
    a.type = "u"
    assert a.id != b.id


def test_typed_event_from_event_keeps_the_id_and_checks_attributes() -> None:
    base = Event(type=InputEvent.EVENT_TYPE, attributes={"input": 7})
    typed = InputEvent.from_event(base)
    assert (typed.input, typed.id) == (7, base.id)
    with pytest.raises(ValueError, match="no attribute.*'output'"):
        OutputEvent.from_event(Event(type="x"))


def test_event_types_are_strings_for_routing() -> None:
    assert EventType.InputEvent == "_input_event"
    assert EventType.ToolResponseEvent == ToolResponseEvent.EVENT_TYPE


def test_events_rebuild_as_their_class_with_their_values() -> None:
    to_ratchet(fixtures.ParcelAgent())  # registers the models of the agent's module
    sent = fixtures.Weighed(fixtures.Parcel(label="box", grams=5))
    back = _wire.to_flink(_wire.to_ratchet(sent))
    assert type(back) is fixtures.Weighed
    assert back.get_attr("parcel") == fixtures.Parcel(label="box", grams=5)
    assert back.id == sent.id


def test_uuid_keyed_attributes_round_trip() -> None:
    key = uuid.uuid4()
    sent = ToolResponseEvent(request_id=key, responses={key: 3})
    back = ToolResponseEvent.from_event(_wire.to_flink(_wire.to_ratchet(sent)))
    assert back.responses == {key: 3}
    assert back.request_id == key


def test_an_attribute_that_cannot_be_stored_is_refused_by_name() -> None:
    class Local(BaseModel):  # not in an agent's module, not registered
        n: int

    with pytest.raises(TypeError, match=r"attribute 'handle' of event 'odd'.*register_type"):
        _wire.to_ratchet(Event(type="odd", attributes={"handle": Local(n=1)}))


# -- the local environment ------------------------------------------------------------------


def test_outputs_come_in_input_order_with_aliases_and_generated_keys() -> None:
    inputs: list[dict[str, Any]] = []
    env = AgentsExecutionEnvironment.get_execution_environment()
    out = env.from_list(inputs).apply(fixtures.ParcelAgent()).to_list()
    inputs += [{"key": "a", "value": "x"}, {"k": "b", "v": "yy"}, {"value": "zzz"}]
    env.execute()
    assert out[:2] == [{"a": "X"}, {"b": "YY"}]
    ((generated, value),) = out[2].items()
    assert value == "ZZZ"
    assert uuid.UUID(generated)


def test_an_action_exception_propagates_out_of_execute() -> None:
    class Fails(Agent):
        @action(EventType.InputEvent)
        @staticmethod
        def boom(event: Event, ctx: RunnerContext) -> None:
            raise LookupError(f"no {InputEvent.from_event(event).input}")

    with pytest.raises(LookupError, match="no thing"):
        _run(Fails(), [{"key": "a", "value": "thing"}])


def test_the_environment_runs_once_with_one_agent_and_one_list() -> None:
    env = AgentsExecutionEnvironment.get_execution_environment()
    builder = env.from_list([])
    with pytest.raises(RuntimeError, match="from_list"):
        env.from_list([])
    builder.apply(fixtures.ParcelAgent())
    with pytest.raises(RuntimeError, match="one agent"):
        builder.apply(fixtures.ParcelAgent())
    env.execute()
    with pytest.raises(RuntimeError, match="execute"):
        env.execute()


def test_an_input_without_a_value_is_refused_naming_it() -> None:
    with pytest.raises(RuntimeError, match="input 0 has no 'value'"):
        _run(fixtures.ParcelAgent(), [{"key": "a"}])


# -- memory, context ------------------------------------------------------------------------


class MemoryAgent(Agent):
    @action(EventType.InputEvent)
    @staticmethod
    def remember(event: Event, ctx: RunnerContext) -> None:
        stm = ctx.short_term_memory
        count = (stm.get("stats.count") or 0) + 1
        ref = stm.set("stats.count", count)
        stm.new_object("stats.inner").set("deep", True)
        fields = stm.get("stats").get_fields()
        assert isinstance(stm.get("stats"), MemoryObject)
        ctx.sensory_memory.set("note", "per run")
        ctx.send_event(Event(type="check", attributes={"ref": ref, "fields": fields}))

    @action("check")
    @staticmethod
    def check(event: Event, ctx: RunnerContext) -> None:
        ref = event.get_attr("ref")
        assert isinstance(ref, MemoryRef)
        names = ctx.short_term_memory.get_field_names()
        ctx.send_event(
            OutputEvent(
                output=[
                    ctx.key,
                    ctx.short_term_memory.get(ref),
                    ref.path,
                    event.get_attr("fields"),
                    names,
                    ctx.sensory_memory.get("note"),
                    ctx.short_term_memory.is_exist("stats.nope"),
                ]
            )
        )


def test_memory_objects_refs_and_fields() -> None:
    out = _run(MemoryAgent(), [{"key": "k", "value": 1}, {"key": "k", "value": 2}])
    assert out == [
        {
            "k": [
                "k",
                1,
                "stats.count",
                {"count": 1, "inner": "NestedObject"},
                ["stats"],
                "per run",
                False,
            ]
        },
        {
            "k": [
                "k",
                2,
                "stats.count",
                {"count": 2, "inner": "NestedObject"},
                ["stats"],
                "per run",
                False,
            ]
        },
    ]


CALLS: list[str] = []


def _add(a: int, b: int) -> int:
    CALLS.append("add")
    return a + b


class DurableAgent(Agent):
    @action(EventType.InputEvent)
    @staticmethod
    async def compute(event: Event, ctx: RunnerContext) -> None:
        x = InputEvent.from_event(event).input
        s = ctx.durable_execute(_add, x, 1, reconciler=lambda: -1)
        t = await ctx.durable_execute_async(_add, s, 10)
        ctx.send_event(OutputEvent(output=t))


def test_durable_execute_and_its_async_form() -> None:
    CALLS.clear()
    assert _run(DurableAgent(), [{"key": "a", "value": 1}]) == [{"a": 12}]
    assert CALLS == ["add", "add"]


def test_the_reconciler_takes_no_arguments() -> None:
    from ratchet.compat.flink_agents.runtime._adapter import _no_args

    reconcile = _no_args(lambda: "asked")
    assert reconcile is not None
    assert reconcile(1, 2, x=3) == "asked"


# -- resources and chat ---------------------------------------------------------------------


def test_resource_descriptor_takes_a_dotted_path_and_keeps_arguments() -> None:
    d = ResourceDescriptor(clazz="compat_fixtures.EchoSetup", connection="c", model="m")
    assert d.clazz is fixtures.EchoSetup
    assert d.arguments == {"connection": "c", "model": "m"}
    with pytest.raises(ValueError, match="clazz='package.module.Class'"):
        ResourceDescriptor(clazz="NoModule")


def test_prompt_from_text_is_a_system_message_and_keeps_missing_arguments() -> None:
    (msg,) = Prompt.from_text("hi {name}, {other}").format_messages(name="Ann")
    assert (msg.role, msg.content) == (MessageRole.SYSTEM, "hi Ann, {other}")
    msgs = Prompt.from_messages(
        [ChatMessage(role=MessageRole.USER, content="{q}?")]
    ).format_messages(q="why")
    assert [(m.role, m.content) for m in msgs] == [(MessageRole.USER, "why?")]


def test_chat_tool_loop_with_an_injected_argument() -> None:
    fixtures.MODEL_CALLS.clear()
    env = AgentsExecutionEnvironment.get_execution_environment()
    env.get_config().set_int("factor", 10)
    out = env.from_list([{"key": "q", "value": "four"}]).apply(fixtures.ToolAgent()).to_list()
    env.execute()
    assert out == [{"q": "result 40"}]
    (request,) = env.get_tool_request_events()  # type: ignore[attr-defined]
    assert request.get_attr("tool_calls")[0]["function"] == {
        "name": "double",
        "arguments": {"n": 4},
    }
    assert fixtures.MODEL_CALLS == [2, 4]  # prompt + question; then + reply + tool result


def test_a_missing_injected_config_value_is_reported_to_the_model() -> None:
    out = _run(fixtures.ToolAgent(), [{"key": "q", "value": "four"}])
    assert out == [{"q": "result Tool `double` execute failed."}]


def test_tool_metadata_hides_injected_arguments() -> None:
    from ratchet.compat.flink_agents.api.tools.tool import Tool

    t = Tool.from_callable(fixtures.ToolAgent.double)
    assert t.name == "double"
    assert t.metadata is not None
    assert list(t.metadata.get_parameters_dict()["properties"]) == ["n"]
    assert t.call(n=2, factor=3) == 6


def test_get_resource_in_an_action() -> None:
    class Uses(Agent):
        @action(EventType.InputEvent)
        @staticmethod
        def go(event: Event, ctx: RunnerContext) -> None:
            p = ctx.get_resource("greeting", ResourceType.PROMPT)
            ctx.send_event(OutputEvent(output=p.format_string(who="Bo")))  # type: ignore[attr-defined]

    agent = Uses().add_resource("greeting", ResourceType.PROMPT, Prompt.from_text("hi {who}"))
    assert _run(agent, [{"key": 1, "value": 0}]) == [{1: "hi Bo"}]


def test_an_unknown_resource_names_what_exists() -> None:
    class Asks(Agent):
        @action(EventType.InputEvent)
        @staticmethod
        def go(event: Event, ctx: RunnerContext) -> None:
            ctx.get_resource("nope", ResourceType.TOOL)

    with pytest.raises(ValueError, match="no tool resource named 'nope'"):
        _run(Asks(), [{"key": "a", "value": 0}])


def test_add_action_with_action_config() -> None:
    def shout(event: Event, ctx: RunnerContext) -> None:
        ctx.send_event(OutputEvent(output=ctx.get_action_config_value("mark")))

    agent = Agent().add_action("shout", [EventType.InputEvent], shout, mark="!")
    assert _run(agent, [{"key": "a", "value": 0}]) == [{"a": "!"}]


def test_importing_the_package_does_not_import_pyflink() -> None:
    code = (
        "import sys, ratchet.compat.flink_agents.api.execution_environment, "
        "ratchet.compat.flink_agents.runtime.local_execution_environment, "
        "ratchet.compat.flink_agents.api.events.event_type;"
        "print(any(m == 'pyflink' or m.startswith('pyflink.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- durability and the native path ---------------------------------------------------------


def test_a_durable_environment_resumes_without_running_done_work_again(tmp_path: Any) -> None:
    CALLS.clear()
    inputs = [{"key": "a", "value": 1}, {"key": "b", "value": 2}]
    first = AgentsExecutionEnvironment.get_execution_environment(state_dir=tmp_path)
    out1 = first.from_list(list(inputs)).apply(DurableAgent()).to_list()
    first.execute()
    again = AgentsExecutionEnvironment.get_execution_environment(state_dir=tmp_path)
    out2 = again.from_list(list(inputs)).apply(DurableAgent()).to_list()
    again.execute()
    assert out1 == out2 == [{"a": 12}, {"b": 13}]
    assert CALLS == ["add"] * 4  # two calls per input, in the first execute only


def test_to_ratchet_runs_on_ratchet_run_with_the_whole_record_as_input(tmp_path: Any) -> None:
    import ratchet

    class Echo(Agent):
        @action(EventType.InputEvent)
        @staticmethod
        def echo(event: Event, ctx: RunnerContext) -> None:
            record = InputEvent.from_event(event).input
            ctx.send_event(OutputEvent(output=record["text"] + "!"))

    got: list[Any] = []
    ratchet.run(
        to_ratchet(Echo()),
        inputs=[{"key": "a", "text": "hi"}],
        output=lambda rec: got.append(rec["output"]),
        state_dir=tmp_path,
    )
    assert got == ["hi!"]


def test_a_journaled_event_type_is_found_by_name_on_restore() -> None:
    from ratchet.agents._events import event_class

    cls = event_class("flink_agents:type-first-seen-in-a-journal")
    assert cls.event_name == "flink_agents:type-first-seen-in-a-journal"
    assert cls is _wire.wire_class("type-first-seen-in-a-journal")


def test_a_context_outside_a_job_calls_straight_through() -> None:
    from ratchet.compat.flink_agents.runtime.local_runner import LocalRunnerContext

    ctx = LocalRunnerContext.__new__(LocalRunnerContext)
    assert ctx.durable_execute(_add, 1, 2, reconciler=lambda: 99) == 3


def test_a_non_staticmethod_action_is_refused_with_the_fix() -> None:
    class Bad(Agent):
        @action(EventType.InputEvent)
        def act(self, event: Event, ctx: RunnerContext) -> None:
            pass

    with pytest.raises(ratchet.ConfigError, match="must be a @staticmethod"):
        to_ratchet(Bad())


def test_an_action_that_cannot_take_event_and_ctx_or_yields_is_refused_by_to_ratchet() -> None:
    class NoContext(Agent):
        @action(EventType.InputEvent)
        @staticmethod
        def act(event: Event) -> None:
            pass

    with pytest.raises(ratchet.ConfigError) as e:
        to_ratchet(NoContext())
    assert str(e.value).endswith(
        "<locals>.NoContext.act has parameters (event: 'Event') -> 'None', but an action is "
        "called with an event and a context: write (event, ctx) under @staticmethod"
    )

    class Yields(Agent):
        @action(EventType.InputEvent)
        @staticmethod
        def act(event: Event, ctx: RunnerContext) -> Any:
            yield OutputEvent(output=1)

    with pytest.raises(ratchet.ConfigError, match=r"Yields\.act is a generator function"):
        to_ratchet(Yields())

    added = Agent()
    added.add_action("one_arg", [EventType.InputEvent], lambda event: None)
    with pytest.raises(ratchet.ConfigError, match=r"Agent\.one_arg has parameters \(event\)"):
        to_ratchet(added)


def test_action_needs_type_strings() -> None:
    with pytest.raises(ValueError, match="event type strings"):
        action(InputEvent)  # type: ignore[arg-type]


def test_ratchet_run_cli_runs_a_converted_agent(tmp_path: Any) -> None:
    import json
    import os
    from pathlib import Path

    here = Path(__file__).parent
    (tmp_path / "in.jsonl").write_text('{"key": "k", "word": "a"}\n{"key": "k", "word": "b"}\n')
    cli = Path(sys.executable).with_name("ratchet")
    env = {**os.environ, "PYTHONPATH": f"{here}{os.pathsep}{here.parents[1] / 'src'}"}
    args = ["run", "cli_job:agent", "--input", "in.jsonl", "--output", "out.jsonl"]
    subprocess.run([str(cli), *args, "--state", "st"], cwd=tmp_path, env=env, check=True)
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(line)["output"] for line in lines] == ["a=1", "b=2"]


def test_the_documented_ratchet_run_command_works_from_the_jobs_directory(tmp_path: Any) -> None:
    # docs/flink-agents.md: my_job.py (importing my_agents.py beside it), run from that
    # directory by the `ratchet` script, whose sys.path does not hold the working directory.
    import json
    import os
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "flink-agents.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    greeter = next(b for b in blocks if "class Greeter(Agent)" in b).partition("\nenv =")[0]
    (tmp_path / "my_agents.py").write_text(greeter)
    (tmp_path / "my_job.py").write_text(next(b for b in blocks if b.startswith("# my_job.py")))
    (tmp_path / "in.jsonl").write_text('{"key": "a", "name": "Ann"}\n')
    command = re.search(r"^ratchet (run my_job\S* .*)$", doc, re.M)
    assert command is not None
    cli = Path(sys.executable).with_name("ratchet")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    proc = subprocess.run(
        [str(cli), *command.group(1).split()], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(line)["output"] for line in lines] == [
        "hello {'key': 'a', 'name': 'Ann'} (1)"
    ]


def test_an_input_that_cannot_be_stored_is_refused_before_the_run() -> None:
    with pytest.raises(TypeError, match=r"'input 1 value' is a <class 'object'>"):
        _run(fixtures.ParcelAgent(), [{"key": "a", "value": "ok"}, {"key": "b", "value": object()}])


def test_an_output_that_cannot_be_stored_fails_the_action_naming_it() -> None:
    class Stray(BaseModel):  # defined here: not in the agent's module, not registered
        n: int

    class Emits(Agent):
        @action(EventType.InputEvent)
        @staticmethod
        def go(event: Event, ctx: RunnerContext) -> None:
            ctx.send_event(OutputEvent(output=Stray(n=1)))

    with pytest.raises(TypeError, match=r"output of event '_output_event'.*register_type"):
        _run(Emits(), [{"key": "a", "value": 0}])


def test_a_prompt_argument_may_be_named_template() -> None:
    assert Prompt.from_text("use {template}").format_string(template="T") == "use T"


def test_extra_fields_of_an_event_travel_with_it() -> None:
    sent = Event(type="with-extra", attributes={"a": 1}, note="kept")
    back = _wire.to_flink(_wire.to_ratchet(sent))
    assert (back.get_attr("a"), back.note, back.id) == (1, "kept", sent.id)  # type: ignore[attr-defined]


def test_a_flink_environment_without_pyflink_says_what_to_install() -> None:
    import importlib.util

    if importlib.util.find_spec("pyflink") is not None:
        pytest.skip("PyFlink is installed here")
    with pytest.raises(
        ModuleNotFoundError, match=r"needs PyFlink \(pip install 'ratchet\[flink\]'\)"
    ):
        AgentsExecutionEnvironment.get_execution_environment(env=object())
