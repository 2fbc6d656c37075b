"""A Flink Agents-style agent run by the local environment on a state directory, for the
SIGKILL test: `python kill_script.py STATE WORK [pause]`.

Each input is charged once by a durable call that appends to WORK/charges.log; the key's
short-term memory counts its inputs. With `pause`, the action on the value "stop" writes
WORK/paused after its charge returned and then blocks until the process is killed.
"""

import sys
import time
from pathlib import Path

from ratchet.compat.flink_agents.api.agents.agent import Agent
from ratchet.compat.flink_agents.api.decorators import action
from ratchet.compat.flink_agents.api.events.event import Event, InputEvent, OutputEvent
from ratchet.compat.flink_agents.api.events.event_type import EventType
from ratchet.compat.flink_agents.api.execution_environment import AgentsExecutionEnvironment

STATE, WORK = Path(sys.argv[1]), Path(sys.argv[2])
PAUSE = len(sys.argv) > 3 and sys.argv[3] == "pause"


def charge(key: str, item: str) -> str:
    with open(WORK / "charges.log", "a", encoding="utf-8") as fh:
        fh.write(f"{key}:{item}\n")
    return f"receipt-{key}-{item}"


def hold(item: str) -> None:
    if PAUSE and item == "stop":
        (WORK / "paused").write_text("yes")
        while True:
            time.sleep(1)


class Billing(Agent):
    @action(EventType.InputEvent)
    @staticmethod
    def bill(event: Event, ctx) -> None:
        item = InputEvent.from_event(event).input
        receipt = ctx.durable_execute(charge, ctx.key, item)
        ctx.durable_execute(hold, item)
        seen = ctx.short_term_memory.get("seen") or 0
        ctx.short_term_memory.set("seen", seen + 1)
        ctx.send_event(Event(type="Billed", attributes={"receipt": receipt, "n": seen + 1}))

    @action("Billed")
    @staticmethod
    def report(event: Event, ctx) -> None:
        ctx.send_event(OutputEvent(output=f"{event.get_attr('receipt')}#{event.get_attr('n')}"))


INPUTS = [
    {"key": "ann", "value": "tea"},
    {"key": "bo", "value": "cake"},
    {"key": "ann", "value": "stop"},
    {"key": "bo", "value": "pie"},
    {"key": "ann", "value": "jam"},
]

env = AgentsExecutionEnvironment.get_execution_environment(state_dir=STATE)
out = env.from_list(list(INPUTS)).apply(Billing()).to_list()
env.execute()
print(repr(out))
