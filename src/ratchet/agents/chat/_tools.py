"""`Tool`: a plain Python function the model may call, with a JSON schema from its type hints."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints

import pydantic
import pydantic_core
from pydantic import BaseModel, ConfigDict

from ratchet._errors import ConfigError

_TOOL_ATTR = "__ratchet_tool__"


@dataclass(frozen=True)
class ToolContext:
    """What a tool may ask for by declaring a parameter annotated `ToolContext`.

    `idempotency_key` is stable for this tool call across crashes and restarts (and distinct
    from every other call): pass it to an external API so a call that is re-run after a crash
    (it had started but its result was not yet recorded) is deduplicated on their side.
    """

    tool_name: str
    call_id: str
    idempotency_key: str
    key: Any


def _doc_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(summary, {param: description}) from a Google- or reST-style docstring."""
    text = inspect.cleandoc(doc or "")
    params: dict[str, str] = {}
    summary_lines: list[str] = []
    section = None
    for line in text.splitlines():
        stripped = line.strip()
        if re.fullmatch(r"(Args|Arguments|Parameters|Params):", stripped):
            section = "args"
            continue
        if re.fullmatch(r"(Returns?|Raises|Yields|Examples?|Notes?):", stripped):
            section = "other"
            continue
        m = re.match(r":param\s+(\w+):\s*(.*)", stripped)
        if m:
            params[m.group(1)] = m.group(2)
            continue
        if section == "args":
            m = re.match(r"(\w+)\s*(\([^)]*\))?\s*:\s*(.*)", stripped)
            if m:
                params[m.group(1)] = m.group(3)
            continue
        if section is None:
            summary_lines.append(line)
    return "\n".join(summary_lines).strip(), params


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {
            k: _strip_titles(v)
            for k, v in schema.items()
            if not (k == "title" and isinstance(v, str))
        }
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


def format_validation_error(exc: pydantic.ValidationError) -> str:
    """Pydantic's errors as short lines a model can act on."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


class Tool:
    """A function the model may call. Build one with `Tool.from_function` or the `@tool` mark.

    The JSON schema of its parameters comes from the function's type hints (through pydantic),
    its description from the docstring's summary, parameter descriptions from an `Args:`
    section. Arguments from the model are validated before the function is called.

    `requires_approval=True`: the chat agent asks a person before every call (an
    `approval_request` output, then a durable wait for the signal `approval:<call id>`; see
    docs/chat.md, "Tools that need approval").
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        requires_approval: bool = False,
    ) -> None:
        target = fn.__func__ if isinstance(fn, staticmethod) else fn
        if not callable(target):
            raise ConfigError(f"a tool must be a function, not {fn!r}")
        if not isinstance(requires_approval, bool):
            raise ConfigError(
                f"requires_approval of tool {fn!r} must be True or False, not {requires_approval!r}"
            )
        self.fn: Callable[..., Any] = target
        self.name = name or target.__name__
        self.requires_approval = requires_approval
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.name):
            raise ConfigError(
                f"tool name {self.name!r} must be 1-64 letters, digits, '_' or '-' (providers "
                f"refuse other names); pass name=..."
            )
        summary, param_docs = _doc_parts(target.__doc__ or "")
        self.description = description or summary
        if not self.description:
            raise ConfigError(
                f"tool {self.name!r} has no description: give the function a docstring saying "
                f"what it does (the model reads it to decide when to call it)"
            )
        self.is_async = inspect.iscoroutinefunction(target)
        try:
            hints = get_type_hints(target)
        except Exception as exc:
            raise ConfigError(f"cannot read the type hints of tool {self.name!r}: {exc}") from exc
        fields: dict[str, Any] = {}
        self._context_param: str | None = None
        for pname, param in inspect.signature(target).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise ConfigError(f"tool {self.name!r}: *{pname} parameters cannot be described")
            hint = hints.get(pname)
            if hint is ToolContext:
                self._context_param = pname
                continue
            if hint is None:
                raise ConfigError(
                    f"tool {self.name!r}: parameter {pname!r} has no type hint; annotate it "
                    f"(e.g. `{pname}: str`) so the model is told what to pass"
                )
            default = ... if param.default is param.empty else param.default
            fields[pname] = (
                hint,
                pydantic.Field(default, description=param_docs.get(pname)),
            )
        self._args_model: type[BaseModel] = pydantic.create_model(
            f"{self.name}_arguments",
            __config__=ConfigDict(extra="forbid"),
            **fields,
        )
        self.parameters: dict[str, Any] = _strip_titles(self._args_model.model_json_schema())
        self.parameters.setdefault("properties", {})

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        requires_approval: bool = False,
    ) -> Tool:
        return cls(fn, name=name, description=description, requires_approval=requires_approval)

    def validate_arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The validated keyword arguments; raises pydantic.ValidationError."""
        model = self._args_model.model_validate(arguments)
        return {name: getattr(model, name) for name in type(model).model_fields}

    async def invoke(self, arguments: dict[str, Any], context: ToolContext) -> Any:
        """Validate and call. A sync function runs in a thread, off the event loop."""
        kwargs = self.validate_arguments(arguments)
        if self._context_param is not None:
            kwargs[self._context_param] = context
        if self.is_async:
            return await self.fn(**kwargs)
        result = await asyncio.to_thread(self.fn, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    def spec(self) -> dict[str, Any]:
        """{name, description, parameters}: what every provider adapter turns into its format."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def __repr__(self) -> str:
        if self.requires_approval:
            return f"Tool({self.name!r}, requires_approval=True)"
        return f"Tool({self.name!r})"


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    requires_approval: bool = False,
) -> Any:
    """Mark a function (or a staticmethod of a `ChatAgent`) as a tool resource.

    The function stays callable as before; on an agent class it is registered under its name.
    `@tool(requires_approval=True)` makes the chat agent ask a person before each call.
    """
    if not isinstance(requires_approval, bool):
        raise ConfigError(f"requires_approval must be True or False, not {requires_approval!r}")

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        target = f.__func__ if isinstance(f, staticmethod) else f
        setattr(target, _TOOL_ATTR, (name, description, requires_approval))
        return f

    return mark(fn) if fn is not None else mark


def as_tool(obj: Any) -> Tool:
    """A Tool from a Tool, a function (marked with @tool or not) or a staticmethod."""
    if isinstance(obj, Tool):
        return obj
    target = obj.__func__ if isinstance(obj, staticmethod) else obj
    name, description, requires_approval = getattr(target, _TOOL_ATTR, (None, None, False))
    return Tool(target, name=name, description=description, requires_approval=requires_approval)


def render_result(value: Any) -> str:
    """A tool's return value as the text the model reads (str as is, anything else as JSON)."""
    if isinstance(value, str):
        return value
    return json.dumps(pydantic_core.to_jsonable_python(value), ensure_ascii=False, sort_keys=True)
