"""Resources declared on an agent by name (Flink Agents style): connections, setups, tools, prompts."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

from ratchet._errors import ConfigError
from ratchet.agents.chat._mcp import MCPPrompt, MCPServer
from ratchet.agents.chat._model import (
    ChatModel,
    ChatModelSetup,
    ResourceDescriptor,
    schema_class,
)
from ratchet.agents.chat._prompt import Prompt
from ratchet.agents.chat._tools import _TOOL_ATTR, Tool, as_tool

_RESOURCE_ATTR = "__ratchet_resource__"


class ResourceType(StrEnum):
    CHAT_MODEL_CONNECTION = "chat_model_connection"
    CHAT_MODEL = "chat_model"  # a setup
    TOOL = "tool"
    PROMPT = "prompt"
    MCP_SERVER = "mcp_server"


def _marker(kind: ResourceType) -> Callable[[Any], Any]:
    def mark(fn: Any) -> Any:
        target = fn.__func__ if isinstance(fn, staticmethod) else fn
        setattr(target, _RESOURCE_ATTR, kind)
        return fn

    mark.__name__ = kind.value
    mark.__doc__ = (
        f"Declare a {kind.value} resource: a staticmethod returning it (or a "
        f"ResourceDescriptor), registered under the method's name."
    )
    return mark


chat_model_connection = _marker(ResourceType.CHAT_MODEL_CONNECTION)
chat_model_setup = _marker(ResourceType.CHAT_MODEL)
prompt = _marker(ResourceType.PROMPT)
mcp_server = _marker(ResourceType.MCP_SERVER)


def _kind_of(obj: Any) -> ResourceType:
    if isinstance(obj, ChatModel):
        return ResourceType.CHAT_MODEL_CONNECTION
    if isinstance(obj, ChatModelSetup):
        return ResourceType.CHAT_MODEL
    if isinstance(obj, Prompt):
        return ResourceType.PROMPT
    if isinstance(obj, MCPServer):
        return ResourceType.MCP_SERVER
    if isinstance(obj, Tool) or callable(obj):
        return ResourceType.TOOL
    raise ConfigError(
        f"{obj!r} is not a resource: use a ChatModel, ChatModelSetup, Prompt or a tool function"
    )


@dataclass
class ResolvedSetup:
    """A setup with every name resolved: what the built-in actions call."""

    name: str
    model: ChatModel
    model_name: str | None
    prompt: Prompt | None
    tools: dict[str, Tool]
    output_schema: str | None
    max_turns: int | None
    options: dict[str, Any] = field(default_factory=dict)
    mcp_servers: list[MCPServer] = field(default_factory=list)

    async def all_tools(self) -> dict[str, Tool]:
        """`tools` and the tools of the setup's MCP servers (listed on first use)."""
        if not self.mcp_servers:
            return self.tools
        out = dict(self.tools)
        for server in self.mcp_servers:
            for t in await server.list_tools():
                if t.name in out:
                    raise ConfigError(
                        f"chat model setup {self.name!r}: tool {t.name!r} of MCP server "
                        f"{server.name!r} clashes with another tool of that name; give the "
                        f"server a prefix= or allow only some of its tools (tools=[...])"
                    )
                out[t.name] = t
        return out

    def schema(self, name: str | None) -> type[BaseModel] | None:
        name = name or self.output_schema
        return schema_class(name) if name else None


