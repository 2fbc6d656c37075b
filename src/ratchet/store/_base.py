"""The store interface: a handful of methods every checkpoint backend implements.

A store holds bytes and plain values; what they mean belongs to the engine. Rows are keyed
naturally (key, input sequence, task id, call index), so a retried write is harmless. The
in-memory store (`_memory.py`) is the reference; SQLite (`_sqlite.py`) is the embedded
default; `tests/store/` is the conformance suite both pass, and any later backend must.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ratchet._errors import StateError
from ratchet.store import codec


@dataclass
class CheckpointRows:
    """One checkpoint, already encoded: applied all at once or not at all."""

    # (encoded key, key as text, next dispatch index, encoded memory, memory version)
    keys: list[tuple[bytes, str, int, bytes, int]] = field(default_factory=list)
    # (input seq, encoded key, encoded event): inputs admitted since the last checkpoint
    new_inputs: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    # input seqs whose runs completed: their input and run rows go
    done_inputs: list[int] = field(default_factory=list)
    # input seqs whose runs completed: their call records go
    completed: list[int] = field(default_factory=list)
    # (input seq, encoded key, base dispatch index, encoded journal): runs in flight
    runs: list[tuple[int, bytes, int, bytes]] = field(default_factory=list)
    # (output id, input seq, encoded sink record): outputs not yet released to the sink
    outbox: list[tuple[str, int, bytes]] = field(default_factory=list)
    # output ids the sink holds: their outbox rows go
    released: list[str] = field(default_factory=list)
    # the source position and anything else the engine resumes from; {} keeps the old one
    source: dict[str, Any] = field(default_factory=dict)
    # new dead letters: (key, key text, input seq or -1, encoded event or raw line, reason,
    # at, kind: "bad-input" | "failed-run", encoded detail)
    dead_letters: list[tuple[bytes, str, int, bytes, str, float, str, bytes]] = field(
        default_factory=list
    )
    # dead letters redriven: (dead letter id, the seq of the input it became)
    redriven: list[tuple[int, int]] = field(default_factory=list)
    # what the engine reports about itself for `ratchet status` (e.g. "paused"); {}: unchanged
    report: dict[str, Any] = field(default_factory=dict)
    # traces of runs that completed: (key text, input seq, completed at, status, encoded
    # trace, key type: 'str' or 'int', `signal_key_type`: the text "1" names two keys)
    traces: list[tuple[str, int, float, str, bytes, str]] = field(default_factory=list)
    # keep the last N traces per key (None: all) and none older than `age` seconds (None: any)
    trace_retention: tuple[int | None, float | None] = (None, None)
    # keys whose traces to cut down to the last N now (the engine asks every so often), as
    # (key text, key type)
    trace_prune: list[tuple[str, str]] = field(default_factory=list)
    # long-term memory: (scope, id, text, encoded metadata, float32 vector, added at) to add
    # (or replace), and (scope, id) to delete, applied in that order
    ltm_add: list[tuple[str, str, str, bytes, bytes, float]] = field(default_factory=list)
    ltm_delete: list[tuple[str, str]] = field(default_factory=list)

    def size(self) -> int:
        n = sum(len(k) + len(t) + 16 + len(m) for k, t, _, m, _v in self.keys)
        n += sum(8 + len(k) + len(e) for _, k, e in self.new_inputs)
        n += sum(8 + len(k) + 8 + len(j) for _, k, _, j in self.runs)
        n += sum(len(i) + 8 + len(r) for i, _, r in self.outbox)
        n += sum(
            len(s) + len(i) + len(t) + len(m) + len(v) + 8 for s, i, t, m, v, _ in self.ltm_add
        )
        return n + 8 * len(self.done_inputs) + sum(len(i) for i in self.released)


@dataclass
class CallRecord:
    """One durable call of one task: written through before the task's result is used."""

    seq: int
    task_id: str
    idx: int
    fn: str
    digest: str
    status: str  # "intent", "ok" or "error"
    payload: bytes | None


