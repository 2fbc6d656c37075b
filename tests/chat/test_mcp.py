"""MCP servers as chat-agent resources, against a real MCP server process (mcp_server.py,
written with the same SDK) over stdio and over streamable HTTP on 127.0.0.1.

The kill tests SIGKILL a real `ratchet run` while one MCP tool call is in flight and after
another returned, then restart it and count, in the server's marks file, what the server
really executed and with which idempotency key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp_server_agent import SERVER, MCPAgent

from ratchet import (
    Agent,
    ConfigError,
    EngineConfig,
    InputEvent,
    InvalidArgumentError,
    OutputEvent,
    RunnerContext,
    action,
    run,
)
from ratchet.agents.chat import (
    ChatError,
    ChatMessage,
    MCPPrompt,
    MCPServer,
    MCPToolError,
    MessageRole,
    ResourceType,
    prompt,
    tool,
)
from support.engines import per_key, run_flink_core

HERE = Path(__file__).parent
AGENT = f"{HERE / 'mcp_server_agent.py'}:MCPAgent"


def _marks(path: Path) -> list[tuple[str, str, str]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        what, key, arg = line.split("\t")
        rows.append((what, key, arg))
    return rows


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    marks, gate = tmp_path / "marks.tsv", tmp_path / "gate"
    monkeypatch.setenv("MCP_MARKS", str(marks))
    monkeypatch.setenv("MCP_GATE", str(gate))
    monkeypatch.delenv("MCP_URL", raising=False)
    return {"marks": marks, "gate": gate}


def _stdio(files: dict[str, Path], **kw: Any) -> MCPServer:
    env = {"MCP_MARKS": str(files["marks"]), "MCP_GATE": str(files["gate"])}
    return MCPServer(sys.executable, [SERVER, "stdio"], env=env, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_http(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("MCP HTTP server did not start") from None
            time.sleep(0.05)


@pytest.fixture
def http_url(files: dict[str, Path]) -> Iterator[str]:
    """The test server over streamable HTTP, in its own process, on a free port."""
    port = _free_port()
    proc = _serve_http(port)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# -- the server as a resource -------------------------------------------------------------------


def test_tools_come_from_the_server_with_schemas_allowlist_prefix_and_keys(
    files: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        chosen = _stdio(files, tools=["record", "fail"], prefix="calc_")
        everything = _stdio(files)
        try:
            tools = {t.name: t for t in await chosen.list_tools()}
            assert sorted(tools) == ["calc_fail", "calc_record"]
            spec = tools["calc_record"].spec()
            assert spec["description"].startswith("Record a line of text and say so.")
            assert spec["parameters"]["properties"]["text"]["type"] == "string"
            assert spec["parameters"]["required"] == ["text"]
            # The server gets its own name and the key in _meta; the model gets the text.
            assert await chosen.call_tool("record", {"text": "x"}, idempotency_key="k-1") == (
                "recorded x"
            )
            with pytest.raises(MCPToolError, match="no luck"):
                await chosen.call_tool("fail", {"reason": "no luck"}, idempotency_key="k-2")
            # Without an allowlist, every tool whose name providers accept.
            with caplog.at_level(logging.WARNING, logger="ratchet.chat.mcp"):
                listed = await asyncio.gather(*(everything.list_tools() for _ in range(5)))
                names = sorted(t.name for t in listed[0])
            assert names == ["block", "fail", "record", "whoami"]
            # Once, though the first calls of a run list the tools at once (it said it 5 times).
            assert caplog.text.count("'dotted.name' skipped") == 1
            assert await everything.list_prompts() == ["greeting"]
            messages = await chosen.prompt("greeting").format_messages_async({"name": "Ann"})
            assert messages == [
                ChatMessage(role=MessageRole.USER, content="Greet Ann in five words.")
            ]
        finally:
            await chosen.aclose()
            await everything.aclose()

    asyncio.run(scenario())
    assert _marks(files["marks"]) == [("record", "k-1", "x"), ("prompt", "-", "Ann")]


def test_a_dropped_connection_is_reopened_and_the_call_retried(files: dict[str, Path]) -> None:
    async def scenario() -> None:
        server = _stdio(files)
        try:
            first_pid = int(await server.call_tool("whoami", {}))
            assert server.connections_opened == 1
            os.kill(first_pid, signal.SIGKILL)
            assert await server.call_tool("record", {"text": "after"}, idempotency_key="k") == (
                "recorded after"
            )
            assert server.connections_opened == 2
            assert int(await server.call_tool("whoami", {})) != first_pid
        finally:
            await server.aclose()

    asyncio.run(scenario())
    assert _marks(files["marks"]) == [("record", "k", "after")]


def test_a_prompt_the_server_cannot_render_names_the_server_and_the_prompt(
    files: dict[str, Path],
) -> None:
    # It came back as "MCPError: Internal server error", naming neither.
    async def scenario() -> None:
        server = _stdio(files, name="calc")
        try:
            assert (await server.get_prompt("greeting", {"name": "Ann"}))[0].content == (
                "Greet Ann in five words."
            )
            with pytest.raises(
                InvalidArgumentError,
                match=r"MCP server 'calc' could not render prompt 'greeting' with arguments \[\]",
            ):
                await server.get_prompt("greeting", {})
            with pytest.raises(InvalidArgumentError, match="could not render prompt 'nope'"):
                await server.get_prompt("nope", {"name": "Ann"})
            assert server.connections_opened == 1  # a refusal is not a dropped connection
        finally:
            await server.aclose()

    asyncio.run(scenario())


def test_a_declared_server_pickles_as_its_declaration(files: dict[str, Path]) -> None:
    """An agent instance may be shipped to Flink's workers by pickling: the copy connects
    on its own."""
    original = _stdio(files, tools=["record"], prefix="calc_")

    async def scenario() -> list[str]:
        copy = pickle.loads(pickle.dumps(original))
        try:
            return [t.name for t in await copy.list_tools()]
        finally:
            await copy.aclose()

    assert asyncio.run(scenario()) == ["calc_record"]
    assert original.connections_opened == 0


def test_mistakes_are_clear_errors(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"exactly one of command= .* or url="):
        MCPServer()
    with pytest.raises(ConfigError, match=r"exactly one of command="):
        MCPServer("python", url="http://127.0.0.1:1/mcp")
    with pytest.raises(ConfigError, match=r"url=\) takes an http:// or https:// URL"):
        MCPServer(url="127.0.0.1:8000/mcp")
    with pytest.raises(ConfigError, match=r"args=\) takes a list of str"):
        MCPServer("python", "server.py")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"prefix=\) takes letters"):
        MCPServer("python", ["s.py"], prefix="calc.")
    with pytest.raises(ConfigError, match=r"tools=\) takes a list"):
        MCPServer("python", ["s.py"], tools="record")  # type: ignore[arg-type]

    async def listing(server: MCPServer) -> None:
        try:
            await server.list_tools()
        finally:
            await server.aclose()

    with pytest.raises(ConfigError, match=r"has no tool 'recrod' \(it has: block, dotted.name, "):
        asyncio.run(listing(_stdio(files, tools=["recrod"])))
    with pytest.raises(ConfigError, match=r"would be offered as 'dotted.name', which providers"):
        asyncio.run(listing(_stdio(files, tools=["dotted.name"])))
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(ConfigError, match=r"pip install 'ratchet\[mcp\]'"):
        MCPServer("python", ["s.py"])


def test_a_chat_agent_uses_the_servers_tools_and_prompt(
    files: dict[str, Path], tmp_path: Path
) -> None:
    out: list[dict[str, Any]] = []
    agent = MCPAgent()
    run(
        agent,
        inputs=[{"key": "a", "text": "quick"}],
        output=out.append,
        state_dir=tmp_path / "state",
        config=EngineConfig(checkpoint_interval=0.02),
    )
    agent.get_resource("calc", ResourceType.MCP_SERVER).close()
    [record] = out
    assert record["output"] == {"reply": "done: recorded a-1", "first": "Greet a in five words."}
    marks = _marks(files["marks"])
    assert [(w, a) for w, _, a in marks] == [("prompt", "a"), ("record", "a-1")]
    assert marks[1][1].startswith("rt-")  # the tool call's idempotency key reached the server


# -- SIGKILL of `ratchet run` ----------------------------------------------------------------


def _start(tmp: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", AGENT,
        "--input", str(tmp / "in.jsonl"),
        "--output", str(tmp / "out.jsonl"),
        "--state", str(tmp / "state"),
        "--checkpoint-interval", "50",
    ]  # fmt: skip
    # Its own process group: the kill takes a stdio server child with it, as a crash would.
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )


def _kill(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def _wait(cond: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 90
    while not cond():
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"agent exited ({proc.returncode}) before {what}: {err!r}")
        if time.monotonic() > deadline:
            _kill(proc)
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _returned_calls_settled(tmp: Path) -> bool:
    """Whether b's `record` (input seq 1) is journaled, and a's (seq 0) is journaled or its
    run is complete (a completed run's call records are dropped at its checkpoint)."""
    path = tmp / "state" / "ratchet.db"
    if not path.exists():
        return False
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
        try:
            rows = con.execute("SELECT seq, fn, status FROM calls").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return False

    def tool_ok(seq: int) -> bool:
        return any(q == seq and fn.endswith("._call_tool") and st == "ok" for q, fn, st in rows)

    a_done = not any(q == 0 for q, _, _ in rows)  # a's prompt and model calls were recorded
    return tool_ok(1) and (tool_ok(0) or a_done)


@pytest.mark.kill
@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_sigkill_with_an_mcp_call_in_flight_and_one_returned(
    transport: str, files: dict[str, Path], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MCP_URL"}
    if transport == "http":
        env["MCP_URL"] = request.getfixturevalue("http_url")
    lines = [{"key": "a", "text": "quick"}, {"key": "b", "text": "slow"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    marks = files["marks"]

    proc = _start(tmp_path, env)
    # b's `block` is in flight; both `record` calls returned and their results are journaled
    # (or a's run is already complete).
    seen = lambda: {(w, x) for w, _, x in _marks(marks)}  # noqa: E731
    _wait(lambda: {("block", "b-2"), ("record", "a-1")} <= seen(), proc, "the blocking call")
    _wait(lambda: _returned_calls_settled(tmp_path), proc, "the returned calls' records")
    _kill(proc)
    before = _marks(marks)

    files["gate"].touch()  # the re-executed `block` returns at once
    proc = _start(tmp_path, env)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err.decode()[-2000:]

    outputs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    by_key = {o["key"]: o["output"]["reply"] for o in outputs}
    assert len(outputs) == 2, outputs  # every output exactly once
    assert by_key == {"a": "done: recorded a-1", "b": "done: recorded b-1; released b-2"}

    after = _marks(marks)
    records = [(k, a) for w, k, a in after if w == "record"]
    blocks = [(k, a) for w, k, a in after if w == "block"]
    prompts = sorted(a for w, _, a in after if w == "prompt")
    # The calls that returned were not executed again (the journal answered them) ...
    assert sorted(a for _, a in records) == ["a-1", "b-1"]
    assert records == [(k, a) for w, k, a in before if w == "record"]
    # ... nor the prompts fetched before the kill; the call in flight ran again, same key.
    assert prompts == ["a", "b"]
    assert len(blocks) == 2 and blocks[0] == blocks[1], blocks
    assert blocks[0][0].startswith("rt-")
    assert blocks[0][0] not in {k for k, _ in records}


# -- the Flink core ---------------------------------------------------------------------------


class _FlinkCaller(Agent):
    """Calls an MCP tool in a plain durable call (the Flink core has no `resource=` waits yet,
    which the chat agent's model calls need; docs/flink.md)."""

    def __init__(self, server: MCPServer) -> None:
        self.server = server

    @action(InputEvent)
    async def call(self, event: InputEvent, ctx: RunnerContext) -> None:
        text = await ctx.durable_execute_async(
            self.server.call_tool,
            "record",
            {"text": event.input["text"]},
            idempotency_key=f"flink-{ctx.key}",
        )
        ctx.send_event(OutputEvent(output=text))


def test_an_mcp_tool_call_runs_on_the_flink_core(files: dict[str, Path]) -> None:
    server = _stdio(files)
    try:
        outputs, _ = run_flink_core(
            _FlinkCaller(server), [{"key": "a", "text": "x"}, {"key": "b", "text": "y"}]
        )
    finally:
        server.close()
    assert per_key(outputs) == {"a": ["recorded x"], "b": ["recorded y"]}
    assert sorted(_marks(files["marks"])) == [
        ("record", "flink-a", "x"),
        ("record", "flink-b", "y"),
    ]


def test_an_http_server_that_goes_away_is_reported_and_found_again(
    files: dict[str, Path],
) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/mcp"

    async def scenario() -> None:
        server = MCPServer(url=url, name="calc")
        proc = await asyncio.to_thread(_serve_http, port)
        try:
            assert await server.call_tool("record", {"text": "1"}, idempotency_key="k1") == (
                "recorded 1"
            )
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
            with pytest.raises(
                ConnectionError, match=rf"cannot connect to MCP server 'calc' \({url}\)"
            ):
                await server.call_tool("record", {"text": "2"}, idempotency_key="k2")
            proc = await asyncio.to_thread(_serve_http, port)
            assert await server.call_tool("record", {"text": "3"}, idempotency_key="k3") == (
                "recorded 3"
            )
            assert server.connections_opened == 2
        finally:
            await server.aclose()
            proc.kill()
            await asyncio.to_thread(proc.wait)

    asyncio.run(scenario())
    assert _marks(files["marks"]) == [("record", "k1", "1"), ("record", "k3", "3")]


def test_a_command_that_cannot_start_is_a_config_error(files: dict[str, Path]) -> None:
    async def scenario() -> None:
        server = MCPServer("/nonexistent/mcp-server-binary", ["--stdio"])
        try:
            await server.list_tools()
        finally:
            await server.aclose()

    with pytest.raises(ConfigError, match=r"cannot start MCP server .*fix MCPServer\(command="):
        asyncio.run(scenario())


def test_resource_mistakes_fail_when_the_agent_is_built(files: dict[str, Path]) -> None:
    class NoSuchServer(MCPAgent):
        @prompt
        @staticmethod
        def greeting() -> MCPPrompt:
            return MCPPrompt("calcc", "greeting")

    with pytest.raises(
        ConfigError, match=r"has no mcp_server resource named 'calcc' \(declared: calc\)"
    ):
        NoSuchServer()

    class Ambiguous(MCPAgent):
        @tool(name="calc")
        @staticmethod
        def double(x: int) -> int:
            """Double a number."""
            return 2 * x

    with pytest.raises(
        ConfigError, match=r"lists 'calc', which names both a tool and an MCP server"
    ):
        Ambiguous()
    with pytest.raises(ChatError, match=r"MCP prompt 'greeting' is fetched from its server"):
        MCPAgent().get_resource("greeting", ResourceType.PROMPT).format_messages({"name": "x"})
