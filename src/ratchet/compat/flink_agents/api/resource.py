"""Resources an agent declares (chat models, tools, prompts, ...) and how they are described."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


class ResourceType(Enum):
    """The kinds of resources; `ctx.get_resource(name, type)` looks a name up in one kind."""

    CHAT_MODEL = "chat_model"
    CHAT_MODEL_CONNECTION = "chat_model_connection"
    TOOL = "tool"
    EMBEDDING_MODEL = "embedding_model"
    EMBEDDING_MODEL_CONNECTION = "embedding_model_connection"
    VECTOR_STORE = "vector_store"
    PROMPT = "prompt"
    MCP_SERVER = "mcp_server"
    SKILLS = "skills"


class ResourceContext(ABC):
    """What a resource uses to reach the agent's other resources."""

    @abstractmethod
    def get_resource(self, name: str, type: ResourceType) -> Resource:  # noqa: A002
        """The resource `name` of kind `type`, built and opened on first use."""


class Resource(BaseModel, ABC):
    """Base of every resource. `resource_context` is set by the runner when it builds one."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    resource_context: Any = Field(default=None, exclude=True)
    _metric_group: Any = PrivateAttr(default=None)

    @classmethod
    @abstractmethod
    def resource_type(cls) -> ResourceType:
        """The kind of this resource."""

    def set_metric_group(self, metric_group: Any) -> None:
        self._metric_group = metric_group

    @property
    def metric_group(self) -> Any:
        return self._metric_group

    def open(self) -> None:
        """Called once after the resource is built, before its first use."""

    def close(self) -> None:
        """Called when the job ends."""


class SerializableResource(Resource, ABC):
    """A resource given as an instance (a prompt, a tool) rather than by a descriptor."""


class ResourceDescriptor(BaseModel):
    """A resource by class and constructor arguments: `ResourceDescriptor(clazz="pkg.mod.Cls",
    **kwargs)` (a class object is taken too). The class is imported when first used."""

    target_module: str
    target_clazz: str
    arguments: dict[str, Any]
    _clazz: Any = PrivateAttr(default=None)

    def __init__(
        self,
        /,
        *,
        clazz: str | type | None = None,
        target_module: str | None = None,
        target_clazz: str | None = None,
        arguments: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        given_class = None
        if isinstance(clazz, type):
            given_class = clazz
            target_module, target_clazz = clazz.__module__, clazz.__qualname__
        elif isinstance(clazz, str):
            target_module, _, target_clazz = clazz.rpartition(".")
        if not target_module or not target_clazz:
            raise ValueError(
                f"ResourceDescriptor needs the resource's class: clazz='package.module.Class' "
                f"(got clazz={clazz!r})"
            )
        args = dict(arguments or {})
        args.update(kwargs)
        super().__init__(target_module=target_module, target_clazz=target_clazz, arguments=args)
        self._clazz = given_class

    @property
    def clazz(self) -> type[Resource]:
        """The resource class, imported from `target_module` on first use."""
        if self._clazz is None:
            try:
                module = importlib.import_module(self.target_module)
            except ImportError as exc:
                raise ValueError(
                    f"resource class {self.target_module}.{self.target_clazz}: cannot import "
                    f"{self.target_module!r} ({exc})"
                ) from exc
            found: Any = module
            for part in self.target_clazz.split("."):
                found = getattr(found, part, None)
            if not isinstance(found, type):
                raise ValueError(
                    f"resource class {self.target_module}.{self.target_clazz} does not exist"
                )
            self._clazz = found
        return self._clazz  # type: ignore[no-any-return]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ResourceDescriptor) and (
            self.target_module,
            self.target_clazz,
            self.arguments,
        ) == (other.target_module, other.target_clazz, other.arguments)

    def __hash__(self) -> int:
        return hash((self.target_module, self.target_clazz))