@dataclass
class Loaded:
    """Everything a restore needs, still encoded, in the order the engine restores it."""

    # (key, next dispatch, memory, memory version), by key bytes: every key, or with
    # `load(lazy_keys=True)` only the keys with an input row (a run in flight or queued)
    keys: list[tuple[bytes, int, bytes, int]]
    inputs: list[tuple[int, bytes, bytes]]  # (seq, key, event), by seq
    runs: list[tuple[int, bytes, int, bytes]]  # (seq, key, base dispatch, journal), by seq
    # (id, seq, record), in the order first written: the order the outputs were emitted
    outbox: list[tuple[str, int, bytes]]
    calls: list[CallRecord]  # by seq, task id, idx
    source: dict[str, Any]
    stats: dict[str, Any]
    stored_keys: int = 0  # how many keys the state holds (with lazy_keys, more than `keys`)


# (action name, sorted names of the events it hears), in dispatch order
DispatchTable = list[tuple[str, list[str]]]


@dataclass
class AgentVersion:
    """What a store records of the agent that runs on it (`adopt`)."""

    name: str
    fingerprint: str
    table: DispatchTable
    memory_version: int = 1


@dataclass
class Pinned:
    """The agent version a run in flight started under, as far as its replay needs it."""

    table: DispatchTable
    memory_version: int


@dataclass
class Adopted:
    """What `adopt` found: runs in flight that started under another agent version."""

    # input seq -> the version its run started with (runs of the current version absent)
    pinned: dict[int, Pinned] = field(default_factory=dict)
    # the previous agent's fingerprint when this adoption changed it, else None
    upgraded_from: str | None = None


def ltm_key_scope(key: Any) -> str:
    """The long-term memory scope of a key: `key:<text>` for a string key, `key#<type>:<text>`
    for any other (no `key:` scope can equal it), so the integer key 1 and the string key "1"
    each have their own (they shared `key:1`: each read the other's memories)."""
    if type(key) is str:
        return f"key:{key}"
    return f"key#{type(key).__name__}:{key}"


def int_text(text: str) -> bool:
    """Whether `text` is how an integer key reads (so "1" may be the integer key 1)."""
    return text.lstrip("-").isdigit() and str(int(text)) == text


def signal_key_type(key: Any) -> str:
    """A key's type as the signals and traces tables record it (`key_type`): the integer key
    1 and the string key "1" share a text, and a signal is for (a trace is of) one of them."""
    return "int" if isinstance(key, int) and not isinstance(key, bool) else "str"


# Call records the store reads as more than bytes (their writers: ratchet.runtime._dispatch).
# A signal wait's record: "ok" holds the value of the signal it took.
SIGNAL_FN = "ratchet.signal"
# A replay marker, at index -F: the records from F on come from an attempt that re-executed a
# task and was never accepted (see the runtime's `REPLAY_FN`). Its payload is None, or the
# signals that attempt took (`taken_signals`), so that dropping their records can put the
# signals back as they were sent.
REPLAY_FN = "ratchet.replay"

# A row of the signals table: (id, key as text, name, encoded value, sent at, key type).
SignalRow = tuple[int, str, str, bytes, float, str | None]


def covering_marker(marker_idxs: Iterable[int], idx: int) -> int | None:
    """The index of the replay marker whose attempt wrote the record at `idx` (the marker at
    -F with the largest F <= idx), or None: a record no replay marker covers."""
    found = [m for m in marker_idxs if m < 0 and -m <= idx]
    return min(found) if found else None


def taken_signals(payload: bytes | None) -> dict[int, list[Any]]:
    """A replay marker's signals: record index -> [signal id, key text, sent at, key type]."""
    if not payload:
        return {}
    taken = codec.decode(payload)
    return dict(taken) if isinstance(taken, dict) else {}


def signal_back(record: CallRecord, taken: list[Any]) -> SignalRow | None:
    """The signal a delivered signal's record took, as the signals table held it (None when
    the record is not one)."""
    if record.fn != SIGNAL_FN or record.status != "ok" or record.payload is None:
        return None
    sid, key_text, sent_at, key_type = taken
    return (int(sid), str(key_text), record.digest, record.payload, float(sent_at), key_type)


