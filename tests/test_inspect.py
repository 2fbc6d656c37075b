"""`ratchet inspect` reads any state: ratchet's own types always decode, `--agent` loads the user's
registered types, and a value of a type nobody registered is shown generically, never an error.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
AGENT = f"{ROOT / 'tests' / 'inspect_support' / 'chat_agent.py'}:InspectedAgent"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
PROVIDER_SDKS = ("openai", "anthropic", "ollama")


def ratchet(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="100")
    proc = subprocess.run(
        [*RATCHET, *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def chat_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The state of a chat agent (scripted model) that answered two questions."""
    tmp = tmp_path_factory.mktemp("inspect")
    (tmp / "in.jsonl").write_text(
        '{"key": "ann", "q": "refund my kettle"}\n{"key": "bob", "q": "where is it"}\n'
    )
    ratchet(
        "run",
        AGENT,
        "--input",
        str(tmp / "in.jsonl"),
        "--output",
        str(tmp / "out.jsonl"),
        "--state",
        str(tmp / "state"),
    )
    outputs = [json.loads(line) for line in (tmp / "out.jsonl").read_text().splitlines()]
    assert sorted(o["output"]["label"] for o in outputs) == ["refund", "where"]
    return tmp / "state"


def inspect_json(state: Path, *extra: str) -> tuple[dict[str, Any], str]:
    proc = ratchet("inspect", "--state", str(state), "--json", *extra)
    return json.loads(proc.stdout), proc.stderr


def test_ratchets_chat_types_decode_and_unregistered_user_types_are_shown_generically(
    chat_state: Path,
) -> None:
    memory, stderr = inspect_json(chat_state)
    ann = memory["ann"]
    # ratchet's own types: TokenUsage (kept by the chat layer), ChatMessage, ToolCall.
    assert ann["ratchet_chat"] == {"usage": {"input_tokens": 4, "output_tokens": 2}}
    assert ann["reply"]["role"] == "assistant"
    assert ann["reply"]["usage"] == {"input_tokens": 4, "output_tokens": 2}
    assert ann["call"] == {"id": "c1", "name": "lookup", "arguments": {"order": "A-1"}}
    # The user's types, whose module this inspect did not load: name and fields, generically.
    assert ann["verdict"] == {
        "$unregistered": "inspect_test.Verdict",
        "$state": {"label": "refund", "score": 3},
    }
    assert ann["note"] == {
        "$unregistered": "inspect_test.Note",
        "$state": {"text": "refund", "tags": ["a", "b"]},
    }
    assert ann["moods"] == {
        "('ann', inspect_test.Mood('calm'))": [
            {"$unregistered": "inspect_test.Mood", "$state": "angry"}
        ]
    }
    assert memory["bob"]["verdict"]["$state"] == {"label": "where", "score": 3}
    assert (
        "3 type(s) in this state are not registered in this process and are shown generically "
        "(inspect_test.Mood, inspect_test.Note, inspect_test.Verdict); pass --agent"
    ) in stderr


def test_agent_loads_the_users_module_so_its_types_decode(chat_state: Path) -> None:
    memory, stderr = inspect_json(chat_state, "--agent", AGENT, "--key", "ann")
    ann = memory["ann"]
    assert list(memory) == ["ann"]
    assert ann["verdict"] == {"label": "refund", "score": 3}
    assert ann["moods"] == {"('ann', Mood.CALM)": ["angry"]}
    # Registered by a module only an action imports: loading the agent does not register it.
    assert ann["note"] == {
        "$unregistered": "inspect_test.Note",
        "$state": {"text": "refund", "tags": ["a", "b"]},
    }
    assert "1 type(s)" in stderr and "(inspect_test.Note); register them when" in stderr


def test_the_rich_view_shows_stand_ins_by_their_stored_name(chat_state: Path) -> None:
    plain = ratchet("inspect", "--state", str(chat_state), "--key", "ann").stdout
    assert "inspect_test.Verdict(label='refund', score=3)" in plain
    assert "inspect_test.Note(text='refund', tags=('a', 'b'))" in plain
    assert "TokenUsage(input_tokens=4, output_tokens=2)" in plain
    loaded = ratchet("inspect", "--state", str(chat_state), "--key", "ann", "--agent", AGENT)
    assert "Verdict(label='refund', score=3)" in loaded.stdout
    assert "inspect_test.Verdict" not in loaded.stdout


