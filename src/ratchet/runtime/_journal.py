"""The stored form of what both engines persist: journals, runs, memory and call records.

One module so the layout cannot change in one engine only: the embedded engine writes these
into SQLite rows (`CheckpointRows`), the Flink engine into keyed state, and both read them
back through the same functions. The golden journals under `tests/golden/` pin the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ratchet._errors import CodecError, CorruptDataError, StateError
from ratchet.runtime._machine import JournalEntry, RestoredRun
from ratchet.runtime._memops import from_wire, to_wire
from ratchet.store import codec
from ratchet.store._base import CallRecord


class EventCodec(Protocol):
    """How an agent's events become codec-safe values and back (the binding implements it)."""

    def event_to_wire(self, event: Any) -> Any: ...
    def event_from_wire(self, wire: Any) -> Any: ...


def journal_to_wire(events: EventCodec, journal: list[JournalEntry]) -> list[Any]:
    """A run's journal as plain values: (task id, dispatch index, ops, sensory ops, events)."""
    return [
        (
            e.task_id,
            e.dispatch_index,
            list(e.stm_ops),
            list(e.sensory_ops),
            # An annotation (`!...`, not a task) holds plain values, not events.
            list(e.events)
            if e.task_id[:1] == "!"
            else [events.event_to_wire(ev) for ev in e.events],
        )
        for e in journal
    ]


def journal_from_wire(events: EventCodec, wire: list[Any]) -> list[JournalEntry]:
    return [
        JournalEntry(
            tid,
            di,
            tuple(so),
            tuple(se),
            tuple(evs) if tid[:1] == "!" else tuple(events.event_from_wire(e) for e in evs),
        )
        for tid, di, so, se, evs in wire
    ]


def encode_journal(events: EventCodec, journal: list[JournalEntry]) -> bytes:
    return codec.encode(journal_to_wire(events, journal))


def decode_journal(events: EventCodec, raw: bytes) -> list[JournalEntry]:
    return journal_from_wire(events, codec.decode(raw))


def encode_run(events: EventCodec, run: RestoredRun) -> bytes:
    """A whole run in flight (input event included) as one value: keyed state's form."""
    return codec.encode(
        (
            run.seq,
            run.base_dispatch,
            events.event_to_wire(run.input_event),
            journal_to_wire(events, run.journal),
        )
    )


def decode_run(events: EventCodec, key: Any, raw: bytes) -> RestoredRun:
    seq, base, event, journal = codec.decode(raw)
    return RestoredRun(
        key, seq, events.event_from_wire(event), base, journal_from_wire(events, journal)
    )


def encode_event(events: EventCodec, event: Any) -> bytes:
    return codec.encode(events.event_to_wire(event))


def decode_event(events: EventCodec, raw: bytes) -> Any:
    return events.event_from_wire(codec.decode(raw))


def encode_memory(memory: dict[str, Any]) -> bytes:
    """A key's committed memory as stored bytes (also the Flink memory side output's payload)."""
    return codec.encode(to_wire(memory))


def decode_memory(raw: bytes) -> dict[str, Any]:
    return from_wire(codec.decode(raw))


def encode_call(record: CallRecord) -> bytes:
    """A durable-call record as one value (keyed state; SQLite stores the fields as columns)."""
    r = record
    return codec.encode((r.seq, r.task_id, r.idx, r.fn, r.digest, r.status, r.payload))


def decode_call(raw: bytes) -> CallRecord:
    return CallRecord(*codec.decode(raw))


def decoded(table: str, where: Any, decode: Callable[..., Any], *args: Any) -> Any:
    """Decode one stored value; damaged bytes are a StateError naming the table and the row."""
    try:
        return decode(*args)
    except (CodecError, CorruptDataError, KeyError, TypeError, ValueError) as exc:
        raise StateError(
            f"the state's {table} row for {where!r} cannot be read ({type(exc).__name__}: "
            f"{exc}); it was left untouched; restore the state from a backup or use a new one"
        ) from exc
