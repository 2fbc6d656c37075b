"""Holding a crashed run to its crash-free reference: outputs, memory, re-executions.

`compare` returns a list of differences, each a sentence a person can act on; empty means
equivalent. Values are compared by `normal`, which keeps exact types (1, 1.0 and True differ;
bytes are not a list; -0.0 is not 0.0; NaN equals NaN) and dict order, and ignores set order
(it depends on the process's hash seed).
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import json
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel

# a memory path that holds an object (children), as ratchet's flat memory map marks it
OBJECT_MARK = ("<object>",)
# fields of an output line that name the job, not the output: they differ between two jobs
JOB_FIELDS = frozenset({"job"})


def normal(value: Any) -> Any:
    """A hashable, exactly typed form of a stored value, equal only for equivalent values."""
    t = type(value)
    if t is float or t is decimal.Decimal:
        return (t.__name__, repr(value) if t is float else str(value))
    if t is list or t is tuple:
        return (t.__name__, tuple(normal(v) for v in value))
    if t is dict:
        return ("dict", tuple((normal(k), normal(v)) for k, v in value.items()))
    if t is set or t is frozenset:
        return (t.__name__, tuple(sorted((normal(v) for v in value), key=repr)))
    if t in (datetime.datetime, datetime.time):
        return (t.__name__, repr(value))  # includes fold and the tzinfo's type and name
    if isinstance(value, enum.Enum):
        return (t.__qualname__, value.name)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return (t.__qualname__, tuple((f.name, normal(getattr(value, f.name))) for f in fields))
    if isinstance(value, BaseModel):
        names = type(value).model_fields
        return (t.__qualname__, tuple((n, normal(getattr(value, n))) for n in names))
    if type(value).__name__ == "_ObjectNode":
        return OBJECT_MARK
    return (t.__name__, repr(value))


def _short(value: Any, limit: int = 160) -> str:
    text = "<object>" if type(value).__name__ == "_ObjectNode" else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- outputs ---------------------------------------------------------------------------------


def read_outputs(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in o.items() if k not in JOB_FIELDS} for o in lines]


def _by_run(outputs: list[dict[str, Any]]) -> dict[tuple[str, int], list[str]]:
    runs: dict[tuple[str, int], list[str]] = {}
    for o in outputs:
        # repr: the key 7 and the key "7" are two keys (whose runs may share a seq where
        # inputs are numbered per key, as on Flink).
        runs.setdefault((repr(o.get("key")), int(o.get("seq", -1))), []).append(o["id"])
    return runs


def compare_outputs(
    ref: list[dict[str, Any]], got: list[dict[str, Any]], ordered: bool = True
) -> list[str]:
    diffs: list[str] = []
    for name, outs in (("reference", ref), ("crashed run", got)):
        counts = Counter(o["id"] for o in outs)
        for oid, n in counts.items():
            if n > 1:
                diffs.append(f"output {oid} is in the {name}'s output file {n} times")
    ref_by_id = {o["id"]: o for o in ref}
    got_by_id = {o["id"]: o for o in got}
    for oid in ref_by_id.keys() - got_by_id.keys():
        diffs.append(f"output {oid} is missing after the crashes: {ref_by_id[oid]}")
    for oid in got_by_id.keys() - ref_by_id.keys():
        diffs.append(f"output {oid} exists only after the crashes: {got_by_id[oid]}")
    for oid in ref_by_id.keys() & got_by_id.keys():
        if ref_by_id[oid] != got_by_id[oid]:
            diffs.append(
                f"output {oid} differs:\n    reference {ref_by_id[oid]}\n    crashed   "
                f"{got_by_id[oid]}"
            )
    if ordered and not diffs:
        ref_runs, got_runs = _by_run(ref), _by_run(got)
        for run, ids in ref_runs.items():
            if got_runs.get(run) != ids:
                diffs.append(
                    f"outputs of run key={run[0]} seq={run[1]} are in another order:\n"
                    f"    reference {ids}\n    crashed   {got_runs.get(run)}"
                )
    return diffs


# --- memory ----------------------------------------------------------------------------------


def compare_memory(ref: dict[Any, dict[str, Any]], got: dict[Any, dict[str, Any]]) -> list[str]:
    diffs: list[str] = []
    for key in sorted(ref.keys() | got.keys(), key=repr):
        if key not in got:
            diffs.append(f"memory of key {key!r} is missing after the crashes")
            continue
        if key not in ref:
            diffs.append(f"memory of key {key!r} exists only after the crashes: {got[key]}")
            continue
        a, b = ref[key], got[key]
        for path in sorted(a.keys() | b.keys()):
            if path not in b:
                diffs.append(f"memory {key!r} {path}: reference {_short(a[path])}, crashed: absent")
            elif path not in a:
                diffs.append(f"memory {key!r} {path}: reference absent, crashed {_short(b[path])}")
            elif normal(a[path]) != normal(b[path]):
                diffs.append(
                    f"memory {key!r} {path}: reference {_short(a[path])}, crashed {_short(b[path])}"
                )
    return diffs


def compare(
    ref_outputs: list[dict[str, Any]],
    got_outputs: list[dict[str, Any]],
    ref_memory: dict[Any, dict[str, Any]],
    got_memory: dict[Any, dict[str, Any]],
    ordered: bool = True,
) -> list[str]:
    return compare_outputs(ref_outputs, got_outputs, ordered) + compare_memory(
        ref_memory, got_memory
    )