def signals_taken(
    markers: dict[int, bytes | None],
    records: Iterable[CallRecord],
    kept: Mapping[int, list[Any]] | None = None,
) -> Iterator[tuple[CallRecord, SignalRow]]:
    """The signals `records` took under their replay markers (`markers`: index -> payload),
    each with the record that took it: what dropping or releasing those records puts back.
    With `kept` (record index -> the signal as its own row keeps it, `taken_signal`), every
    record that took a signal counts, under a marker or not: what discarding the whole run
    (`discard_run`) puts back."""
    for r in records:
        mark = covering_marker(markers, r.idx)
        taken = taken_signals(markers[mark]).get(r.idx) if mark is not None else None
        if taken is None and kept is not None:
            taken = kept.get(r.idx)
        row = signal_back(r, taken) if taken is not None else None
        if row is not None:
            yield r, row


def taken_signal(signal_id: int, key_text: str, sent_at: float, key_type: str | None) -> bytes:
    """What a delivered signal's record keeps of the signal it took (schema 13 on, for every
    delivery, not only one a replay marker covers), so that discarding its run puts it back
    as it was sent: [signal id, key text, sent at, key type], encoded."""
    return codec.encode([signal_id, key_text, sent_at, key_type])


def run_signals(
    calls: Iterable[CallRecord],
    kept: Mapping[tuple[str, int], bytes | None],
    key: Callable[[], Any],
    now: float,
) -> list[tuple[int | None, str, str, bytes, float, str | None]]:
    """Every signal a run took (its `calls`, of every task; `kept`: (task id, index) -> what
    the record's row keeps, `taken_signal`), in the order sent: what `discard_run` puts back
    or keeps with the dead letter. A record that took a signal and keeps nothing of it (taken
    before schema 13, where no replay marker covers it) gives it back as a new signal (id
    None) for the run's key (`key()`, called only then), sent `now`: its id and time were
    not kept."""
    by_task: dict[str, list[CallRecord]] = {}
    for r in calls:
        by_task.setdefault(r.task_id, []).append(r)
    found: list[tuple[int | None, str, str, bytes, float, str | None]] = []
    for task_id, records in sorted(by_task.items()):
        markers = {r.idx: r.payload for r in records if r.idx < 0 and r.fn == REPLAY_FN}
        own = {
            i: list(codec.decode(blob))
            for (t, i), blob in kept.items()
            if t == task_id and blob is not None
        }
        seen: set[int] = set()
        for r, row in signals_taken(markers, records, own):
            seen.add(r.idx)
            found.append(row)
        for r in records:
            if r.idx not in seen and r.fn == SIGNAL_FN and r.status == "ok" and r.payload:
                k = key()
                found.append((None, str(k), r.digest, r.payload, now, signal_key_type(k)))
    return sorted(found, key=lambda row: (row[0] is None, row[0] or 0))


# Dead letters of runs that took signals: a failed run's (written by the checkpoint that
# completes it) and an abandoned run's (`discard_run`). Their detail keeps those signals
# ("signals", `with_run_signals`) until a redrive admits them (`redrive_signals`).
FAILED_RUN = "failed-run"
KEEPS_SIGNALS = (FAILED_RUN, "abandoned")


def signal_entry(row: tuple[int | None, str, str, bytes, float, str | None]) -> dict[str, Any]:
    """A signal as a failed or abandoned run's dead letter keeps it (its detail's "signals")."""
    sid, key_text, name, value, sent_at, key_type = row
    return {
        "id": sid, "key": key_text, "name": name, "value": value, "sent_at": sent_at,
        "key_type": key_type,
    }  # fmt: skip


def entry_signal(entry: Any) -> tuple[int | None, str, str, bytes, float, str | None]:
    """The signal a dead letter's entry (`signal_entry`) keeps, as the signals table holds it
    (id None: give it a new one)."""
    sid = entry["id"]
    return (
        None if sid is None else int(sid), str(entry["key"]), str(entry["name"]),
        bytes(entry["value"]), float(entry["sent_at"]), entry["key_type"],
    )  # fmt: skip


def with_run_signals(
    detail: bytes | None, taken: list[tuple[int | None, str, str, bytes, float, str | None]]
) -> bytes | None:
    """A dead letter's encoded detail (a dict, or None) with the signals its run took
    (`run_signals`), as "signals" (`signal_entry` each), for its redrive to put back
    (`redrive_signals`); unchanged when the run took none."""
    if not taken:
        return detail
    held = codec.decode(detail, unknown="generic") if detail is not None else {}
    if not isinstance(held, dict):  # no ratchet writes one: kept as "detail", beside them
        held = {"detail": held}
    held["signals"] = [signal_entry(t) for t in taken]
    return codec.encode(held)


