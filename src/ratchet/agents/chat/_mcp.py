"""MCP servers as chat-agent resources: their tools become tools, their prompts prompts.

The `mcp` SDK (extra `mcp`) is imported only when a server is declared. The connection to a
server is opened lazily, by the first call that needs it, on a thread of its own (so it
outlives the action that opened it), and opened again when it drops (the call that noticed
is sent once more, on the new connection). Tool calls reach this module through the chat
agent's durable tool calls, so a call that returned before a crash is answered by the
journal; one in flight is sent again with the same idempotency key, which the server sees in
the request's `_meta` (`IDEMPOTENCY_META_KEY`).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import re
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ratchet._errors import ConfigError, InvalidArgumentError
from ratchet.agents._resource import Resource
from ratchet.agents.chat._errors import ChatError
from ratchet.agents.chat._messages import ChatMessage, MessageRole
from ratchet.agents.chat._prompt import Prompt
from ratchet.agents.chat._tools import Tool, ToolContext

if TYPE_CHECKING:
    from ratchet.agents._context import RunnerContext

log = logging.getLogger("ratchet.chat.mcp")

T = TypeVar("T")

IDEMPOTENCY_META_KEY = "ratchet/idempotency_key"
"""The `_meta` entry of every `tools/call` request that carries the call's idempotency key."""

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PREFIX = re.compile(r"[A-Za-z0-9_-]*")


class MCPToolError(ChatError):
    """An MCP server answered a tool call with an error result (`isError`); the model reads
    the message as the tool's `ERROR: ...` reply."""


def _require_mcp() -> Any:
    try:
        import mcp
    except ImportError as exc:
        raise ConfigError(
            "MCP servers need the 'mcp' package, which is not installed; install ratchet with "
            "the 'mcp' extra: pip install 'ratchet[mcp]'"
        ) from exc
    if not hasattr(mcp, "Client"):
        raise ConfigError(
            "the installed 'mcp' package is too old (ratchet needs mcp >= 2, which has "
            "mcp.Client); upgrade it: pip install -U 'ratchet[mcp]'"
        )
    return mcp


def _leaf(exc: BaseException) -> BaseException:
    """The first error inside (nested) exception groups: what the SDK's task groups wrap."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _dropped(exc: BaseException) -> bool:
    """Whether an error says the connection is gone (so a new one may succeed)."""
    exc = _leaf(exc)
    if isinstance(exc, OSError | EOFError):
        return True
    code = getattr(getattr(exc, "error", None), "code", None)
    if type(exc).__name__ == "MCPError" and code == -32000:  # CONNECTION_CLOSED
        return True
    names = {k.__name__ for k in type(exc).__mro__}
    return bool(
        names
        & {
            "ClosedResourceError",
            "BrokenResourceError",
            "EndOfStream",
            "TransportError",  # httpx and httpx2
        }
    )


class _Link:
    """One open connection, owned by a task on the server's own loop (the SDK's client is an
    async context manager that must be entered and left in one task)."""

    def __init__(self) -> None:
        self.client: Any = None
        self.ready = asyncio.Event()
        self.stop = asyncio.Event()
        self.error: BaseException | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.client is not None and not self.stop.is_set()


class _Worker:
    """A thread running an event loop that holds the connection.

    The connection outlives the action (and the event loop) that opened it: the embedded
    engine cancels tasks an action leaves behind, and the Flink engine runs actions on a loop
    of its own. Calls from any loop are handed over and awaited there.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=f"ratchet-mcp {name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)


