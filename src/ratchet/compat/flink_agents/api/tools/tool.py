"""Tools: a callable with metadata (name, description, argument schema) the model sees."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from ratchet.compat.flink_agents.api.resource import ResourceType, SerializableResource
from ratchet.compat.flink_agents.api.tools.tool_parameter_injection import (
    InjectedArg,
    normalize_injected_args,
    validate_injected_arg_names,
)
from ratchet.store import codec


class ToolType(Enum):
    """Kinds of tools."""

    MODEL_BUILT_IN = "model_built_in"
    FUNCTION = "function"
    REMOTE_FUNCTION = "remote_function"
    MCP = "mcp"


class ToolMetadata(BaseModel):
    """What the model is told about a tool."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    description: str
    args_schema: type[BaseModel]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ToolMetadata)
            and self.name == other.name
            and self.description == other.description
            and self.args_schema.model_json_schema() == other.args_schema.model_json_schema()
        )

    def __hash__(self) -> int:
        return hash((self.name, self.description))

    def get_parameters_dict(self) -> dict[str, Any]:
        """The JSON schema of the arguments (type, properties, required, definitions)."""
        schema = self.args_schema.model_json_schema()
        keep = ("type", "properties", "required", "definitions", "$defs")
        return {k: v for k, v in schema.items() if k in keep}


class Tool(SerializableResource, ABC):
    """A tool resource; subclasses implement `call` and `tool_type`."""

    metadata: ToolMetadata | None = None

    @staticmethod
    def from_callable(
        func: Callable[..., Any],
        *,
        injected_args: dict[str, InjectedArg | dict[str, Any]] | None = None,
    ) -> FunctionTool:
        """A tool calling `func`; `injected_args` are filled by the runner, not the model."""
        injected = dict(getattr(func, "_flink_injected_args", None) or {})
        injected.update(normalize_injected_args(injected_args))
        return FunctionTool.of(func, injected)

    @property
    def name(self) -> str:
        if self.metadata is None:
            raise ValueError(f"{type(self).__name__} has no metadata")
        return self.metadata.name

    @classmethod
    def resource_type(cls) -> ResourceType:
        return ResourceType.TOOL

    @classmethod
    @abstractmethod
    def tool_type(cls) -> ToolType:
        """The kind of this tool."""

    @abstractmethod
    def call(self, *args: Any, **kwargs: Any) -> Any:
        """Run the tool."""


def _description(func: Callable[..., Any]) -> str:
    doc = inspect.getdoc(func) or ""
    return doc.strip()


def _schema(func: Callable[..., Any], hidden: set[str]) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for name, param in inspect.signature(func).parameters.items():
        if name in hidden or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = Any if param.annotation is inspect.Parameter.empty else param.annotation
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[name] = (annotation, default)
    model: type[BaseModel] = create_model(getattr(func, "__name__", "tool"), **fields)
    return model


class FunctionTool(Tool):
    """A Python function as a tool."""

    func: Any = Field(default=None, exclude=True)
    injected_args: dict[str, InjectedArg] = Field(default_factory=dict)

    @classmethod
    def of(cls, func: Callable[..., Any], injected: dict[str, InjectedArg]) -> FunctionTool:
        target = func.__func__ if isinstance(func, staticmethod) else func
        validate_injected_arg_names(target, injected)
        metadata = ToolMetadata(
            name=target.__name__,
            description=_description(target),
            args_schema=_schema(target, set(injected)),
        )
        return cls(func=target, injected_args=injected, metadata=metadata)

    @classmethod
    def tool_type(cls) -> ToolType:
        return ToolType.FUNCTION

    def call(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)


codec.register(ToolType, "flink_agents.ToolType")
