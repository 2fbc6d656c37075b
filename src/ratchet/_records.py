"""`typing.NamedTuple`'s class syntax at run time without `typing`.

A `class Facts(NamedTuple)` body in a module with `from __future__ import annotations` has
`typing` compile each field's annotation (a `ForwardRef` per field) and needs `typing`
imported: together 3-4 ms of every `ratchet checks` start-up, for records whose
annotations nothing reads at run time. A module writes

    TYPE_CHECKING = False
    if TYPE_CHECKING:
        from typing import NamedTuple
    else:
        from ratchet._records import NamedTuple

so that the type checker sees `typing.NamedTuple`, and the class statement builds the same
class `typing` would (`collections.namedtuple` with the body's fields, defaults, docstring
and methods), its `__annotations__` left as the strings they are.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

__all__ = ["NamedTuple"]

# As in `typing`: what a body may not define, and what it defines that is not copied.
_PROHIBITED = frozenset(
    {
        "__new__",
        "__init__",
        "__slots__",
        "__getnewargs__",
        "_fields",
        "_field_defaults",
        "_make",
        "_replace",
        "_asdict",
        "_source",
    }
)
_SPECIAL = frozenset({"__module__", "__name__", "__annotations__"})
# Called through a plain name: the type checker treats a direct call as a class definition.
_namedtuple: Callable[..., type] = collections.namedtuple


class _NamedTupleMeta(type):
    """Turns a class body into a `collections.namedtuple` class, as `typing`'s does."""

    def __new__(mcls, typename: str, bases: tuple[type, ...], namespace: dict[str, object]) -> type:
        if bases != (NamedTuple,):
            raise TypeError("can only inherit from NamedTuple alone (no other base, no Generic)")
        annotations = namespace.get("__annotations__") or {}
        assert isinstance(annotations, dict)
        fields: dict[str, object] = dict(annotations)
        defaults: list[str] = []
        for name in fields:
            if name in namespace:
                defaults.append(name)
            elif defaults:
                raise TypeError(
                    f"Non-default namedtuple field {name} cannot follow default field"
                    f"{'s' if len(defaults) > 1 else ''} {', '.join(defaults)}"
                )
        made = _namedtuple(
            typename,
            list(fields),
            defaults=[namespace[name] for name in defaults],
            module=str(namespace["__module__"]),
        )
        made.__annotations__ = fields
        made.__new__.__annotations__ = fields
        for key, value in namespace.items():
            if key in _PROHIBITED:
                raise AttributeError("Cannot overwrite NamedTuple attribute " + key)
            if key not in _SPECIAL and key not in fields:
                setattr(made, key, value)
        return made


NamedTuple = type.__new__(_NamedTupleMeta, "NamedTuple", (), {})
