"""The spec of one generated case: an agent (events, actions, steps), inputs, a kill schedule.

Everything is a frozen dataclass whose `repr` is a short, readable line, so hypothesis prints a
falsifying case as something a person can read and rebuild by hand. `Case.describe()` gives
the whole case, one action per line.

Memory slots are typed by name so that generated writes never conflict: `n*` hold ints
(counters), `l*` lists of ints, `v*` any admitted value, `o*` objects with fields `o*.f*`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

INPUT = "Input"  # the InputEvent source
ERROR = "Error"  # the ErrorEvent source

MODES = ("thread", "async", "inline")


@dataclasses.dataclass(frozen=True)
class Features:
    """Parts of the generator that exercise the defects of issue 11; each on by default.

    Turn one off to keep a suite green while its fix is pending; turn it back on when the fix
    lands. With all of them off, the harness must pass on a correct runtime.
    """

    mutate_events: bool = True  # #1 actions mutate the event they received
    model_fields: bool = True  # #2 an `Any` event field holds a registered model
    custom_exceptions: bool = True  # #3 durable calls raise a user exception class
    gather_sequential: bool = True  # #4 gathered coroutines with two sequential durable calls
    output_order: bool = True  # #5 outputs of a run are compared in order (not as a set)
    handler_raises: bool = True  # #9 ErrorEvent handlers that raise
    early_kills: bool = True  # #11 the first process may be killed during start-up

    @classmethod
    def none(cls) -> Features:
        return cls(**{f.name: False for f in dataclasses.fields(cls)})

    @classmethod
    def parse(cls, text: str, base: Features | None = None) -> Features:
        """'all', 'none', or a base changed by '-name' / '+name' / 'name' items, comma-separated."""
        feats = base or cls()
        for raw in (t.strip() for t in text.split(",")):
            if not raw:
                continue
            if raw == "all":
                feats = cls()
            elif raw == "none":
                feats = cls.none()
            else:
                name, on = (raw[1:], raw[0] == "+") if raw[0] in "+-" else (raw, True)
                if name not in {f.name for f in dataclasses.fields(cls)}:
                    raise ValueError(f"unknown feature {name!r}; known: {cls.names()}")
                feats = dataclasses.replace(feats, **{name: on})
        return feats

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def __repr__(self) -> str:
        on = [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]
        return "Features(" + (", ".join(on) if on else "none") + ")"


# --- steps of an action ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Write:
    """`mem.set(path, value)` with a literal value of any admitted type."""

    scope: str  # "stm" or "sen"
    path: str
    value: Any

    def __repr__(self) -> str:
        return f"{self.scope}.{self.path} = {self.value!r}"


@dataclasses.dataclass(frozen=True)
class Bump:
    """`mem.set(path, mem.get(path, 0) + acc * scale)`: a read-modify-write of a counter."""

    scope: str
    path: str
    scale: int = 1

    def __repr__(self) -> str:
        return f"{self.scope}.{self.path} += acc" + (f"*{self.scale}" if self.scale != 1 else "")


@dataclasses.dataclass(frozen=True)
class Append:
    """`mem.set(path, [*mem.get(path, []), acc])`."""

    scope: str
    path: str

    def __repr__(self) -> str:
        return f"{self.scope}.{self.path}.append(acc)"


@dataclasses.dataclass(frozen=True)
class Delete:
    scope: str
    path: str

    def __repr__(self) -> str:
        return f"del {self.scope}.{self.path}"


@dataclasses.dataclass(frozen=True)
class NewObject:
    scope: str
    path: str

    def __repr__(self) -> str:
        return f"{self.scope}.new_object({self.path})"


@dataclasses.dataclass(frozen=True)
class Read:
    """`acc += weigh(mem.get(path))`: memory flows into what the action sends."""

    scope: str
    path: str

    def __repr__(self) -> str:
        return f"acc += {self.scope}.{self.path}"


@dataclasses.dataclass(frozen=True)
class Call:
    """A durable call at a named site. fn: call (answers), acall (async fn), fail (ValueError
    for even arguments), fail_custom (RateLimited(RuntimeError) for even arguments)."""

    site: str
    fn: str = "call"
    caught: bool = False

    def __repr__(self) -> str:
        catch = " (caught)" if self.caught else ""
        return f"{self.site}={self.fn}(acc){catch}"


@dataclasses.dataclass(frozen=True)
class Gather:
    """`asyncio.gather` of coroutines, each making its sites' durable calls in sequence."""

    groups: tuple[tuple[str, ...], ...]

    def __repr__(self) -> str:
        return "gather(" + ", ".join("[" + " ".join(g) + "]" for g in self.groups) + ")"