def journal_tasks(journal: bytes) -> int | None:
    """How many tasks a run's encoded journal holds (None: it does not decode as one)."""
    try:
        return len(codec.decode(journal, unknown="generic"))
    except (codec.CorruptDataError, TypeError, ValueError):
        return None


def version_id(fingerprint: str, memory_version: int) -> str:
    """What a run in flight is pinned to: the dispatch table and the memory layout."""
    return f"{fingerprint}.m{memory_version}"


def adopt_pins(
    pins: dict[int, str],
    live: set[int],
    previous: str | None,
    current: str,
    versions: dict[str, Pinned],
) -> tuple[dict[int, str], Adopted]:
    """The adoption rule both stores follow: runs in flight (`live`) when the version changes
    from `previous` to `current` are pinned to `previous`; pins of completed runs and of the
    current version go. Returns the pins to keep and what `adopt` reports."""
    pins = {s: v for s, v in pins.items() if s in live}
    upgraded_from = None
    if previous is not None and previous != current:
        upgraded_from = previous
        for seq in live:
            pins.setdefault(seq, previous)
    pins = {s: v for s, v in pins.items() if v != current}
    missing = sorted({v for v in pins.values() if v not in versions})
    if missing:
        raise StateError(
            f"runs in flight started under agent version(s) {missing}, which the state does "
            f"not describe; it was left untouched; restore it from a backup or use a new --state"
        )
    return pins, Adopted({s: versions[v] for s, v in pins.items()}, upgraded_from)


def check_adoption(
    where: str,
    stored_name: str | None,
    stored_table: DispatchTable | None,
    agent: AgentVersion,
    highest_memory_version: int,
) -> None:
    """Refuse what no upgrade rule covers: another agent's state, or a memory downgrade."""
    if stored_name and stored_name != agent.name and stored_table:
        shared = {n for n, _ in stored_table} & {n for n, _ in agent.table}
        if not shared:
            raise StateError(
                f"{where} belongs to agent {stored_name} (actions "
                f"{[n for n, _ in stored_table]}); {agent.name} has none of those actions "
                f"({[n for n, _ in agent.table]}), so it is another agent, not a new version of "
                f"it; pass the agent that owns this state, or use a new --state"
            )
    if highest_memory_version > agent.memory_version:
        raise StateError(
            f"{where} holds memory at memory_version {highest_memory_version}, and {agent.name} "
            f"declares memory_version {agent.memory_version}: memory is never migrated "
            f"backwards; run the agent version that wrote it (or a newer one), or restore a "
            f"savepoint taken before the upgrade"
        )


