"""Tool arguments the framework fills in (from config or memory), hidden from the model."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from enum import Enum
from typing import Any

from pydantic import BaseModel

from ratchet.store import codec


class ToolParameterSource(str, Enum):  # noqa: UP042 - their type: a str subclass
    """Where an injected argument's value comes from."""

    CONFIG = "config"
    SENSORY_MEMORY = "sensory_memory"
    SHORT_TERM_MEMORY = "short_term_memory"


class InjectedArg(BaseModel):
    """An injected argument: its source and the key (config key or memory path) to read."""

    source: ToolParameterSource = ToolParameterSource.SENSORY_MEMORY
    key: str | None = None

    @staticmethod
    def from_config(key: str) -> InjectedArg:
        return InjectedArg(source=ToolParameterSource.CONFIG, key=key)

    @staticmethod
    def from_sensory_memory(path: str) -> InjectedArg:
        return InjectedArg(source=ToolParameterSource.SENSORY_MEMORY, key=path)

    @staticmethod
    def from_short_term_memory(path: str) -> InjectedArg:
        return InjectedArg(source=ToolParameterSource.SHORT_TERM_MEMORY, key=path)

    def with_default_key(self, key: str) -> InjectedArg:
        return self if self.key else InjectedArg(source=self.source, key=key)


def normalize_injected_args(
    injected_args: dict[str, InjectedArg | dict[str, Any]] | None,
) -> dict[str, InjectedArg]:
    """`{param: InjectedArg or its dict}` to `{param: InjectedArg}`; a missing key is the
    parameter's own name."""
    out: dict[str, InjectedArg] = {}
    for name, spec in (injected_args or {}).items():
        arg = spec if isinstance(spec, InjectedArg) else InjectedArg.model_validate(spec)
        out[name] = arg.with_default_key(name)
    return out


def validate_injected_arg_names(func: Callable[..., Any], injected: dict[str, InjectedArg]) -> None:
    """Refuse an injected name the function has no parameter for."""
    params = inspect.signature(func).parameters
    unknown = [name for name in injected if name not in params]
    if unknown:
        raise ValueError(
            f"tool {getattr(func, '__qualname__', func)!r}: injected argument(s) "
            f"{', '.join(map(repr, unknown))} are not parameters of the function "
            f"(it takes {', '.join(params) or 'none'})"
        )


codec.register(ToolParameterSource, "flink_agents.ToolParameterSource")
codec.register(InjectedArg, "flink_agents.InjectedArg")