_open_servers: weakref.WeakSet[MCPServer] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close connections at a normal exit, so stdio server processes end with this one."""
    for server in list(_open_servers):
        server.close(timeout=5.0)


class MCPServer:
    """An MCP server the chat agent may use: over stdio (`command`, `args`, `env`, `cwd`) or
    streamable HTTP (`url`).

    Declare it with `@mcp_server` on a `ChatAgent` and name it in a `ChatModelSetup`'s
    `tools`: the setup offers the server's tools (names, descriptions and JSON schemas from
    its `tools/list`). `tools=[...]` allows only those tools; `prefix="calc_"` renames every
    tool to `calc_<name>` (the server still gets its own name). `server.prompt(name)` (or
    `MCPPrompt(server_name, name)`) is one of its prompts as a ratchet `Prompt`.

    Nothing is started or connected here (the `mcp` SDK is only checked): the connection is
    opened by the first call that needs it, and again after a restart or a dropped
    connection. `timeout` bounds each request in seconds (None: no bound). `name` names the
    server in messages and its `resource` (default: the command or the URL).
    """

    IDEMPOTENCY_META_KEY = IDEMPOTENCY_META_KEY

    def __init__(
        self,
        command: str | None = None,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        url: str | None = None,
        tools: Sequence[str] | None = None,
        prefix: str = "",
        timeout: float | None = None,
        name: str | None = None,
    ) -> None:
        if (command is None) == (url is None):
            raise ConfigError(
                "MCPServer needs exactly one of command= (a server started over stdio, e.g. "
                "MCPServer('python', ['server.py'])) or url= (streamable HTTP, e.g. "
                "MCPServer(url='http://127.0.0.1:8000/mcp'))"
            )
        if url is not None and not (
            isinstance(url, str) and url.startswith(("http://", "https://"))
        ):
            raise ConfigError(
                f"MCPServer(url=) takes an http:// or https:// URL of the server's MCP endpoint "
                f"(e.g. 'http://127.0.0.1:8000/mcp'), got {url!r}"
            )
        if command is not None and (not isinstance(command, str) or not command):
            raise ConfigError(f"MCPServer(command=) takes the executable to run, got {command!r}")
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise ConfigError(
                f"MCPServer(args=) takes a list of str (e.g. ['server.py', '--flag']), got {args!r}"
            )
        if env is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ConfigError("MCPServer(env=) takes a mapping of str to str")
        if tools is not None and (
            isinstance(tools, str) or not all(isinstance(t, str) and t for t in tools)
        ):
            raise ConfigError(
                f"MCPServer(tools=) takes a list of the server's tool names to allow (or None "
                f"for all), got {tools!r}"
            )
        if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
            raise ConfigError(
                f"MCPServer(prefix=) takes letters, digits, '_' or '-' (tool names providers "
                f"accept), got {prefix!r}"
            )
        if timeout is not None and (type(timeout) not in (int, float) or timeout <= 0):
            raise ConfigError(f"MCPServer(timeout=) takes seconds > 0 or None, got {timeout!r}")
        _require_mcp()
        self.command = command
        self.args = list(args)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.url = url
        self.allowed = list(tools) if tools is not None else None
        self.prefix = prefix
        self.timeout = float(timeout) if timeout is not None else None
        self.name = name or (url if url is not None else " ".join([command or "", *self.args]))
        self._lock = threading.Lock()
        self._thread: _Worker | None = None
        self._link: _Link | None = None  # used on the worker's loop only
        self._tools: dict[str, MCPTool] | None = None
        self._skipped: set[str] = set()  # tools warned about as skipped
        self.connections_opened = 0  # how many times a connection was opened (for tests, logs)

    def __repr__(self) -> str:
        return f"MCPServer({self.name!r})"

    def __getstate__(self) -> dict[str, Any]:
        # The declaration only (an agent instance may be shipped to Flink's workers): a copy
        # opens its own connection when it is first used.
        state = dict(self.__dict__)
        for name in ("_lock", "_thread", "_link", "_tools", "_skipped"):
            state.pop(name, None)
        state["connections_opened"] = 0
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._thread = None
        self._link = None
        self._tools = None
        self._skipped = set()

    @property
    def resource(self) -> Resource:
        """The `ratchet.Resource` of this server (`mcp:<name>`), for durable calls made with
        `resource=`: while it is unreachable past the retries, the stream pauses."""
        return Resource(f"mcp:{self.name}")

    # -- the connection -----------------------------------------------------------------------

    def _target(self) -> Any:
        mcp = _require_mcp()
        if self.url is not None:
            return self.url
        return mcp.StdioServerParameters(
            command=self.command, args=self.args, env=self.env, cwd=self.cwd
        )

    def _worker(self) -> _Worker:
        with self._lock:
            if self._thread is None or self._thread.loop.is_closed():
                self._thread = _Worker(self.name)
                _open_servers.add(self)
            return self._thread

    async def _own(self, link: _Link) -> None:
        mcp = _require_mcp()
        try:
            async with mcp.Client(self._target(), read_timeout_seconds=self.timeout) as client:
                link.client = client
                self.connections_opened += 1
                link.ready.set()
                await link.stop.wait()
        except Exception as exc:  # noqa: BLE001 - reported to the caller waiting for it
            link.error = exc
        finally:
            link.client = None
            link.stop.set()
            link.ready.set()

    async def _client(self) -> Any:
        """The open connection (on the worker's loop), opening one if there is none."""
        link = self._link
        if link is not None and link.client is None and not link.ready.is_set():
            await link.ready.wait()  # another call is opening it
        elif link is None or not link.alive:
            link = self._link = _Link()
            link.task = asyncio.get_running_loop().create_task(self._own(link))
            await link.ready.wait()
        if link.client is None:
            error = _leaf(link.error) if link.error is not None else None
            target = (
                self.url if self.url is not None else " ".join([self.command or "", *self.args])
            )
            where = "" if target == self.name else f" ({target})"
            if self.url is None and isinstance(
                error, FileNotFoundError | PermissionError | NotADirectoryError
            ):
                # Not an outage that passes: a mistake in the declaration.
                raise ConfigError(
                    f"cannot start MCP server {self.name!r}{where}: {error}; fix "
                    f"MCPServer(command=..., args=..., cwd=...)"
                ) from link.error
            raise ConnectionError(
                f"cannot connect to MCP server {self.name!r}{where}: "
                f"{type(error).__name__ if error else 'closed'}: {error}"
            ) from link.error
        return link.client

    async def _attempts(self, what: str, send: Callable[[Any], Awaitable[T]]) -> T:
        for attempt in (1, 2):
            client = await self._client()
            try:
                return await send(client)
            except Exception as exc:
                if not _dropped(exc) or attempt == 2:
                    raise
                log.info("MCP server %s: connection lost during %s (%s); reconnecting", self.name,
                         what, exc)  # fmt: skip
                if self._link is not None and self._link.client is client:
                    self._link.stop.set()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _request(self, what: str, send: Callable[[Any], Awaitable[T]]) -> T:
        """`await send(client)` on the worker's loop, opening the connection first, and once
        more on a new connection if this one turns out to be gone."""
        return await self._worker().run(self._attempts(what, send))

    async def _shut(self) -> None:
        link, self._link = self._link, None
        if link is not None and link.task is not None:
            link.stop.set()
            await link.task

    def close(self, timeout: float = 10.0) -> None:
        """Close the connection (ending a stdio server process) and its thread. The next call
        opens a new one."""
        with self._lock:
            worker, self._thread = self._thread, None
        if worker is not None and not worker.loop.is_closed():
            try:
                worker.run_sync(self._shut(), timeout)
            finally:
                worker.stop(timeout)
        _open_servers.discard(self)

    async def aclose(self) -> None:
        """`close()` from async code, without blocking the event loop."""
        await asyncio.to_thread(self.close)

    # -- tools --------------------------------------------------------------------------------

    async def list_tools(self, *, refresh: bool = False) -> list[MCPTool]:
        """The server's allowed tools as ratchet `Tool`s (listed once, then kept)."""
        if self._tools is None or refresh:
            listed: list[Any] = []
            cursor: str | None = None
            while True:
                page: Any = await self._request("tools/list", _lister("list_tools", cursor))
                listed.extend(page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    break
            self._tools = self._select(listed)
        return list(self._tools.values())

    def _select(self, listed: list[Any]) -> dict[str, MCPTool]:
        by_name = {t.name: t for t in listed}
        if self.allowed is not None:
            missing = [n for n in self.allowed if n not in by_name]
            if missing:
                raise ConfigError(
                    f"MCP server {self.name!r} has no tool {missing[0]!r} (it has: "
                    f"{', '.join(sorted(by_name)) or 'none'}); fix MCPServer(tools=[...])"
                )
            chosen = [by_name[n] for n in self.allowed]
        else:
            chosen = listed
        out: dict[str, MCPTool] = {}
        for spec in chosen:
            exposed = self.prefix + spec.name
            if not _TOOL_NAME.fullmatch(exposed):
                if self.allowed is not None:
                    raise ConfigError(
                        f"tool {spec.name!r} of MCP server {self.name!r} would be offered as "
                        f"{exposed!r}, which providers refuse (1-64 letters, digits, '_' or "
                        f"'-'); leave it out of tools= or change prefix="
                    )
                if exposed not in self._skipped:  # once: first calls list the tools at once
                    self._skipped.add(exposed)
                    log.warning("MCP server %s: tool %r skipped: its name is not one "
                                "providers accept", self.name, exposed)  # fmt: skip
                continue
            out[exposed] = MCPTool(self, spec.name, exposed, spec.description, spec.input_schema)
        return out

    async def call_tool(
        self, name: str, arguments: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> str:
        """Call the server's tool `name` (its own name, without prefix) and return its result
        as text. Not durable by itself: the chat agent calls it inside a durable call. An
        error result raises `MCPToolError`."""
        meta = {IDEMPOTENCY_META_KEY: idempotency_key} if idempotency_key is not None else None

        async def send(client: Any) -> Any:
            return await client.call_tool(name, dict(arguments), meta=meta)

        result = await self._request(f"tools/call {name}", send)
        text = _content_text(result.content)
        if not text and result.structured_content is not None:
            text = json.dumps(result.structured_content, sort_keys=True, ensure_ascii=False)
        if result.is_error:
            raise MCPToolError(text or f"MCP tool {name!r} failed without a message")
        return text

    # -- prompts ------------------------------------------------------------------------------

    async def list_prompts(self) -> list[str]:
        """The names of the server's prompts."""
        names: list[str] = []
        cursor: str | None = None
        while True:
            page: Any = await self._request("prompts/list", _lister("list_prompts", cursor))
            names.extend(p.name for p in page.prompts)
            cursor = page.next_cursor
            if cursor is None:
                return names

    async def get_prompt(
        self, name: str, arguments: Mapping[str, Any] | None = None
    ) -> list[ChatMessage]:
        """The server's prompt `name`, filled with `arguments` (values that are not str are
        sent as JSON: MCP prompt arguments are strings), as chat messages."""
        args = {
            k: v if isinstance(v, str) else json.dumps(v, sort_keys=True, ensure_ascii=False)
            for k, v in (arguments or {}).items()
        }
        try:
            result = await self._request(f"prompts/get {name}", lambda c: c.get_prompt(name, args))
        except Exception as exc:
            if _dropped(exc):
                raise
            # The server's refusal (an unknown prompt, a missing argument) came back as a bare
            # "MCPError: Internal server error" naming neither the server nor the prompt.
            leaf = _leaf(exc)
            raise InvalidArgumentError(
                f"MCP server {self.name!r} could not render prompt {name!r} with arguments "
                f"{sorted(args)}: {type(leaf).__name__}: {leaf}; check the prompt's name and "
                f"its required arguments (the request's prompt_args)"
            ) from exc
        messages = []
        for m in result.messages:
            role = MessageRole.ASSISTANT if m.role == "assistant" else MessageRole.USER
            messages.append(ChatMessage(role=role, content=_content_text([m.content])))
        return messages

    def prompt(self, name: str) -> MCPPrompt:
        """The server's prompt `name` as a ratchet `Prompt` (fetched when it is used)."""
        return MCPPrompt(self, name)


def _lister(method: str, cursor: str | None) -> Callable[[Any], Awaitable[Any]]:
    async def send(client: Any) -> Any:
        return await getattr(client, method)(cursor=cursor)

    return send


def _content_text(blocks: Sequence[Any]) -> str:
    parts = []
    for block in blocks:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {getattr(block, 'mime_type', '?')}]")
        elif kind == "resource":
            inner = block.resource
            parts.append(getattr(inner, "text", None) or f"[resource: {inner.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {block.uri}]")
        else:
            parts.append(f"[{kind} content]")
    return "\n".join(parts)


class MCPTool(Tool):
    """One tool of an MCP server, as the chat agent sees it. The server validates arguments
    (its error comes back to the model as the tool's `ERROR: ...` reply)."""

    def __init__(
        self,
        server: MCPServer,
        remote_name: str,
        name: str,
        description: str | None,
        input_schema: Mapping[str, Any] | None,
    ) -> None:
        # Not Tool.__init__: there is no Python function to read hints from.
        self.server = server
        self.remote_name = remote_name
        self.fn = self.invoke
        self.name = name
        self.requires_approval = False
        self.description = description or f"Tool {remote_name!r} of MCP server {server.name!r}."
        self.is_async = True
        self._context_param = None
        parameters = dict(input_schema or {})
        parameters.setdefault("type", "object")
        parameters.setdefault("properties", {})
        self.parameters = parameters

    def validate_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return dict(arguments)

    async def invoke(self, arguments: dict[str, Any], context: ToolContext) -> Any:
        return await self.server.call_tool(
            self.remote_name, arguments, idempotency_key=context.idempotency_key
        )

    def __repr__(self) -> str:
        return f"MCPTool({self.name!r} of {self.server.name!r})"


class MCPPrompt(Prompt):
    """A prompt of an MCP server as a ratchet `Prompt`: `MCPPrompt("server", "prompt name")`
    names the server resource (or pass the `MCPServer`).

    As a `ChatModelSetup`'s prompt, the chat agent fetches it with the request's
    `prompt_args` through a durable call (a replay uses the recorded messages). Elsewhere,
    `await p.format_messages_async(args, ctx=ctx)` does the same; without `ctx` it is fetched
    directly. The synchronous `format_messages` cannot reach the server and says so.
    """

    def __init__(self, server: str | MCPServer, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"MCPPrompt takes the server's prompt name, got {name!r}")
        if not isinstance(server, str | MCPServer):
            raise ConfigError(
                f"MCPPrompt(server=) takes an MCPServer or the name of an @mcp_server resource, "
                f"got {server!r}"
            )
        super().__init__([], name=name)
        self.server_ref = server

    @property
    def server(self) -> MCPServer:
        if not isinstance(self.server_ref, MCPServer):
            raise ConfigError(
                f"MCP prompt {self.name!r} names server {self.server_ref!r}, which is not bound "
                f"yet: declare the server with @mcp_server on the same agent"
            )
        return self.server_ref

    def bind(self, server: MCPServer) -> None:
        self.server_ref = server

    def format_messages(
        self, args: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> list[ChatMessage]:
        raise ChatError(
            f"MCP prompt {self.name!r} is fetched from its server, which a synchronous call "
            f"cannot do: use it as a ChatModelSetup's prompt, or await "
            f"prompt.format_messages_async(args, ctx=ctx)"
        )

    async def fetch(self, args: Mapping[str, Any] | None = None) -> list[ChatMessage]:
        """The prompt filled with `args`, from the server (not durable)."""
        return await self.server.get_prompt(self.name, args)

    async def format_messages_async(
        self, args: Mapping[str, Any] | None = None, *, ctx: RunnerContext | None = None
    ) -> list[ChatMessage]:
        """The prompt filled with `args`; with `ctx`, through a durable call."""
        values = dict(args or {})
        if ctx is None:
            return await self.fetch(values)
        return await ctx.durable_execute_async(self._fetch_recorded, self.name, values)

    async def _fetch_recorded(self, name: str, args: dict[str, Any]) -> list[ChatMessage]:
        # The durable call's function: its qualified name is stored in the journal.
        return await self.server.get_prompt(name, args)

    def __repr__(self) -> str:
        ref = self.server_ref.name if isinstance(self.server_ref, MCPServer) else self.server_ref
        return f"MCPPrompt({ref!r}, {self.name!r})"
