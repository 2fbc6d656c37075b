"""A Flink Agents agent as a ratchet `Agent`: its actions, resources and built-in actions.

`to_ratchet(agent)` builds a ratchet agent class named like the user's (the state directory
records that name) with one ratchet action per Flink action, on the ratchet classes of its
event type strings. Each action gets its event rebuilt from the journal's form and a
`RunnerContext` over ratchet's context, so memory, event sending and durable calls are
ratchet's: committed in order, checkpointed, replayed after a crash.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from enum import Enum
from typing import Any

from pydantic import BaseModel

from ratchet._errors import ConfigError
from ratchet.agents._agent import Agent as RatchetAgent
from ratchet.agents._agent import action as ratchet_action
from ratchet.agents._agent import check_action
from ratchet.agents._context import RunnerContext as RatchetContext
from ratchet.agents._events import Event as RatchetEvent
from ratchet.compat.flink_agents.api.agents.agent import Agent
from ratchet.compat.flink_agents.api.configuration import Configuration
from ratchet.compat.flink_agents.api.decorators import INJECTED_ATTR, RESOURCE_ATTR, TRIGGERS_ATTR
from ratchet.compat.flink_agents.api.events.event import Event
from ratchet.compat.flink_agents.api.memory_object import MemoryObject, MemoryType
from ratchet.compat.flink_agents.api.resource import (
    Resource,
    ResourceContext,
    ResourceDescriptor,
    ResourceType,
)
from ratchet.compat.flink_agents.api.runner_context import RunnerContext
from ratchet.compat.flink_agents.api.tools.tool import FunctionTool
from ratchet.compat.flink_agents.runtime import _wire
from ratchet.store import codec


class Resources(ResourceContext):
    """The agent's resources by kind and name, built and opened once, on first use."""

    def __init__(self, declared: dict[ResourceType, dict[str, Any]], config: Configuration) -> None:
        self._declared = declared
        self._config = config
        self._built: dict[tuple[ResourceType, str], Resource] = {}
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:
        # Shipped to Flink's Python workers as declarations: built resources and the lock
        # stay here, each worker builds its own on first use.
        return {"_declared": self._declared, "_config": self._config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._declared = state["_declared"]
        self._config = state["_config"]
        self._built = {}
        self._lock = threading.RLock()

    def get_resource(self, name: str, type: ResourceType) -> Resource:  # noqa: A002
        with self._lock:
            found = self._built.get((type, name))
            if found is None:
                found = self._built[(type, name)] = self._build(name, type)
            return found

    def _build(self, name: str, kind: ResourceType) -> Resource:
        spec = self._declared.get(kind, {}).get(name)
        if spec is None:
            known = ", ".join(sorted(self._declared.get(kind, {}))) or "none"
            raise ValueError(
                f"the agent has no {kind.value} resource named {name!r} (its {kind.value} "
                f"resources: {known}); declare it on the agent or with env.add_resource()"
            )
        resource: Any
        if isinstance(spec, ResourceDescriptor):
            resource = spec.clazz(**spec.arguments, resource_context=self)
        elif isinstance(spec, Resource):
            resource = spec
            resource.resource_context = self
        elif callable(spec) and kind is ResourceType.TOOL:
            resource = FunctionTool.of(spec, dict(getattr(spec, INJECTED_ATTR, None) or {}))
            resource.resource_context = self
        else:
            raise ValueError(
                f"{kind.value} resource {name!r} is {spec!r}; declare a ResourceDescriptor(...) "
                f"or a resource instance"
            )
        resource.open()
        return resource  # type: ignore[no-any-return]

    def close(self) -> None:
        with self._lock:
            for resource in self._built.values():
                resource.close()
            self._built.clear()


class Hooks:
    """What an execution environment watches: failures and tool requests."""

    def __init__(self) -> None:
        self.errors: list[tuple[Any, int, BaseException]] = []
        self.tool_requests: list[Event] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {}  # what a worker sees starts empty (the local environment reads these)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def failed(self, key: Any, seq: int, exc: BaseException) -> None:
        with self._lock:
            self.errors.append((key, seq, exc))

    def sent(self, event: Event) -> None:
        if event.type == "_tool_request_event":
            with self._lock:
                self.tool_requests.append(event)


class FlinkContext(RunnerContext):
    """Flink Agents' `RunnerContext` over ratchet's."""

    def __init__(
        self,
        ctx: RatchetContext,
        resources: Resources,
        config: Configuration,
        action_config: dict[str, Any] | None,
        hooks: Hooks,
    ) -> None:
        self._ctx = ctx
        self._resources = resources
        self._config = config
        self._action_config = dict(action_config or {})
        self._hooks = hooks
        self._sensory = MemoryObject(MemoryType.SENSORY, ctx.sensory_memory)
        self._short_term = MemoryObject(MemoryType.SHORT_TERM, ctx.short_term_memory)

    @property
    def key(self) -> Any:
        return self._ctx.key

    def send_event(self, event: Event) -> None:
        self._ctx.send_event(_wire.to_ratchet(event))
        self._hooks.sent(event)

    def get_resource(self, name: str, type: ResourceType, metric_group: Any = None) -> Resource:  # noqa: A002
        return self._resources.get_resource(name, type)

    @property
    def action_config(self) -> dict[str, Any]:
        return dict(self._action_config)

    def get_action_config_value(self, key: str) -> Any:
        return self._action_config.get(key)

    @property
    def sensory_memory(self) -> MemoryObject:
        return self._sensory

    @property
    def short_term_memory(self) -> MemoryObject:
        return self._short_term

    @property
    def long_term_memory(self) -> Any:
        raise NotImplementedError(
            "long-term memory is not available on ratchet; keep what must last in "
            "ctx.short_term_memory (per key, durable)"
        )

    def durable_execute(
        self,
        func: Callable[..., Any],
        *args: Any,
        reconciler: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        return self._ctx.durable_execute(func, *args, reconciler=_no_args(reconciler), **kwargs)

    def durable_execute_async(
        self,
        func: Callable[..., Any],
        *args: Any,
        reconciler: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        return self._ctx.durable_execute_async(
            func, *args, reconciler=_no_args(reconciler), **kwargs
        )

    @property
    def config(self) -> Configuration:
        return self._config


def _no_args(reconciler: Callable[[], Any] | None) -> Callable[..., Any] | None:
    """Flink Agents' reconciler takes no arguments; ratchet passes the call's arguments."""
    if reconciler is None:
        return None
    if not callable(reconciler):
        raise TypeError(f"reconciler= takes a function of no arguments, got {reconciler!r}")

    def reconcile(*_args: Any, **_kwargs: Any) -> Any:
        return reconciler()

    return reconcile


class _Declared:
    """An agent's actions and resources, in the order they were declared."""

    def __init__(self, agent: Agent) -> None:
        self.actions: list[tuple[str, tuple[str, ...], Callable[..., Any], dict[str, Any] | None]]
        self.actions = []
        self.resources: dict[ResourceType, dict[str, Any]] = {t: {} for t in ResourceType}
        seen: set[str] = set()
        for klass in reversed(type(agent).__mro__):
            for attr, raw in vars(klass).items():
                fn = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
                triggers = getattr(fn, TRIGGERS_ATTR, None)
                if triggers is not None and callable(fn):
                    if not isinstance(raw, staticmethod):
                        raise ConfigError(
                            f"action {type(agent).__qualname__}.{attr} must be a @staticmethod "
                            f"taking (event, ctx): put @staticmethod under @action(...)"
                        )
                    where = f"{type(agent).__qualname__}.{attr}"
                    check_action(fn, fn, where, fix="write (event, ctx) under @staticmethod")
                    self.actions = [a for a in self.actions if a[0] != attr]
                    self.actions.append((attr, tuple(triggers), fn, None))
                    seen.add(attr)
                kind = getattr(fn, RESOURCE_ATTR, None)
                if kind is not None and callable(fn):
                    rtype = ResourceType(kind)
                    if rtype is ResourceType.TOOL:
                        self.resources[rtype][attr] = fn
                    else:
                        declare: Any = fn  # a function of no arguments returning the resource
                        self.resources[rtype][attr] = declare()
        for name, (triggers, func, config) in getattr(agent, "_actions", {}).items():
            if name in seen:
                raise ConfigError(f"action {name!r} is defined twice on {type(agent).__qualname__}")
            target = getattr(func, "__func__", func)
            where = f"{type(agent).__qualname__}.{name}"
            check_action(target, target, where, fix="give a function of (event, ctx)")
            self.actions.append((name, tuple(triggers), target, config))
        for kind, named in getattr(agent, "_resources", {}).items():
            self.resources[kind].update(named)


def _register_user_types(agent: Agent) -> None:
    """Admit the pydantic models and enums defined in the agent's module to the codec, so the
    events and outputs that carry them are journaled as themselves. The same registrations
    happen when the agent is applied again after a crash, before anything is decoded."""
    module = sys.modules.get(type(agent).__module__)
    if module is None:
        return
    for value in list(vars(module).values()):
        if not isinstance(value, type) or value.__module__ != module.__name__:
            continue
        if issubclass(value, Event | Resource | Agent):
            continue
        if issubclass(value, BaseModel | Enum) and codec.registered_name(value) is None:
            try:
                codec.register(value)
            except Exception:  # noqa: BLE001 - a class the codec cannot take stays unregistered
                continue


def _make_action(
    name: str,
    fn: Callable[..., Any],
    action_config: dict[str, Any] | None,
    resources: Resources,
    config: Configuration,
    hooks: Hooks,
    input_field: str | None,
) -> Callable[..., Any]:
    def context(ctx: RatchetContext) -> FlinkContext:
        from ratchet.compat.flink_agents.runtime.local_runner import LocalRunnerContext

        return LocalRunnerContext(ctx, resources, config, action_config, hooks)

    if inspect.iscoroutinefunction(fn):

        async def run_async(event: RatchetEvent, ctx: RatchetContext) -> None:
            try:
                await fn(_wire.to_flink(event, input_field), context(ctx))
            except Exception as exc:
                hooks.failed(ctx.key, ctx.seq, exc)
                raise

        run_async.__name__ = run_async.__qualname__ = name
        return run_async

    def run(event: RatchetEvent, ctx: RatchetContext) -> None:
        try:
            out = fn(_wire.to_flink(event, input_field), context(ctx))
            if inspect.isawaitable(out):
                close = getattr(out, "close", None)
                if close is not None:
                    close()
                raise TypeError(f"action {name} returned an awaitable; declare it `async def`")
        except Exception as exc:
            hooks.failed(ctx.key, ctx.seq, exc)
            raise

    run.__name__ = run.__qualname__ = name
    return run


def to_ratchet(
    agent: Agent,
    *,
    config: Configuration | None = None,
    resources: dict[ResourceType, dict[str, Any]] | None = None,
    hooks: Hooks | None = None,
    input_field: str | None = None,
) -> RatchetAgent:
    """A ratchet `Agent` running `agent` (a Flink Agents agent): for `ratchet.run`,
    `ratchet run module:agent` and `ratchet flink run`. `resources` add to (and are
    overridden by) the agent's own; the built-in chat and tool actions are always on.
    `input_field`: the field of each input record that is the `InputEvent`'s input (default:
    the whole record, as Flink's datastream path gives it)."""
    if not isinstance(agent, Agent):
        raise ConfigError(
            f"{agent!r} is not a ratchet.compat.flink_agents Agent; subclass "
            f"ratchet.compat.flink_agents.api.agents.agent.Agent"
        )
    from ratchet.compat.flink_agents.runtime import _builtin

    _register_user_types(agent)
    declared = _Declared(agent)
    merged: dict[ResourceType, dict[str, Any]] = {t: {} for t in ResourceType}
    for kind, named in (resources or {}).items():
        merged[kind].update(named)
    for kind, named in declared.resources.items():
        merged[kind].update(named)
    cfg = config if config is not None else Configuration()
    store = Resources(merged, cfg)
    watch = hooks if hooks is not None else Hooks()
    actions = list(declared.actions)
    names = {a[0] for a in actions}
    for builtin_name, builtin_triggers, builtin_fn in _builtin.ACTIONS:
        if builtin_name not in names:
            actions.append((builtin_name, tuple(builtin_triggers), builtin_fn, None))
    if not actions:
        raise ConfigError(f"{type(agent).__qualname__} has no actions; add one with @action(...)")
    attrs: dict[str, Any] = {
        "__module__": type(agent).__module__,
        "__qualname__": type(agent).__qualname__,
        "flink_agent": agent,
        "flink_resources": store,
        "flink_hooks": watch,
    }
    for name, triggers, fn, action_config in actions:
        classes: list[type[RatchetEvent]] = []
        for t in triggers:
            classes.extend(_wire.listened_classes(t))
        runner = _make_action(name, fn, action_config, store, cfg, watch, input_field)
        attrs[name] = staticmethod(ratchet_action(*classes, name=name)(runner))
    cls = type(type(agent).__name__, (RatchetAgent,), attrs)
    return cls()  # type: ignore[no-any-return]
