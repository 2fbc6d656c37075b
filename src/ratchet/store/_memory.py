"""The reference `CheckpointStore`: plain dicts, no I/O. What SQLite must behave like.

It lives as long as the object does, so it is for tests, examples and the Flink core's
tests; a process that dies loses it. The conformance suite in `tests/store/` runs against it
and against every durable backend, so the semantics are written down once, here, simply.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import StateError
from ratchet.store import codec
from ratchet.store._base import (
    FAILED_RUN,
    KEEPS_SIGNALS,
    REPLAY_FN,
    SIGNAL_FN,
    Adopted,
    AgentVersion,
    CallRecord,
    CheckpointRows,
    DispatchTable,
    Loaded,
    Pinned,
    SignalRow,
    adopt_pins,
    check_adoption,
    covering_marker,
    entry_signal,
    journal_tasks,
    run_signals,
    signal_entry,
    signal_key_type,
    signals_taken,
    taken_signal,
    taken_signals,
    version_id,
    with_run_signals,
)

_KEEP_CHECKPOINT_STATS = 100


class MemoryStore:
    """A `CheckpointStore` in memory; `reopen()` models a restart of the process."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.keys: dict[bytes, tuple[str, int, bytes, int]] = {}
        self.inputs: dict[int, tuple[bytes, bytes]] = {}
        self.runs: dict[int, tuple[bytes, int, bytes]] = {}
        self.outbox: dict[str, tuple[int, bytes]] = {}
        self.calls: dict[tuple[int, str, int], CallRecord] = {}
        # What a delivered signal's record keeps of the signal it took (SQLite: calls.taken)
        self.taken: dict[tuple[int, str, int], bytes] = {}
        self.source: dict[str, Any] = {}
        self.counts = {"completed": 0, "failed": 0, "restored": 0}
        self.checkpoints: list[dict[str, Any]] = []
        self.latest_restored: dict[str, Any] | None = None
        self.next_checkpoint_id = 1
        self.closed = False
        # The agent: name, current table and fingerprint, and the tables of pinned runs.
        self.agent_name: str | None = None
        self.fingerprint: str | None = None
        self.table: DispatchTable | None = None
        self.memory_version = 1
        self.pins: dict[int, str] = {}
        self.versions: dict[str, Pinned] = {}
        self.signals: dict[int, tuple[str, str, bytes, float, str | None]] = {}
        self.next_signal_id = 1
        # id -> [key, key text, seq, event, reason, at, kind, detail, redrive asked, redriven as]
        self.dead: dict[int, list[Any]] = {}
        self.report: dict[str, Any] = {}
        # (key text, seq) -> (completed at, status, encoded trace, key type)
        self.traces: dict[tuple[str, int], tuple[float, str, bytes, str | None]] = {}
        # scope -> id -> (text, encoded metadata, vector, added at)
        self.ltm: dict[str, dict[str, tuple[str, bytes, bytes, float]]] = {}

    def adopt(self, agent: AgentVersion, dry_run: bool = False) -> Adopted:
        highest = max((v for *_rest, v in self.keys.values()), default=0)
        check_adoption("the state", self.agent_name, self.table, agent, highest)
        versions = dict(self.versions)
        previous = None
        if self.fingerprint is not None and self.table is not None:
            previous = version_id(self.fingerprint, self.memory_version)
            versions.setdefault(previous, Pinned(copy.deepcopy(self.table), self.memory_version))
        current = version_id(agent.fingerprint, agent.memory_version)
        pins, adopted = adopt_pins(self.pins, set(self.runs), previous, current, versions)
        if dry_run:
            return copy.deepcopy(adopted)
        self.pins = pins
        self.versions = {v: p for v, p in versions.items() if v in set(pins.values())}
        self.agent_name, self.fingerprint = agent.name, agent.fingerprint
        self.table, self.memory_version = copy.deepcopy(agent.table), agent.memory_version
        return copy.deepcopy(adopted)

    def load(self, lazy_keys: bool = False) -> Loaded:
        busy = {k for k, _ev in self.inputs.values()} if lazy_keys else None
        return Loaded(
            keys=[
                (k, nd, mem, v)
                for k, (_t, nd, mem, v) in sorted(self.keys.items())
                if busy is None or k in busy
            ],
            inputs=[(seq, k, ev) for seq, (k, ev) in sorted(self.inputs.items())],
            runs=[(seq, k, base, j) for seq, (k, base, j) in sorted(self.runs.items())],
            outbox=[(i, seq, rec) for i, (seq, rec) in self.outbox.items()],
            calls=[copy.copy(self.calls[k]) for k in sorted(self.calls)],
            source=copy.deepcopy(self.source),
            stats=self.stats(),
            stored_keys=len(self.keys),
        )

    def key_row(self, key: bytes) -> tuple[int, bytes, int] | None:
        row = self.keys.get(key)  # one dict read: the checkpoint swaps in a new dict whole
        return None if row is None else (row[1], row[2], row[3])

    def write_checkpoint(self, rows: CheckpointRows, triggered_at: float) -> dict[str, Any]:
        started = self.clock.monotonic()
        # Applied to copies and swapped in at the end: a bad row leaves nothing half-applied.
        keys, inputs, runs = dict(self.keys), dict(self.inputs), dict(self.runs)
        outbox, calls, source = dict(self.outbox), dict(self.calls), self.source
        for key, text, next_dispatch, memory, version in rows.keys:
            keys[key] = (text, next_dispatch, memory, version)
        for seq, key, event in rows.new_inputs:
            inputs[seq] = (key, event)
        for seq in rows.done_inputs:
            inputs.pop(seq, None)
            runs.pop(seq, None)
        letters = [self._keep_signals(row, rows.completed) for row in rows.dead_letters]
        taken = self.taken
        if rows.completed:
            done = set(rows.completed)
            for k in [k for k in calls if k[0] in done]:
                del calls[k]
            taken = {k: v for k, v in taken.items() if k in calls}
        for seq, key, base, journal in rows.runs:
            runs[seq] = (key, base, journal)
        for out_id, seq, record in rows.outbox:
            outbox[out_id] = (seq, record)
        for out_id in rows.released:
            outbox.pop(out_id, None)
        dead = copy.deepcopy(self.dead)
        for row in letters:
            dead[max(dead, default=0) + 1] = [*row, None, None]
        for i, seq in rows.redriven:
            if i in dead and dead[i][9] is None:
                dead[i][9] = seq
        if rows.source:
            # Through the codec, as a durable store would: what cannot be stored is refused
            # here too, and what comes back has the types a restart would see.
            source = codec.decode(codec.encode(rows.source))
        size = rows.size()
        self.keys, self.inputs, self.runs = keys, inputs, runs
        self.outbox, self.calls, self.source = outbox, calls, source
        self.taken = taken
        self.dead = dead
        self.report.update(copy.deepcopy(rows.report))
        for scope, ltm_id, text, meta, vector, at in rows.ltm_add:
            self.ltm.setdefault(scope, {})[ltm_id] = (text, meta, vector, at)
        for scope, ltm_id in rows.ltm_delete:
            self.ltm.get(scope, {}).pop(ltm_id, None)
        for key_text, seq, at, status, blob, key_type in rows.traces:
            self.traces[(key_text, seq)] = (at, status, blob, key_type)
        keep, age = rows.trace_retention
        if rows.traces and keep is not None:
            for key_text, key_type in rows.trace_prune:
                # The key's own traces and untyped ones (either key's), as SQLite prunes.
                mine = sorted(
                    s
                    for (k, s), (*_row, kt) in self.traces.items()
                    if k == key_text and kt in (key_type, None)
                )
                for s in mine[:-keep] if keep else mine:
                    del self.traces[(key_text, s)]
        if rows.traces and age is not None:
            old = [tk for tk, (at, *_rest) in self.traces.items() if at < triggered_at - age]
            for tk in old:
                del self.traces[tk]
        info = {
            "id": self.next_checkpoint_id,
            "trigger_timestamp": triggered_at,
            "duration_ms": (self.clock.monotonic() - started) * 1000.0,
            "size_bytes": size,
        }
        self.checkpoints = [*self.checkpoints[-(_KEEP_CHECKPOINT_STATS - 1) :], info]
        self.next_checkpoint_id += 1
        self.counts["completed"] += 1
        return dict(info)

    def _keep_signals(self, row: tuple[Any, ...], completed: list[int]) -> tuple[Any, ...]:
        """A dead letter the checkpoint writes; a failed run's (whose records it deletes) with
        the signals the run took in its detail, as `SqliteStore` keeps them."""
        key, _text, seq, _event, _reason, _at, kind, detail = row
        if kind != FAILED_RUN or seq not in completed:
            return row
        taken = self._run_signals(seq, key)
        return (*row[:7], with_run_signals(detail, taken)) if taken else row

    def _run_signals(
        self, seq: int, key: bytes
    ) -> list[tuple[int | None, str, str, bytes, float, str | None]]:
        mine = sorted(k for k in self.calls if k[0] == seq)
        kept = {(t, i): self.taken.get((s, t, i)) for s, t, i in mine}
        records = [self.calls[k] for k in mine]
        return run_signals(
            records, kept, lambda: codec.decode(key, unknown="generic"), self.clock.now()
        )

    def put_calls(self, records: Iterable[CallRecord]) -> None:
        new = {(r.seq, r.task_id, r.idx): copy.copy(r) for r in records}  # all or none
        self.calls.update(new)
        for k in new:
            self.taken.pop(k, None)  # a record written again keeps no signal

    def redrives(self) -> list[tuple[int, bytes, bytes]]:
        return [
            (i, d[0], d[3])
            for i, d in sorted(self.dead.items())
            if d[8] is not None and d[9] is None and d[6] != "bad-input"
        ]

    def request_redrive(self, dead_id: int) -> None:
        """Ask for a dead letter to be redriven (what `ratchet redrive` does to a SQLite state)."""
        self.dead[dead_id][8] = self.clock.now()

    def add_signal(self, key: Any, name: str, value: Any) -> int:
        """Send a signal (what `ratchet.send_signal` does to a SQLite state)."""
        sid = self.next_signal_id
        self.next_signal_id += 1
        typed = signal_key_type(key)
        self.signals[sid] = (str(key), name, codec.encode(value), self.clock.now(), typed)
        return sid

    def signals_after(self, signal_id: int) -> list[tuple[int, str, str, bytes, float, str | None]]:
        return [(i, *row) for i, row in sorted(self.signals.items()) if i > signal_id]

    def consume_signal(self, signal_id: int, record: CallRecord) -> None:
        if signal_id not in self.signals:
            raise StateError(f"signal {signal_id} was consumed already")
        key_text, _name, _value, sent_at, key_type = self.signals.pop(signal_id)
        r = record
        self.calls[(r.seq, r.task_id, r.idx)] = copy.copy(r)
        self.taken[(r.seq, r.task_id, r.idx)] = taken_signal(signal_id, key_text, sent_at, key_type)
        # Taken by an attempt replay has not accepted: its marker keeps the signal as sent.
        markers = self._markers(r.seq, r.task_id)
        mark = covering_marker(markers, r.idx)
        if mark is not None:
            taken = taken_signals(markers[mark])
            taken[r.idx] = [signal_id, key_text, sent_at, key_type]
            where = (r.seq, r.task_id, mark)
            self.calls[where] = dataclasses.replace(self.calls[where], payload=codec.encode(taken))

    def _markers(self, seq: int, task_id: str) -> dict[int, bytes | None]:
        return {
            i: r.payload
            for (s, t, i), r in self.calls.items()
            if s == seq and t == task_id and i < 0 and r.fn == REPLAY_FN
        }

    def _put_back(self, seq: int, task_id: str, records: list[CallRecord]) -> dict[int, SignalRow]:
        taken = list(signals_taken(self._markers(seq, task_id), records))
        back = self._insert_signals([row for _r, row in taken])
        return {r.idx: row for (r, _row), row in zip(taken, back, strict=True)}

    def _insert_signals(
        self, rows: Iterable[tuple[int | None, str, str, bytes, float, str | None]]
    ) -> list[SignalRow]:
        back = []
        for sid, key_text, name, value, sent_at, key_type in rows:
            if sid is None or sid in self.signals:
                sid = self.next_signal_id
            # As SQLite's AUTOINCREMENT: no later signal gets an id one put back holds.
            self.next_signal_id = max(self.next_signal_id, sid + 1)
            self.signals[sid] = (key_text, name, value, sent_at, key_type)
            back.append((sid, key_text, name, value, sent_at, key_type))
        return back

    def _forget_calls(self, keys: Iterable[tuple[int, str, int]]) -> None:
        for k in list(keys):
            self.calls.pop(k, None)
            self.taken.pop(k, None)

    def drop_calls(self, seq: int, task_id: str, from_idx: int) -> list[SignalRow]:
        dropped = [
            r for (s, t, i), r in self.calls.items() if s == seq and t == task_id and i >= from_idx
        ]
        back = self._put_back(seq, task_id, dropped)
        self._forget_calls([(seq, task_id, r.idx) for r in dropped] + [(seq, task_id, -from_idx)])
        return list(back.values())

    def release_signals(self, seq: int, task_id: str, idxs: list[int]) -> list[SignalRow]:
        records = [self.calls[(seq, task_id, i)] for i in idxs if (seq, task_id, i) in self.calls]
        back = self._put_back(seq, task_id, records)
        self._forget_calls((seq, task_id, i) for i in back)
        return list(back.values())

    def release_attempt_signals(self, seq: int, task_id: str, key: Any) -> list[SignalRow]:
        """What `SqliteStore.release_attempt_signals` does (a failed attempt to be retried)."""
        mine = sorted(k for k in self.calls if k[0] == seq and k[1] == task_id)
        records = [self.calls[k] for k in mine]
        kept = {(t, i): self.taken.get((s, t, i)) for s, t, i in mine}
        taken = run_signals(records, kept, lambda: key, self.clock.now())
        self._forget_calls(
            k for k, r in zip(mine, records) if r.fn == SIGNAL_FN and r.status == "ok"
        )
        return self._insert_signals(taken)

    def discard_run(self, seq: int, dead_letter_reason: str | None) -> dict[str, int | None]:
        """What `SqliteStore.discard_run` does (`ratchet runs restart`, `runs abandon`)."""
        if seq not in self.runs:
            raise StateError(f"the state has no run in flight for input {seq}")
        if dead_letter_reason is not None and seq not in self.inputs:
            raise StateError(f"the run of input {seq} has no input row")
        key, _base, journal = self.runs[seq]
        mine = sorted(k for k in self.calls if k[0] == seq)
        records = [self.calls[k] for k in mine]
        calls = [r for r in records if r.idx >= 0]  # a replay marker is not a call
        outputs = [i for i, (s, _rec) in self.outbox.items() if s == seq]
        counts: dict[str, int | None] = {
            "journaled_tasks": journal_tasks(journal),
            "call_records": len(calls),
            "calls_returned": sum(1 for r in calls if r.status != "intent"),
            "unreleased_outputs": len(outputs),
        }
        taken = self._run_signals(seq, key)
        if dead_letter_reason is not None:
            detail = with_run_signals(None, taken)
            text = str(codec.decode(key, unknown="generic"))
            _key, event = self.inputs.pop(seq)
            row = [key, text, seq, event, dead_letter_reason, self.clock.now(), "abandoned", detail]
            self.dead[max(self.dead, default=0) + 1] = [*row, None, None]
            counts["signals_kept"] = len(taken)
        else:
            counts["signals_put_back"] = len(self._insert_signals(taken))
        del self.runs[seq]
        self._forget_calls(mine)
        for out_id in outputs:
            del self.outbox[out_id]
        self.pins.pop(seq, None)
        return counts

    def redrive_signals(self, dead_ids: list[int]) -> list[SignalRow]:
        """What `SqliteStore.redrive_signals` does: a failed or abandoned run's signals go
        back when a redrive admits its dead letter, once."""
        back: list[SignalRow] = []
        for dead_id in dead_ids:
            letter = self.dead.get(dead_id)
            if letter is None or letter[6] not in KEEPS_SIGNALS:
                continue
            if letter[8] is None or letter[9] is not None:  # not asked for, or redriven
                continue
            detail = codec.decode(letter[7]) if letter[7] is not None else None
            if not isinstance(detail, dict) or not detail.get("signals"):
                continue
            put = self._insert_signals([entry_signal(e) for e in detail.pop("signals")])
            detail["signals_put_back"] = [signal_entry(r) for r in put]
            letter[7] = codec.encode(detail)
            back += put
        return back

    def forget_outputs(self, ids: list[str]) -> None:
        for out_id in ids:
            self.outbox.pop(out_id, None)

    def count_failed_checkpoint(self) -> None:
        self.counts["failed"] += 1

    def record_restore(self) -> dict[str, Any] | None:
        latest = self.stats()["latest_completed"]
        if latest is None:
            return None
        self.counts["restored"] += 1
        self.latest_restored = dict(latest, restored_at=self.clock.now())
        return dict(self.latest_restored)

    def stats(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "latest_completed": dict(self.checkpoints[-1]) if self.checkpoints else None,
            "latest_restored": dict(self.latest_restored) if self.latest_restored else None,
        }

    def ltm_rows(self, scope: str) -> list[tuple[str, str, bytes, bytes, float]]:
        rows = [(i, t, m, v, a) for i, (t, m, v, a) in self.ltm.get(scope, {}).items()]
        return sorted(rows, key=lambda r: (r[4], r[0]))

    def close(self) -> None:
        self.closed = True

    def reopen(self) -> MemoryStore:
        """The same durable contents as a new, open store: what a restarted engine would see."""
        other = copy.deepcopy(self, {id(self.clock): self.clock})
        other.closed = False
        return other