class Resources:
    """The named resources of one agent instance, built and checked once, at start."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._items: dict[ResourceType, dict[str, Any]] = {k: {} for k in ResourceType}
        self._setups: dict[str, ResolvedSetup] = {}

    def add(self, name: str, obj: Any, kind: ResourceType | None = None) -> None:
        if isinstance(obj, ResourceDescriptor):
            obj = obj.build()
        kind = kind or _kind_of(obj)
        if kind == ResourceType.TOOL:
            obj = as_tool(obj)
            if obj.name != name and getattr(obj.fn, _TOOL_ATTR, (None,))[0] is None:
                obj.name = name
        if name in self._items[kind]:
            raise ConfigError(f"{self.owner} declares two {kind.value} resources named {name!r}")
        self._items[kind][name] = obj

    @classmethod
    def from_agent(cls, agent: Any, extra: Mapping[str, Any] | None = None) -> Resources:
        res = cls(f"{type(agent).__module__}.{type(agent).__qualname__}")
        seen: set[str] = set()
        for klass in type(agent).__mro__:
            for attr, raw in vars(klass).items():
                if attr in seen:
                    continue
                target = raw.__func__ if isinstance(raw, staticmethod) else raw
                kind = getattr(target, _RESOURCE_ATTR, None)
                if isinstance(kind, ResourceType):
                    seen.add(attr)
                    try:
                        inspect.signature(target).bind()
                    except TypeError as exc:  # only a signature that needs arguments is blamed
                        raise ConfigError(
                            f"resource {attr!r} of {res.owner} must be a @staticmethod taking no "
                            f"arguments: {exc}"
                        ) from exc
                    except ValueError:  # no signature to read (a builtin): call it and see
                        pass
                    try:
                        built = target()
                    except ConfigError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - the user's factory failed
                        raise ConfigError(
                            f"resource {attr!r} of {res.owner} failed to build: "
                            f"{type(exc).__name__}: {exc}"
                        ) from exc
                    res.add(attr, built, kind)
                elif callable(target) and hasattr(target, _TOOL_ATTR):
                    seen.add(attr)
                    tool_obj = as_tool(target)
                    res.add(tool_obj.name, tool_obj, ResourceType.TOOL)
        for name, obj in (extra or {}).items():
            res.add(name, obj)
        res.resolve_all()
        return res

    def get(self, name: str, kind: ResourceType) -> Any:
        """The resource `name` of `kind` (Flink's `get_resource`)."""
        try:
            return self._items[kind][name]
        except KeyError:
            known = ", ".join(sorted(self._items[kind])) or "none"
            raise ConfigError(
                f"{self.owner} has no {kind.value} resource named {name!r} (declared: {known})"
            ) from None

    def names(self, kind: ResourceType) -> list[str]:
        return sorted(self._items[kind])

    def _resolve_prompt(self, p: str | Prompt | None) -> Prompt | None:
        found: Prompt | None = self.get(p, ResourceType.PROMPT) if isinstance(p, str) else p
        if isinstance(found, MCPPrompt) and isinstance(found.server_ref, str):
            found.bind(self.get(found.server_ref, ResourceType.MCP_SERVER))
        return found

    def _resolve_setup(self, name: str, setup: ChatModelSetup) -> ResolvedSetup:
        conn = setup.connection
        model = (
            self.get(conn, ResourceType.CHAT_MODEL_CONNECTION) if isinstance(conn, str) else conn
        )
        if not isinstance(model, ChatModel):
            raise ConfigError(f"chat model setup {name!r}: connection {conn!r} is not a ChatModel")
        tools: dict[str, Tool] = {}
        servers: list[MCPServer] = []
        for t in setup.tools:
            server = t if isinstance(t, MCPServer) else None
            if isinstance(t, str) and t in self._items[ResourceType.MCP_SERVER]:
                if t in self._items[ResourceType.TOOL]:
                    raise ConfigError(
                        f"chat model setup {name!r} lists {t!r}, which names both a tool and an "
                        f"MCP server of {self.owner}; rename one of them"
                    )
                server = self._items[ResourceType.MCP_SERVER][t]
            if server is not None:
                if server in servers:
                    raise ConfigError(f"chat model setup {name!r} lists MCP server {t!r} twice")
                servers.append(server)
                continue
            tool_obj = self.get(t, ResourceType.TOOL) if isinstance(t, str) else as_tool(t)
            if tool_obj.name in tools:
                raise ConfigError(f"chat model setup {name!r} lists tool {tool_obj.name!r} twice")
            tools[tool_obj.name] = tool_obj
        return ResolvedSetup(
            name=name,
            model=model,
            model_name=setup.model,
            prompt=self._resolve_prompt(setup.prompt),
            tools=tools,
            output_schema=setup.output_schema,
            max_turns=setup.max_turns,
            options=dict(setup.options),
            mcp_servers=servers,
        )

    def resolve_all(self) -> None:
        for p in self._items[ResourceType.PROMPT].values():
            self._resolve_prompt(p)  # binds MCP prompts to their servers, by name
        for name, setup in self._items[ResourceType.CHAT_MODEL].items():
            self._setups[name] = self._resolve_setup(name, setup)

    def setup(self, name: str) -> ResolvedSetup:
        """The setup `name`, or a bare connection `name` used with no prompt or tools."""
        found = self._setups.get(name)
        if found is not None:
            return found
        conn = self._items[ResourceType.CHAT_MODEL_CONNECTION].get(name)
        if conn is not None:
            found = ResolvedSetup(name, conn, None, None, {}, None, None)
            self._setups[name] = found
            return found
        known = ", ".join(
            sorted(self._setups) + sorted(self._items[ResourceType.CHAT_MODEL_CONNECTION])
        )
        raise ConfigError(
            f"{self.owner} has no chat model setup or connection named {name!r} "
            f"(declared: {known or 'none'}); declare one with @chat_model_setup"
        )
