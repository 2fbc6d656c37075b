"""An agent file loaded more than once in one interpreter (Flink's thread mode runs every task
and job of a TaskManager in one): the same bytes are not executed again, so the classes it
registers with `ratchet.register_type` keep their names; changed bytes are (an upgrade), and
a change that cannot replace what the interpreter holds is a ConfigError saying so."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ratchet._errors import ConfigError
from ratchet.agents._run import load_agent

AGENT = textwrap.dedent(
    """
    from dataclasses import dataclass

    import ratchet
    from ratchet import Agent, InputEvent, OutputEvent, action

    LOADS = globals().get("LOADS", 0) + 1

    @ratchet.register_type
    @dataclass
    class Point:
        x: int

    class A(Agent):
        version = {version}

        @action(InputEvent, inline=True)
        def go(self, event, ctx):
            ctx.send_event(OutputEvent(output=Point(1)))
    """
)


def _write(path: Path, version: int, extra: str = "") -> None:
    path.write_text(AGENT.format(version=version) + extra)


def test_the_same_file_loads_twice_and_a_changed_one_is_refused_clearly(
    tmp_path: Path,
) -> None:
    # A fresh interpreter: the registry of types is per process.
    agent = tmp_path / "loadtwice_agent.py"
    _write(agent, 1)
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from ratchet._errors import ConfigError
        from ratchet.agents._run import load_agent
        spec = {str(agent)!r} + ":A"
        a = load_agent(spec)
        b = load_agent(spec)  # a second task on the same TaskManager
        assert type(a) is type(b), (type(a), type(b))
        assert sys.modules["ratchet_user_loadtwice_agent"].LOADS == 1
        Path({str(agent)!r}).write_text(Path({str(agent)!r}).read_text().replace(
            "version = 1", "version = 2"))
        try:
            load_agent(spec)
        except ConfigError as exc:
            print("REFUSED", exc)
        else:
            raise AssertionError("a changed file re-registered its type")
        c = load_agent(spec, loaded=True)  # the version loaded first still runs
        assert type(c).version == 1
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "REFUSED" in out and "changed since this Python process loaded it" in out, out
    assert "restart the TaskManagers" in out, out


def test_a_changed_file_without_registered_types_is_loaded_again(tmp_path: Path) -> None:
    agent = tmp_path / "reload_agent.py"
    agent.write_text(
        "from ratchet import Agent, InputEvent, OutputEvent, action\n"
        "class A(Agent):\n"
        "    version = 1\n"
        "    @action(InputEvent, inline=True)\n"
        "    def go(self, event, ctx):\n"
        "        ctx.send_event(OutputEvent(output=self.version))\n"
    )
    first = load_agent(f"{agent}:A")
    assert type(first).version == 1  # type: ignore[attr-defined]
    assert load_agent(f"{agent}:A").__class__ is first.__class__
    agent.write_text(agent.read_text().replace("version = 1", "version = 2"))
    assert type(load_agent(f"{agent}:A")).version == 2  # type: ignore[attr-defined]


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_agent(f"{tmp_path / 'nope.py'}:A")


GOOD_HEAD = "from ratchet import Agent, InputEvent, action\n"
BROKEN = {
    "syntax": ("class A(Agent)\n    pass\n", "failed to load: SyntaxError at {path}:2"),
    "import": (
        "import ratchet_no_such_module\n",
        "failed to load: ModuleNotFoundError: No module named 'ratchet_no_such_module' "
        "(at {path}:2)",
    ),
    "raises": ("raise RuntimeError('no key set')\n", "RuntimeError: no key set (at {path}:2)"),
    "arguments": (
        "class A(Agent):\n    def __init__(self, x):\n        super().__init__()\n"
        "    @action(InputEvent)\n    def a(self, e, ctx):\n        pass\n",
        "creating A() failed: TypeError: ",
    ),
    # A constructor that fails inside is not told to take no arguments (it takes none).
    "init-raises": (
        "class A(Agent):\n    def __init__(self):\n        raise ValueError('no api key')\n"
        "    @action(InputEvent)\n    def a(self, e, ctx):\n        pass\n",
        "creating A() failed: ValueError: no api key",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_an_agent_file_that_fails_is_a_config_error_naming_where(tmp_path: Path, case: str) -> None:
    """Through `ratchet run` too: exit 2 and one line, no traceback, no state made."""
    body, expected = BROKEN[case]
    path = tmp_path / f"broken_{case}.py"
    path.write_text(GOOD_HEAD + body)
    with pytest.raises(ConfigError) as e:
        load_agent(f"{path}:A")
    assert expected.format(path=path) in str(e.value)
    assert ("with no arguments" in str(e.value)) == (case == "arguments"), str(e.value)
    if case not in (
        "arguments",
        "init-raises",
    ):  # a module that failed to load is not kept half made
        assert f"ratchet_user_broken_{case}" not in sys.modules
    (tmp_path / "in.jsonl").write_text('{"key": "a"}\n')
    argv = [sys.executable, "-m", "ratchet.cli", "run", f"{path}:A", "--input"]
    argv += [str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")]
    proc = subprocess.run([*argv, "--state", str(tmp_path / "st")], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert expected.format(path=path) in proc.stderr
    assert not (tmp_path / "st").exists()


def test_a_module_spec_that_fails_or_is_a_file_name_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ratchet_raising_mod.py").write_text("raise ValueError('bad config')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"'ratchet_raising_mod' failed to load: ValueError"):
        load_agent("ratchet_raising_mod:A")
    with pytest.raises(ConfigError, match=r"for a file, give its path: 'my_agents.py:Counter'"):
        load_agent("my_agents:Counter")
    with pytest.raises(ConfigError, match="is a directory"):
        load_agent(f"{tmp_path}{'/'}:A")


MOVING = """
import os
from ratchet import Agent, InputEvent, OutputEvent, action

