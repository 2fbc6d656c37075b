"""`Agent` and `@action`: how a user declares which code reacts to which events."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from ratchet._errors import ConfigError
from ratchet.agents._events import Event
from ratchet.agents._retry import Retry
from ratchet.store._base import DispatchTable

F = TypeVar("F", bound=Callable[..., Any])

_ACTION_ATTR = "__ratchet_action__"
_MIGRATION_ATTR = "__ratchet_migration__"


@dataclass(frozen=True)
class _ActionMark:
    event_types: tuple[type[Event], ...]
    inline: bool
    name: str | None
    retry: Retry | None = None


def action(
    *event_types: type[Event],
    inline: bool = False,
    name: str | None = None,
    retry: Retry | None = None,
) -> Callable[[F], F]:
    """Mark a method `(self, event, ctx)` (a staticmethod: `(event, ctx)`; a classmethod:
    `(cls, event, ctx)`) as an action on `event_types`; it returns None.

    Sync actions run on worker threads so a blocking call never stalls other keys;
    `inline=True` runs a CPU-trivial sync action on the engine's loop instead.
    `name` overrides the action's stored name (default: the function name); the name is
    part of every task id in the journal, so renaming an action invalidates state.
    `retry`: a `ratchet.Retry` policy; a failed attempt is tried again from the memory the task
    was dispatched with, after a durable wait (docs/runtime.md, "Retries").
    """
    if retry is not None and not isinstance(retry, Retry):
        raise ConfigError(f"@action(retry=) takes a ratchet.Retry(...), got {retry!r}")
    if not event_types:
        raise ConfigError("@action() needs at least one event type, e.g. @action(InputEvent)")
    for et in event_types:
        if not (isinstance(et, type) and issubclass(et, Event)):
            target = et.__func__ if isinstance(et, staticmethod | classmethod) else et
            if inspect.isfunction(target):  # a bare `@action` handed the method itself
                raise ConfigError(
                    f"@action needs the event types it handles: write @action(InputEvent) "
                    f"(or other Event subclasses) above {target.__qualname__}, not a bare @action"
                )
            raise ConfigError(f"@action() takes Event subclasses; got {et!r}")

    def mark(fn: F) -> F:
        target = fn.__func__ if isinstance(fn, staticmethod | classmethod) else fn
        setattr(target, _ACTION_ATTR, _ActionMark(tuple(event_types), inline, name, retry))
        return fn

    return mark


def migration(from_version: int) -> Callable[[F], F]:
    """Mark a method `(self, memory)` that brings a key's memory from `from_version` to the next.

    `memory` is the key's short-term memory (`get`/`set`/`delete`, as in actions). Each key is
    migrated once, when its first run after the upgrade starts or by `ratchet migrate`; the
    result is committed with the key, so a crash before that commit runs it again on the old
    memory (keep it a function of the memory: no calls, no side effects that must not repeat).
    """
    if type(from_version) is not int or from_version < 1:
        raise ConfigError(
            f"@migration() takes the memory version it migrates from, an int >= 1; got "
            f"{from_version!r}"
        )

    def mark(fn: F) -> F:
        target = fn.__func__ if isinstance(fn, staticmethod | classmethod) else fn
        setattr(target, _MIGRATION_ATTR, from_version)
        return fn

    return mark


@dataclass(frozen=True)
class ActionSpec:
    """One action of an agent, resolved for the engine."""

    index: int
    name: str
    event_types: tuple[type[Event], ...]
    fn: Callable[..., Any]
    is_async: bool
    inline: bool
    retry: Retry | None = None


class Agent:
    """Subclass this and decorate methods with `@action`.

    Instance attributes are configuration, not state: they are not checkpointed, and
    a restart builds a fresh instance. Keep anything that must survive in
    `ctx.short_term_memory` (per key) or `ctx.sensory_memory` (per run).

    `memory_version`: the layout version of this agent's short-term memory. Raise it when a
    new version reads memory differently, and add `@migration(old)` methods that bring a
    key's memory from each older version to the next (docs/runtime.md, "Upgrading an agent").
    """

    memory_version: ClassVar[int] = 1
    # `ratchet.LongTermMemoryConfig(embedding=...)` turns on `ctx.long_term_memory`.
    long_term_memory: ClassVar[Any] = None


class AgentSpec:
    """The actions of one agent instance, in definition order, and a dispatch table."""

    def __init__(self, agent: Agent) -> None:
        if not isinstance(agent, Agent):
            raise ConfigError(f"{agent!r} is not an instance of ratchet.Agent")
        self.agent = agent
        self.agent_name = f"{type(agent).__module__}.{type(agent).__qualname__}"
        actions: list[ActionSpec] = []
        seen: dict[str, str] = {}
        for klass in reversed(type(agent).__mro__):
            for attr, raw in vars(klass).items():
                target = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
                mark = getattr(target, _ACTION_ATTR, None)
                if not isinstance(mark, _ActionMark):
                    continue
                action_name = mark.name or attr
                if not action_name or any(c in action_name for c in ">#!"):
                    raise ConfigError(
                        f"action name {action_name!r} of {self.agent_name}: use a non-empty name "
                        f"without '>', '#' or '!' (task ids and journal entries use them)"
                    )
                if action_name in seen and seen[action_name] != attr:
                    raise ConfigError(f"two actions of {self.agent_name} are named {action_name!r}")
                bound = getattr(agent, attr)
                check_action(bound, target, f"{type(agent).__qualname__}.{attr}")
                spec = ActionSpec(
                    index=0,
                    name=action_name,
                    event_types=mark.event_types,
                    fn=bound,
                    is_async=inspect.iscoroutinefunction(target),
                    inline=mark.inline,
                    retry=mark.retry,
                )
                # An override in a subclass replaces the base's action in place.
                actions = [a for a in actions if a.name != action_name]
                actions.append(spec)
                seen[action_name] = attr
        if not actions:
            raise ConfigError(
                f"{self.agent_name} has no actions; decorate a method with @action(...)"
            )
        self.actions: tuple[ActionSpec, ...] = tuple(
            ActionSpec(i, a.name, a.event_types, a.fn, a.is_async, a.inline, a.retry)
            for i, a in enumerate(actions)
        )
        self._by_type: dict[type[Event], tuple[ActionSpec, ...]] = {}
        self.memory_version = getattr(type(agent), "memory_version", 1)
        if type(self.memory_version) is not int or self.memory_version < 1:
            raise ConfigError(
                f"{self.agent_name}.memory_version must be an int >= 1, not {self.memory_version!r}"
            )
        self.migrations: dict[int, Callable[..., Any]] = {}
        for klass in reversed(type(agent).__mro__):
            for attr, raw in vars(klass).items():
                target = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
                version = getattr(target, _MIGRATION_ATTR, None)
                if version is None:
                    continue
                if version >= self.memory_version:
                    raise ConfigError(
                        f"{self.agent_name}.{attr} migrates from memory version {version}, but "
                        f"the agent's memory_version is {self.memory_version}; a migration from "
                        f"version v brings memory to v + 1, so raise memory_version to "
                        f"{version + 1} (or fix the decorator's version)"
                    )
                other = self.migrations.get(version)
                if other is not None and other.__name__ != attr:
                    raise ConfigError(
                        f"{self.agent_name} has two migrations from memory version {version} "
                        f"({other.__name__} and {attr}); keep one"
                    )
                self.migrations[version] = getattr(agent, attr)

    def listeners(self, event_type: type[Event]) -> tuple[ActionSpec, ...]:
        """Actions on `event_type` (or a base class of it), in definition order."""
        found = self._by_type.get(event_type)
        if found is None:
            found = tuple(
                a for a in self.actions if any(issubclass(event_type, t) for t in a.event_types)
            )
            self._by_type[event_type] = found
        return found

    def table(self) -> DispatchTable:
        """Which action hears which events, in dispatch order: what replay depends on."""
        return [(a.name, sorted(t.event_name for t in a.event_types)) for a in self.actions]

    def fingerprint(self) -> str:
        """A short name for the dispatch table (the action names and the events they hear)."""
        return table_fingerprint(self.table())

    def describe(self) -> list[str]:
        return [f"{a.name}({', '.join(t.event_name for t in a.event_types)})" for a in self.actions]


def check_action(
    bound: Callable[..., Any],
    target: Any,
    where: str,
    fix: str = "write (self, event, ctx), or (event, ctx) under @staticmethod",
) -> None:
    """Refuse at load an action every run would fail on, or whose work would be lost."""
    if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
        raise ConfigError(
            f"action {where} is a generator function (it yields), and nothing iterates an "
            f"action's result; send each event with ctx.send_event(...) instead of yield"
        )
    try:
        signature = inspect.signature(bound)
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): its first call says what is wrong
    try:
        signature.bind(None, None)  # what the engine passes: (event, ctx)
    except TypeError:
        raise ConfigError(
            f"action {where} has parameters {inspect.signature(target)}, but an action is "
            f"called with an event and a context: {fix}"
        ) from None


def table_fingerprint(table: DispatchTable) -> str:
    text = ";".join(f"{name}<-{','.join(events)}" for name, events in table)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