@dataclasses.dataclass(frozen=True)
class Emit:
    """`send_event(E(v=acc*3+k, items=[...], extra=Tag(n=k) if model else None))`."""

    event: str
    k: int = 0
    model: bool = False

    def __repr__(self) -> str:
        return f"emit {self.event}/{self.k}" + (" +Tag" if self.model else "")


@dataclasses.dataclass(frozen=True)
class Output:
    """`send_event(OutputEvent(...))` with acc and reads of memory."""

    k: int = 0

    def __repr__(self) -> str:
        return f"out/{self.k}"


@dataclasses.dataclass(frozen=True)
class Burst:
    """n outputs from one task."""

    n: int

    def __repr__(self) -> str:
        return f"out x{self.n}"


@dataclasses.dataclass(frozen=True)
class Mutate:
    """Mutate the received event: its `v`, its `items` list, an input's "v", an error's message."""

    what: str

    def __repr__(self) -> str:
        return f"mutate event.{self.what}"


@dataclasses.dataclass(frozen=True)
class Raise:
    """`if v % mod == rem: raise ValueError(...)` (mod 1: always)."""

    mod: int = 1
    rem: int = 0

    def __repr__(self) -> str:
        return "raise" if self.mod == 1 else f"raise if v%{self.mod}=={self.rem}"


@dataclasses.dataclass(frozen=True)
class Sleep:
    ms: int

    def __repr__(self) -> str:
        return f"sleep {self.ms}ms"


@dataclasses.dataclass(frozen=True)
class ActionSpec:
    name: str
    listens: tuple[str, ...]  # INPUT, ERROR or event names
    mode: str  # thread | async | inline
    steps: tuple[Any, ...]

    def __repr__(self) -> str:
        body = "; ".join(repr(s) for s in self.steps) or "pass"
        return f"{self.name} {self.mode} on {'|'.join(self.listens)}: {body}"


# --- the kill schedule -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Kill:
    """When to SIGKILL one process, relative to the crash-free reference run.

    on "lines": once the execution log grew (since this process started) by `pct`% of the
    lines the reference wrote, then `delay_ms` later. on "calls": the same, counting only the
    lines of real durable calls (so the kill lands just after a call, before or after its
    result is recorded). on "time": `pct`% of the reference's wall time after the process
    started (start-up included).
    """

    pct: int
    on: str = "lines"
    delay_ms: int = 0

    def __repr__(self) -> str:
        if self.on == "time":
            return f"at {self.pct}% time"
        return f"after {self.pct}% {self.on}" + (f" +{self.delay_ms}ms" if self.delay_ms else "")


@dataclasses.dataclass(frozen=True)
class Case:
    events: tuple[str, ...]
    actions: tuple[ActionSpec, ...]
    inputs: tuple[tuple[Any, int], ...]  # (key, v)
    kills: tuple[Kill, ...]
    interval_ms: int = 20
    max_runs: int = 64
    features: Features = dataclasses.field(default_factory=Features)

    def listeners(self, source: str) -> list[ActionSpec]:
        return [a for a in self.actions if source in a.listens]

    def unheard(self) -> list[str]:
        return [e for e in self.events if not self.listeners(e)]

    def describe(self) -> str:
        unheard = set(self.unheard())
        events = " ".join(e + ("(unheard)" if e in unheard else "") for e in self.events)
        lines = [
            f"interval {self.interval_ms}ms, max_runs {self.max_runs}, kills "
            f"[{', '.join(map(repr, self.kills))}], {self.features!r}",
            "inputs: " + " ".join(f"{k!r}:{v}" for k, v in self.inputs),
            f"events: {events}",
            *(f"  {a!r}" for a in self.actions),
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return "Case:\n" + self.describe()