def charge(amount):
    with open(os.environ["CHARGES"], "a") as fh:
        fh.write(f"{amount}\\n")
    return amount

class Shop(Agent):
    @action(InputEvent)
    async def buy(self, event, ctx):
        paid = await ctx.durable_execute_async(charge, event.input["amount"])
        ok = await ctx.wait_for_signal("ship")
        ctx.send_event(OutputEvent(output={"paid": paid, "shipped": ok}))
"""


def test_an_agent_file_moved_with_a_run_in_flight_replays_its_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recorded call names its function with the module, which for a file is its name
    (`ratchet_user_orders.charge`): after `mv orders.py pkg/shop.py` the replay met
    `ratchet_user_shop.charge`, refused the run (NonDeterminismError) and the charge was
    made again. Now the same function with the same arguments takes its record."""
    charges = tmp_path / "charges.log"
    monkeypatch.setenv("CHARGES", str(charges))
    old = tmp_path / "orders.py"
    old.write_text(MOVING)
    (tmp_path / "in.jsonl").write_text('{"key": "a", "amount": 12}\n')

    def run(agent: Path) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "ratchet.cli", "run", f"{agent}:Shop", "--input"]
        argv += [str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")]
        return subprocess.run([*argv, "--state", str(tmp_path / "st")], capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    first = run(old)  # the run charges, then parks waiting for "ship": the job ends
    assert first.returncode == 0 and "waiting for signals" in first.stderr, first.stderr
    (tmp_path / "pkg").mkdir()
    moved = old.rename(tmp_path / "pkg" / "shop.py")
    sent = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "signal", "--state", str(tmp_path / "st"),
         "--key", "a", "ship", "--value", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    second = run(moved)
    assert second.returncode == 0, second.stderr[-2000:]
    assert charges.read_text().splitlines() == ["12"]  # charged once
    (line,) = (tmp_path / "o.jsonl").read_text().splitlines()
    assert json.loads(line)["output"] == {"paid": 12, "shipped": True}


def test_only_a_function_of_a_moved_agent_file_is_matched_by_its_name() -> None:
    """The fallback matches the same qualified name of an agent file (`ratchet_user_*`);
    not a same-named function of another class or module (it took `Cache.get`'s record for
    `Db.get`, and `Db.get`'s own record was then made again)."""
    from ratchet.runtime._dispatch import TaskCalls
    from ratchet.store._base import CallRecord

    def calls(*fns: str) -> TaskCalls:
        recorded = {i: CallRecord(0, "t", i, fn, "D", "ok", b"\xc0") for i, fn in enumerate(fns)}
        return TaskCalls(0, "t", "k", recorded, writer=None)  # type: ignore[arg-type]

    moved = calls("ratchet_user_orders.charge")
    assert moved.claim("ratchet_user_shop.charge", "D")[1] is not None
    other = calls("ratchet_user_orders.Cache.get", "myagent.xml_api.fetch")
    assert other.claim("ratchet_user_shop.Db.get", "D") == (2, None)
    assert other.claim("myagent.json_api.fetch", "D") == (3, None)
    assert other.claim("myagent.xml_api.fetch", "D")[0] == 1  # its own record, still there