@runtime_checkable
class CheckpointStore(Protocol):
    """What an engine needs from durable state. Called from one thread at a time."""

    def adopt(self, agent: AgentVersion, dry_run: bool = False) -> Adopted:
        """Record `agent` as the one running on this state, before `load`.

        When its dispatch table or memory version differs from the stored one, runs in flight
        keep the version they started with (returned in `pinned`, kept until they complete). Refuses
        another agent's state and memory newer than `agent.memory_version`. Atomic.
        `dry_run`: report (and refuse) the same, recording nothing: an engine adopts for real
        only once the runs in flight restored under the new agent."""
        ...

    def load(self, lazy_keys: bool = False) -> Loaded:
        """The state of the latest completed checkpoint plus every call record written since.

        `lazy_keys`: only the keys with an input row come in `keys` (a restart with many idle
        keys reads none of them); `key_row` reads any other when it is first needed."""
        ...

    def key_row(self, key: bytes) -> tuple[int, bytes, int] | None:
        """One key's committed (next dispatch, memory, memory version), or None for a key the
        state does not hold: an indexed read of the latest completed checkpoint. Unlike the
        other methods it may be called from a thread other than the one writing (the engine's
        loop reads a key when its first input after a restart arrives)."""
        ...

    def write_checkpoint(self, rows: CheckpointRows, triggered_at: float) -> dict[str, Any]:
        """Apply one checkpoint atomically; returns its stats (id, trigger_timestamp,
        duration_ms, size_bytes). On any error nothing of it is applied. A failed run's dead
        letter (kind `FAILED_RUN`, its seq among `completed`) gets the signals its run took
        in its detail (`run_signals`, `with_run_signals`), read from the call records the
        checkpoint deletes: its redrive puts them back (`redrive_signals`)."""
        ...

    def put_calls(self, records: Iterable[CallRecord]) -> None:
        """Make durable-call records durable now, all or none (a group commit)."""
        ...

    def redrives(self) -> list[tuple[int, bytes, bytes]]:
        """Dead letters asked to be redriven (another process may ask) and not yet redriven:
        (id, encoded key, encoded event), oldest first. A checkpoint's `redriven` marks them."""
        ...

    def redrive_signals(self, dead_ids: list[int]) -> list[SignalRow]:
        """Put back the signals that the failed or abandoned runs of these dead letters
        (asked to be redriven, not redriven yet) took, as they were sent, each once: the
        checkpoint that completes a failed run (`write_checkpoint`) and `discard_run` with a
        reason keep them in the dead letter's detail ("signals", `with_run_signals`), and
        this moves them to the signals table and records them in the detail as put back
        ("signals_put_back"), in one transaction.
        Called when a redrive admits the dead letters, before their new runs start, so those
        take them again. Returns the signals put back."""
        ...

    def signals_after(self, signal_id: int) -> list[tuple[int, str, str, bytes, float, str | None]]:
        """Signals not consumed with an id above `signal_id`, in the order sent:
        (id, key as text, name, encoded value, sent at, key type: 'str', 'int' or None for
        either). Senders may be other processes."""
        ...

    def consume_signal(self, signal_id: int, record: CallRecord) -> None:
        """Deliver a signal: write `record` (the waiting task's call record, holding the value)
        and remove the signal, in one transaction, so it is delivered exactly once. The
        record keeps the signal as it was sent (`taken_signal`), for `discard_run`; when a
        replay marker covers the record (`covering_marker`), the marker's payload keeps it
        too (`taken_signals`), for `drop_calls` and `release_signals`."""
        ...

    def drop_calls(self, seq: int, task_id: str, from_idx: int) -> list[SignalRow]:
        """Delete one task's call records from `from_idx` on and its replay marker at
        -from_idx (what a refused replay attempt added), putting back, in the same
        transaction, every signal one of them took, with its id and time sent. Returns the
        signals put back."""
        ...

    def release_signals(self, seq: int, task_id: str, idxs: list[int]) -> list[SignalRow]:
        """Of one task's records at `idxs`, delete those that took a signal a replay marker
        keeps, and put the signals back, in one transaction; returns them. Other records
        stay (a record no marker covers took its signal for good)."""
        ...

    def release_attempt_signals(self, seq: int, task_id: str, key: Any) -> list[SignalRow]:
        """An attempt of a task that failed and will be tried again (its records are under
        `task_id`: `<task id>` for the first, `<task id>#<n>` for attempt n) gives back the
        signals it took: delete its delivered signals' records (SIGNAL_FN, "ok") and put the
        signals back as they were sent (`run_signals`: what the record, or a replay marker,
        keeps), in one transaction; returns them in the order sent. A record from before
        schema 13 that keeps nothing of its signal gives it back as a new signal for `key`
        (the run's), sent now. Optional: an engine whose store lacks it leaves them taken."""
        ...

    def forget_outputs(self, ids: list[str]) -> None:
        """Drop outbox rows of outputs the sink holds (they are never needed again)."""
        ...

    def count_failed_checkpoint(self) -> None:
        """Count a failed checkpoint; best effort (the failing disk may fail this too)."""
        ...

    def record_restore(self) -> dict[str, Any] | None:
        """Count a restore of the latest completed checkpoint and return it (None if fresh)."""
        ...

    def stats(self) -> dict[str, Any]:
        """{"counts": {completed, failed, restored}, "latest_completed", "latest_restored"}."""
        ...

    def ltm_rows(self, scope: str) -> list[tuple[str, str, bytes, bytes, float]]:
        """Committed long-term memories of `scope`: (id, text, encoded metadata, float32
        vector, added at), oldest first."""
        ...

    def close(self) -> None: ...