def test_a_bad_agent_is_a_usage_error_before_the_state_is_read(tmp_path: Path) -> None:
    proc = ratchet("inspect", "--state", str(tmp_path), "--agent", "no_colon_here", check=False)
    assert proc.returncode == 2
    assert "agent 'no_colon_here' must look like 'package.module:Class'" in proc.stderr


def test_an_agent_that_did_not_write_the_state_is_noted(chat_state: Path) -> None:
    other = f"{ROOT / 'tests' / 'kill' / 'kill_agent.py'}:KillAgent"
    _, stderr = inspect_json(chat_state, "--agent", other)
    assert (
        f"--agent {other} is ratchet_user_kill_agent.KillAgent, but {chat_state} was written by "
        "ratchet_user_chat_agent.InspectedAgent"
    ) in stderr


def ratchet_registered_names() -> set[str]:
    """Every name ratchet's own source registers with the codec ("ratchet.X")."""
    names: set[str] = set()
    for path in (ROOT / "src" / "ratchet").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or len(node.args) < 2:
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            name = node.args[1]
            if (
                called in ("register", "register_type")
                and isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and name.value.startswith("ratchet.")
            ):
                names.add(name.value)
    return names


def test_inspect_registers_every_type_ratchet_defines_without_provider_sdks(
    chat_state: Path,
) -> None:
    names = ratchet_registered_names()
    assert {"ratchet.TokenUsage", "ratchet.ChatMessage"} <= names  # the scan finds them
    script = (
        "import json, sys\n"
        "from ratchet.cli import main\n"
        "from ratchet.store import codec\n"
        f"code = main(['inspect', '--state', {str(chat_state)!r}, '--json'])\n"
        f"names = {sorted(names)!r}\n"
        "def known(name):\n"
        "    try:\n"
        "        return codec.lookup(name) is not None\n"
        "    except codec.UnknownTypeError:\n"
        "        return False\n"
        "missing = [n for n in names if not known(n)]\n"
        f"sdks = sorted(m for m in sys.modules if m.split('.')[0] in {PROVIDER_SDKS!r})\n"
        "print('RESULT', json.dumps({'code': code, 'missing': missing, 'sdks': sdks}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    assert result == {"code": 0, "missing": [], "sdks": []}


def test_the_integer_key_1_and_the_string_key_1_are_both_shown_and_read(tmp_path: Path) -> None:
    """They are two keys (the engine keeps both); inspect showed one of them, and
    `open_state(...).memory(1)` gave the string key's memory. `--key 1` shows one of them
    (it showed both as the one asked for): --key-type says which."""
    from ratchet import open_state

    (tmp_path / "typed.py").write_text(
        "from ratchet import Agent, InputEvent, OutputEvent, action\n"
        "class T(Agent):\n"
        "    @action(InputEvent, inline=True)\n"
        "    def a(self, e, ctx):\n"
        "        ctx.short_term_memory.set('t', type(e.input['key']).__name__)\n"
        "        ctx.send_event(OutputEvent(output=1))\n"
    )
    (tmp_path / "in.jsonl").write_text('{"key": 1}\n{"key": "1"}\n{"key": 2}\n')
    state = str(tmp_path / "st")
    ratchet("run", f"{tmp_path / 'typed.py'}:T", "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "o.jsonl"), "--state", state)  # fmt: skip
    shown = json.loads(ratchet("inspect", "--state", state, "--json").stdout)
    assert shown == {"1": {"t": "str"}, "1 (int)": {"t": "int"}, "2": {"t": "int"}}
    both = ratchet("inspect", "--state", state, "--json", "--key", "1", check=False)
    assert both.returncode == 2 and "--key-type str or --key-type int" in both.stderr
    one = ratchet("inspect", "--state", state, "--json", "--key", "1", "--key-type", "int")
    assert json.loads(one.stdout) == {"1 (int)": {"t": "int"}}
    s = open_state(state)
    assert (s.memory(1), s.memory("1"), s.memory(2)) == ({"t": "int"}, {"t": "str"}, {"t": "int"})
