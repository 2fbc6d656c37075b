"""A small real MCP server for the tests, written with the official `mcp` SDK.

    python mcp_server.py stdio          # over stdin/stdout
    python mcp_server.py http PORT      # streamable HTTP on 127.0.0.1:PORT/mcp

Every execution of a tool (and every fetch of the prompt) appends one tab-separated line to
the file $MCP_MARKS: `what<TAB>idempotency key<TAB>argument`, so a test can count what the
server really did and with which key. `block` waits, after marking, until the file $MCP_GATE
exists: the test kills the agent while it waits.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

KEY = "ratchet/idempotency_key"

app = MCPServer("ratchet-test-server", log_level="WARNING")


def _mark(what: str, ctx: Context | None, arg: str) -> None:
    meta = (ctx.request_context.meta or {}) if ctx is not None else {}
    key = meta.get(KEY, "-")
    with open(os.environ["MCP_MARKS"], "a", encoding="utf-8") as f:
        f.write(f"{what}\t{key}\t{arg}\n")


@app.tool()
def record(text: str, ctx: Context) -> str:
    """Record a line of text and say so.

    Args:
        text: What to record.
    """
    _mark("record", ctx, text)
    return f"recorded {text}"


@app.tool()
async def block(text: str, ctx: Context) -> str:
    """Record a line of text, then wait until released.

    Args:
        text: What to record.
    """
    _mark("block", ctx, text)
    gate = Path(os.environ["MCP_GATE"])
    # The gate is a file another process creates: poll it, off the event loop.
    while not await anyio.to_thread.run_sync(gate.exists):  # noqa: ASYNC110
        await anyio.sleep(0.02)
    return f"released {text}"


@app.tool()
def whoami() -> int:
    """The server's process id."""
    return os.getpid()


@app.tool()
def fail(reason: str) -> str:
    """Always fails, with the given reason (an anticipated error the client reads).

    Args:
        reason: The message of the failure.
    """
    raise ToolError(reason)


@app.tool(name="dotted.name")
def dotted() -> str:
    """A tool whose name model providers refuse."""
    return "never offered"


@app.prompt()
def greeting(name: str) -> str:
    """Ask for a greeting."""
    _mark("prompt", None, name)
    return f"Greet {name} in five words."


if __name__ == "__main__":
    if sys.argv[1] == "http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
