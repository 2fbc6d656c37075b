"""The multi-process embedded engine: one coordinator, N shard workers, shared nothing.

The coordinator (the process `ratchet run --workers N` starts) reads the job's source and
writes its sink; nothing else. It numbers each input by its place in the source (the number
a single-process engine would give it), sends it to the worker of its key's shard, and writes
to the sink the outputs workers release. Each worker is an ordinary embedded `Engine` on its
own shard directory, whose source is the coordinator (`PipeSource`) and whose sink is the
coordinator (`PipeSink`). docs/operations.md has the guarantees and why they hold. A shard's
first worker is forked from the coordinator where that is safe (`fork_workers`, `_forking`);
otherwise, and for every restart, it is a new `python -m ratchet.agents._sharded`.

Wire: frames of a 4-byte big-endian length and a `codec` body (no pickle), over a socket pair.
coordinator -> worker: ["in", end, at, [[seq, key, value], ...]] (inputs, then the source's
position `at` after input `end - 1`), ["eof"], ["stop"], ["ack", n, written] (written: how
many of them the sink wrote now, not holding them already), ["nack", n, why, away] (away:
[server, address] when the sink's server was away, else None).
worker -> coordinator: ["hello", next, from, at] (restored), ["took", frames],
["partial", result] (before it ends by a signal sent to it alone),
["committed", next, from, at] (after each checkpoint), ["out", n, records] (or, for a JSONL
sink, ["lines", n, [[id, line], ...]] rendered by the worker), ["report", json] (supervised),
["done", result], ["error", type, message].
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet import _errors
from ratchet._clock import SYSTEM_CLOCK
from ratchet._errors import BadInputError, RatchetError, ServerUnreachableError, StateError
from ratchet.runtime._engine import (
    EngineConfig,
    EngineResult,
    runs_waiting_for_signals,
    stopped_for_max_errors,
    waiting_for_signals,
)
from ratchet.runtime._forking import ForkedWorker, fork_unsafe, fork_worker, start_method
from ratchet.runtime._io import (
    JsonlSink,
    Record,
    Sink,
    Source,
    line_problem,
    output_line,
    stopped_at_bad_input,
    writable,
)
from ratchet.runtime._shards import Layout, shard_of, write_in_force
from ratchet.store import codec

log = logging.getLogger("ratchet.shards")

_HEADER = struct.Struct(">I")
BATCH = 256  # inputs read from the source per round of frames
WINDOW = 32  # frames a worker may hold unread before the coordinator waits for it
RESTARTS = 20  # times in a row one shard's worker may be restarted (killed by a signal)
# A shard's worker that has run this long since its restore (its hello) starts that count
# again: a job that runs for months is not stopped by a few kills weeks apart (0: never).
RESET_AFTER = 600.0
PIDS_FILE = "workers.json"  # in shards/: the pids of the coordinator and its workers
_PLACES = 1 << 18  # keys whose shard the coordinator remembers


def _too_often() -> str:
    within = f", none of them running {RESET_AFTER:g} s" if RESET_AFTER > 0 else ""
    return f" (killed again after {RESTARTS} restarts in a row{within})"


def _frame(msg: Any) -> bytes:
    body = codec.encode(msg)
    return _HEADER.pack(len(body)) + body


class WorkerConn:
    """A worker's end of the socket: blocking sends from any thread, one reader thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, msg: Any) -> None:
        data = _frame(msg)
        with self._lock:
            self.sock.sendall(data)

    def recv(self) -> Any:
        header = self._exactly(_HEADER.size)
        if header is None:
            return None
        body = self._exactly(_HEADER.unpack(header)[0])
        if body is None:
            return None
        return codec.decode(body)

    def _exactly(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)


# -- the worker's source and sink ------------------------------------------------------------------


class PipeSource(Source):
    """Inputs the coordinator sends this shard, in source order.

    Its position is (next, from, at): every input of this shard numbered below `next` is
    admitted (it is in the checkpoint's memory, queue or runs); re-reading the job's source
    from `at` (the place of input number `from`, from <= next) yields every input not yet
    admitted. An input numbered below `next` that arrives again (a re-send) is dropped.
    """

    follow = True

    def __init__(self, conn: WorkerConn) -> None:
        self.conn = conn
        self.frames: collections.deque[list[Any]] = collections.deque()
        self.next = 0
        self.from_ = 0
        self.at: dict[str, Any] = {}
        self._i = 0
        self._taken = 0
        self.wake: Any = None  # set once the engine's loop runs: pokes it on new frames

    def push(self, frame: list[Any]) -> None:
        """From the reader thread."""
        was_empty = not self.frames
        self.frames.append(frame)
        if was_empty and self.wake is not None:
            self.wake()

    def restore(self, position: dict[str, Any]) -> None:
        if position:
            if "next" not in position or "at" not in position:
                raise StateError(
                    "this shard's state was not written by a shard worker (its source position "
                    f"has no 'next'/'at': {sorted(position)}); restore the state directory"
                )
            self.next = int(position["next"])
            self.from_ = int(position["from"])
            self.at = dict(position["at"])
        self.conn.send(["hello", self.next, self.from_, self.at])

    def position(self) -> dict[str, Any]:
        return {"next": self.next, "from": self.from_, "at": self.at}

    def next_record(self) -> Record | None:
        frames = self.frames
        while frames:
            frame = frames[0]
            if frame[0] == "eof":
                frames.popleft()
                self._took()
                self.follow = False
                return None
            _kind, end, at, records = frame
            i = self._i
            while i < len(records):
                seq, key, value = records[i]
                i += 1
                if seq >= self.next:
                    self._i = i
                    self.next = seq + 1
                    return Record(seq, key=key, value=value, seq=seq)
            frames.popleft()
            self._i = 0
            self._took()
            if end > self.next:
                self.next = end
            if end > self.from_:
                self.from_, self.at = end, at
        return None

    def _took(self) -> None:
        self._taken += 1
        if self._taken >= 8 or not self.frames:
            self.conn.send(["took", self._taken])
            self._taken = 0

    def unread(self) -> None:
        """Never called: the coordinator sends only good inputs (it handles bad lines)."""

    def acknowledge(self, position: dict[str, Any]) -> None:
        self.conn.send(["committed", position["next"], position["from"], position["at"]])


class PipeSink(Sink):
    """Outputs go to the coordinator, which writes them to the job's sink; `write` returns
    only once the coordinator says they are written (durably, for the JSONL sink). Until then
    they stay in this shard's outbox, and are sent again after a restart (the sink drops an id
    it already holds)."""

    def __init__(self, conn: WorkerConn, lines_for: str | None = None) -> None:
        """`lines_for`: the job's sink is its JSONL file, whose lines carry this job id
        ("" for none): outputs are checked and rendered here (`output_line`), in parallel
        over the workers, and the coordinator only appends them."""
        self.conn = conn
        self._lines = lines_for is not None
        self._job = lines_for or None
        self._checked: dict[str, tuple[dict[str, Any], str]] = {}
        self._n = 0
        self._waits: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._lock = threading.Lock()

    def validate(self, record: dict[str, Any]) -> str | None:
        if not self._lines:
            return None  # the coordinator's sink checks them
        try:
            line = output_line(record, self._job)
        except Exception as exc:  # noqa: BLE001 - whatever fails is the reason, as in JsonlSink
            return line_problem(record, exc)
        self._checked[record["id"]] = (record, line)
        return None

    def write(self, records: list[dict[str, Any]]) -> int | None:
        with self._lock:
            self._n += 1
            n = self._n
            done = threading.Event()
            why: list[Any] = [None, None, None]  # why not written; how many written; away
            self._waits[n] = (done, why)
        if self._lines:
            checked, self._checked = self._checked, {}
            pairs = []
            for rec in records:
                hit = checked.get(rec["id"])
                line = hit[1] if hit is not None and hit[0] is rec else output_line(rec, self._job)
                pairs.append([rec["id"], line])
            self.conn.send(["lines", n, pairs])
        else:
            self.conn.send(["out", n, records])
        done.wait()
        if why[0] is not None:
            said = f"the coordinator could not write the outputs: {why[0]}"
            if why[2] is not None:
                server, address = why[2]
                raise ServerUnreachableError(said, server=server, address=address)
            raise OSError(said)
        return why[1]  # type: ignore[no-any-return]

    def answered(
        self, n: int, why: str | None, written: int | None = None, away: list[str] | None = None
    ) -> None:
        """`away`: [server, address] when the sink's server was away (a nack's last item)."""
        with self._lock:
            wait = self._waits.pop(n, None)
        if wait is not None:
            wait[1][0] = why
            wait[1][1] = written
            wait[1][2] = away
            wait[0].set()


# -- the worker process ----------------------------------------------------------------------------


def die_with_parent() -> None:
    """A worker must not outlive its coordinator: on Linux the kernel SIGKILLs it when the
    coordinator dies (a kill is always safe: the shard restarts from its checkpoint)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere: the closed socket ends the worker at its next read
    if os.getppid() == 1:
        os._exit(70)


def wait_for_lock(sdir: Path) -> None:
    """A worker of a killed coordinator may still hold the shard for a moment: wait for it."""
    import fcntl

    from ratchet.store._sqlite import LOCK_NAME

    sdir.mkdir(parents=True, exist_ok=True)
    fd = os.open(sdir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the old holder is gone, no polling
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# -- the whole job's status, from its workers' reports ---------------------------------------------

_COUNTED = ("inputs", "runs_completed", "outputs", "runs_failed", "dead_letters")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def counts_of(report: dict[str, Any] | None) -> dict[str, float]:
    """A worker's own counts in its report (they start at 0 in every worker process)."""
    status = (report or {}).get("status") or {}
    out = {n: float(status[n]) for n in _COUNTED if _number(status.get(n))}
    for name, value in (status.get("metrics") or {}).items():
        if _number(value):
            out[f"metrics:{name}"] = float(value)
    return out


def _newest(items: list[Any], when: str) -> Any:
    found = [i for i in items if isinstance(i, dict)]
    return max(found, key=lambda i: i.get(when) or 0.0) if found else None


def merge_reports(
    reports: list[dict[str, Any] | None],
    carried: list[dict[str, float]],
    *,
    pids: list[int | None],
    restarts: list[int],
) -> dict[str, Any]:
    """One status report for the whole job, shaped as one engine's (what the supervisor, the
    REST API and the dashboard read): counts summed over the shards (with those of a shard's
    killed workers, `carried`), lists joined, checkpoint counts summed and each `latest` the
    newest of any shard (its id is that shard's own). Each shard's own figures under
    "shards"."""
    totals: dict[str, float] = {}
    for report, before in zip(reports, carried, strict=True):
        for counts in (counts_of(report), before):
            for name, value in counts.items():
                totals[name] = totals.get(name, 0.0) + value
    statuses = [(r or {}).get("status") or {} for r in reports]
    status: dict[str, Any] = {n: int(totals.get(n, 0.0)) for n in _COUNTED}
    status["metrics"] = {
        k.removeprefix("metrics:"): v for k, v in totals.items() if k.startswith("metrics:")
    }
    for name in ("in_flight_runs", "buffered_inputs"):
        status[name] = sum(int(s.get(name) or 0) for s in statuses)
    status["waiting"] = [w for s in statuses for w in s.get("waiting") or []]
    status["paused"] = [p for s in statuses for p in s.get("paused") or []]
    restore = [s["restore_seconds"] for s in statuses if _number(s.get("restore_seconds"))]
    status["restore_seconds"] = max(restore) if restore else None
    cps = [(r or {}).get("checkpoints") or {} for r in reports if r is not None]
    counts = {
        c: sum(int((cp.get("counts") or {}).get(c) or 0) for cp in cps)
        for c in ("completed", "failed", "in_progress", "restored", "total")
    }
    latest = {
        which: _newest([(cp.get("latest") or {}).get(which) for cp in cps], when)
        for which, when in (
            ("completed", "trigger_timestamp"),
            ("failed", "failure_timestamp"),
            ("restored", "restored_at"),
        )
    }
    shards = [
        {
            "shard": i,
            "pid": pids[i],
            "restarts": restarts[i],
            "reported": r is not None,
            "in_flight_runs": statuses[i].get("in_flight_runs"),
            "queued_inputs": statuses[i].get("buffered_inputs"),
            "checkpoints": (r or {}).get("checkpoints"),
        }
        for i, r in enumerate(reports)
    ]
    return {"checkpoints": {"counts": counts, "latest": latest}, "status": status, "shards": shards}


# -- the coordinator -------------------------------------------------------------------------------


@dataclass(eq=False)
class _Shard:
    index: int
    dir: Path
    proc: subprocess.Popen[bytes] | ForkedWorker | None = None
    forked: socket.socket | None = None  # our end to a worker forked before the loop started
    writer: asyncio.StreamWriter | None = None
    ready: bool = False
    hello: asyncio.Future[None] | None = None
    next: int = 0  # what the shard restored (inputs below it are dropped, not re-sent)
    committed: tuple[int, int, dict[str, Any]] = (0, 0, {})
    # Input frames sent (or to send) and not yet in a completed checkpoint of the shard, as
    # (end, encoded frame), the bytes sent rather than the parsed records: about 150 bytes
    # less per input held, and a shard holds every input until its next checkpoint.
    retained: collections.deque[tuple[int, bytes]] = field(default_factory=collections.deque)
    inflight: int = 0
    room: asyncio.Event = field(default_factory=asyncio.Event)
    result: dict[str, Any] | None = None
    error: tuple[str, str] | None = None
    restarts: int = 0  # in all, in this coordinator's run (reported; only grows)
    in_a_row: int = 0  # the restarts RESTARTS limits (see RESET_AFTER)
    running_since: float | None = None  # SYSTEM_CLOCK.monotonic() at its current worker's hello
    gone: bool = False  # ended and not to be restarted
    report: dict[str, Any] | None = None  # the worker's latest status report (supervised jobs)
    carried: dict[str, float] = field(default_factory=dict)  # counts of its killed workers
    # The results of its workers that ended by a signal sent to them alone (then restarted):
    # what they did counts in the job's result.
    partials: list[dict[str, Any]] = field(default_factory=list)


class Coordinator:
    """Read the source, route inputs to shard workers, write their outputs to the sink."""

    def __init__(
        self,
        agent_spec: str,
        layout: Layout,
        state_dir: Path,
        source: Source,
        sink: Sink,
        config: EngineConfig,
        *,
        stop_at: int | None = None,
        on_report: Callable[[dict[str, Any]], None] | None = None,
        worker_main: Callable[[list[str]], int] | None = None,
    ) -> None:
        """`on_report`: called with the whole job's status (`merge_reports`) each time a
        worker reports (after its restore and every checkpoint); workers report only then.
        `worker_main`: the worker's entry (`python -m ratchet.agents._sharded` runs it with
        the same arguments), which `fork_workers` runs in forked children."""
        self.agent_spec = agent_spec
        self.worker_main = worker_main
        self.on_report = on_report
        self.layout = layout
        self.state_dir = state_dir
        self.source = source
        self.sink = sink
        self.config = config
        self.stop_at = stop_at
        self.shards = [_Shard(i, d) for i, d in enumerate(layout.dirs)]
        self.seq = 0
        self.result = EngineResult()
        self._eof_sent = False
        self._stopping = False
        self._stop_reason = ""
        self._fatal: BaseException | None = None
        self._bad: BadInputError | None = None
        self._acked_from = -1
        self._sink_thread = concurrent.futures.ThreadPoolExecutor(1, "ratchet-sink")
        self._wake: asyncio.Event | None = None
        self._all_done: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._places: dict[Any, int] = {}
        self._writing: set[asyncio.Future[Any]] = set()  # outputs the sink thread writes

    # -- workers ---------------------------------------------------------------------------

    def _worker_config(self) -> str:
        cfg = dict(self.config.as_dict())
        cfg["follow_poll"] = 1.0  # a worker is poked when input arrives; this is a backstop
        return json.dumps(cfg)

    def _worker_args(self, shard: _Shard, fd: int) -> list[str]:
        """The worker's arguments, the same whether it is forked or executed."""
        args = [
            "--fd", str(fd), "--dir", str(shard.dir), "--agent", self.agent_spec,
            "--config", self._worker_config(),
        ]  # fmt: skip
        if self.on_report is not None:
            args.append("--report")
        if type(self.sink) is JsonlSink:  # the workers render its lines
            args += ["--lines-for", self.sink.job_id or ""]
        return args

    def fork_workers(self) -> bool:
        """Start every shard's first worker by forking this process, before the event loop
        starts (no loop, no sink thread yet): a worker then costs a fork, not a new
        interpreter's imports. Call from the thread that will run `run()`. False (nothing
        started; `run()` executes new interpreters as before) when `$RATCHET_WORKER_START`
        is `exec`, there is no `worker_main`, or forking is not safe now (`fork_unsafe`).
        Restarts of killed workers always execute a new interpreter (threads exist by then)."""
        if self.worker_main is None or start_method() != "fork":
            return False
        why = fork_unsafe()
        if why is not None:
            log.info("starting shard workers as new interpreters: %s", why)
            return False
        for shard in self.shards:
            ours, theirs = socket.socketpair()
            try:
                shard.proc = fork_worker(
                    self.worker_main, self._worker_args(shard, theirs.fileno()), theirs.fileno()
                )
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            shard.forked = ours
        log.debug("forked %d shard workers", len(self.shards))
        return True

    def end_workers(self) -> None:
        """Kill and wait for every worker still running (the end of `run()`, or a job that
        stops before it started its loop)."""
        for s in self.shards:
            if s.proc is not None and s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()
            if s.forked is not None:
                s.forked.close()
                s.forked = None

    async def _spawn(self, shard: _Shard) -> None:
        loop = asyncio.get_running_loop()
        if shard.forked is not None:  # started by fork_workers: only connect to it
            ours, shard.forked = shard.forked, None
        else:
            ours, theirs = socket.socketpair()
            argv = [
                sys.executable, "-m", "ratchet.agents._sharded",
                *self._worker_args(shard, theirs.fileno()),
            ]  # fmt: skip
            # Started from the loop's thread, which lives as long as the job: a worker's
            # parent-death signal fires when the thread that started it ends.
            # The worker imports the agent as this process did: with this process's sys.path.
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            shard.proc = subprocess.Popen(  # noqa: ASYNC220 - a fork and exec, not a wait
                argv, pass_fds=[theirs.fileno()], start_new_session=True, env=env
            )
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        shard.writer = writer
        shard.ready = False
        if shard.hello is None:  # a restart before the first hello keeps the start waiting on it
            shard.hello = loop.create_future()
        self._write_pids()
        assert shard.proc is not None
        self._start(self._read(shard, reader, shard.proc))

    def _start(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _write_pids(self) -> None:
        from ratchet.store._files import atomic_json

        path = self.state_dir / "shards" / PIDS_FILE
        try:
            atomic_json(
                path,
                {
                    "coordinator": os.getpid(),
                    "workers": {
                        str(s.index): s.proc.pid for s in self.shards if s.proc is not None
                    },
                },
            )
        except OSError as exc:  # informational only
            log.warning("could not write %s: %s", path, exc)

    def _send(self, shard: _Shard, msg: Any) -> None:
        self._send_bytes(shard, _frame(msg))

    def _send_bytes(self, shard: _Shard, data: bytes) -> None:
        if shard.writer is not None and not shard.writer.is_closing():
            shard.writer.write(data)

    async def _read(
        self,
        shard: _Shard,
        reader: asyncio.StreamReader,
        proc: subprocess.Popen[bytes] | ForkedWorker,
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                header = await reader.readexactly(_HEADER.size)
                msg = codec.decode(await reader.readexactly(_HEADER.unpack(header)[0]))
                kind = msg[0]
                if kind == "took":
                    shard.inflight -= msg[1]
                    if shard.inflight < WINDOW:
                        shard.room.set()
                elif kind in ("lines", "out"):
                    write = self._append if kind == "lines" else self._deliver
                    writing = loop.run_in_executor(self._sink_thread, write, msg[2])
                    self._writing.add(writing)
                    try:
                        wrote = await writing
                    finally:
                        self._writing.discard(writing)
                    self._send(
                        shard,
                        ["ack", msg[1], wrote]
                        if isinstance(wrote, int)
                        else ["nack", msg[1], *wrote],
                    )
                elif kind == "committed":
                    self._committed(shard, msg[1], msg[2], msg[3])
                elif kind == "hello":
                    self._hello(shard, msg[1], msg[2], msg[3])
                elif kind == "partial":
                    shard.partials.append(msg[1])
                elif kind == "done":
                    shard.result = msg[1]
                    why = str(msg[1].get("stopped_by") or "")
                    if stopped_for_max_errors(why):  # --max-errors, counted per shard
                        self.request_stop(f"shard {shard.index}: {why}")
                elif kind == "error":
                    shard.error = (msg[1], msg[2])
                elif kind == "report":
                    shard.report = json.loads(msg[1])
                    self._report()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        rc = await loop.run_in_executor(None, proc.wait)
        if shard.writer is not None:
            shard.writer.close()
        shard.ready = False
        shard.room.set()
        ran = (
            None if shard.running_since is None else SYSTEM_CLOCK.monotonic() - shard.running_since
        )
        shard.running_since = None
        if ran is not None and RESET_AFTER > 0 and ran >= RESET_AFTER:
            shard.in_a_row = 0  # not a crash loop: it ran long enough since its restore
        if shard.result is not None:
            log.debug("shard %d finished", shard.index)
        elif rc < 0 and (self._fatal or self._stopping) and shard.in_a_row < RESTARTS:
            # Killed while the job stops (for another reason, or a Ctrl-C that reached every
            # process of the group): not restarted; its state is a checkpoint like any other.
            shard.gone = True
        elif rc < 0 and not self._fatal and shard.in_a_row < RESTARTS:
            shard.restarts += 1
            shard.in_a_row += 1
            for name, value in counts_of(shard.report).items():  # the next worker counts from 0
                shard.carried[name] = shard.carried.get(name, 0.0) + value
            shard.report = None
            log.warning(
                "worker of shard %d (pid %d) was killed by signal %d; restarting it from its "
                "last checkpoint (restart %d; %d/%d in a row)", shard.index, proc.pid, -rc,
                shard.restarts, shard.in_a_row, RESTARTS,
            )  # fmt: skip
            try:
                await self._spawn(shard)
            except Exception as exc:  # noqa: BLE001 - the job stops, the others checkpoint
                shard.gone = True
                self._fail(RatchetError(f"worker of shard {shard.index} cannot restart: {exc}"))
                self._check_done()
            return
        else:
            err = shard.error
            what = (
                f"{err[1]}"
                if err is not None
                else f"it exited with code {rc}" + (_too_often() if rc < 0 else "")
            )
            shard.gone = True
            exc_type = getattr(_errors, err[0], None) if err is not None else None
            if not (isinstance(exc_type, type) and issubclass(exc_type, RatchetError)):
                exc_type = RatchetError
            self._fail(exc_type(f"worker of shard {shard.index} ({shard.dir}) failed: {what}"))
        self._check_done()

    def _deliver(self, records: list[dict[str, Any]]) -> int | list[Any]:
        """In the sink thread: write a worker's released outputs; how many the sink wrote
        now (the worker counts those), or why they could not be written (`_refusal`)."""
        try:
            checked, _refused = writable(self.sink, records)
            written = self.sink.write(checked)
        except Exception as exc:  # noqa: BLE001 - the worker keeps them and sends them again
            return _refusal(exc)
        return len(checked) if written is None else written

    def _append(self, pairs: list[list[str]]) -> int | list[Any]:
        """In the sink thread: append the JSONL lines a worker rendered; how many were new
        (not in the file already), or why they could not be written."""
        assert isinstance(self.sink, JsonlSink)
        try:
            return self.sink.write_lines([(i, line) for i, line in pairs])
        except Exception as exc:  # noqa: BLE001 - the worker keeps them and sends them again
            return _refusal(exc)

    def _report(self) -> None:
        if self.on_report is None:
            return
        merged = merge_reports(
            [s.report for s in self.shards],
            [s.carried for s in self.shards],
            pids=[s.proc.pid if s.proc is not None else None for s in self.shards],
            restarts=[s.restarts for s in self.shards],
        )
        merged["status"]["dead_letters"] += self.result.dead_letters  # bad lines it kept
        try:
            self.on_report(merged)
        except Exception:  # noqa: BLE001 - a report is informational; the job goes on
            log.exception("could not pass the job's status on")

    def _hello(self, shard: _Shard, nxt: int, frm: int, at: dict[str, Any]) -> None:
        shard.running_since = SYSTEM_CLOCK.monotonic()
        shard.next = nxt
        shard.committed = (nxt, frm, at)
        replay = 0
        for _end, data in shard.retained:  # what it had not committed, in order, again
            frame = codec.decode(data[_HEADER.size :])
            records = [r for r in frame[3] if r[0] >= nxt]
            self._send(shard, [frame[0], frame[1], frame[2], records])
            replay += 1
        if self._eof_sent:
            self._send(shard, ["eof"])
        shard.inflight = replay
        shard.ready = True
        shard.room.set()
        if self._stopping:
            self._send(shard, ["stop"])
        if shard.hello is not None and not shard.hello.done():
            shard.hello.set_result(None)

    def _committed(self, shard: _Shard, nxt: int, frm: int, at: dict[str, Any]) -> None:
        shard.committed = (nxt, frm, at)
        retained = shard.retained
        while retained and retained[0][0] <= nxt:
            retained.popleft()
        # Upstream may forget inputs once every shard has them in a completed checkpoint.
        low = min(self.shards, key=lambda s: s.committed[1])
        if low.committed[1] > self._acked_from and low.committed[2]:
            self._acked_from = low.committed[1]
            try:
                self.source.acknowledge(low.committed[2])
            except Exception:  # noqa: BLE001 - acknowledged again after the next checkpoint
                log.exception("the source failed to acknowledge checkpointed inputs upstream")

    def _fail(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
        self.request_stop(str(exc))

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop reading; every worker takes a final checkpoint (runs in flight are saved)."""
        if self._stopping:
            return
        self._stopping = True
        self._stop_reason = reason
        for s in self.shards:
            if s.ready:
                self._send(s, ["stop"])
            s.room.set()
        if self._wake is not None:
            self._wake.set()

    def _check_done(self) -> None:
        if self._all_done is not None and all(s.result is not None or s.gone for s in self.shards):
            self._all_done.set()

    # -- the source ------------------------------------------------------------------------

    async def _feed(self) -> None:
        n = len(self.shards)
        src = self.source
        while not self._stopping:
            batches: list[list[list[Any]]] = [[] for _ in range(n)]
            count = 0
            exhausted = False
            while count < BATCH:
                if self.stop_at is not None and self.seq >= self.stop_at:
                    exhausted = True
                    break
                try:
                    rec = src.next_record()
                except RatchetError as exc:
                    self._fail(exc)
                    return
                if rec is None:
                    exhausted = not src.follow
                    break
                if rec.error is not None:
                    if self.config.on_bad_input == "dead-letter":
                        self._keep_bad_line(rec)
                        continue
                    if self.config.on_bad_input == "skip":
                        log.warning("skipping bad input: %s", rec.error)
                        self.result.bad_inputs.append(rec.error)
                        continue
                    src.unread()  # read again at the next start, once it is fixed
                    self.result.bad_inputs.append(rec.error)
                    self._bad = stopped_at_bad_input(rec.error)
                    exhausted = True
                    break
                seq = self.seq
                self.seq += 1
                shard = self.shards[self._shard_of(rec.key, n)]
                if seq >= shard.next:  # below it the shard has it already
                    batches[shard.index].append([seq, rec.key, rec.value])
                count += 1
            if count or exhausted:
                at = src.position()
                for s in self.shards:
                    data = _frame(["in", self.seq, at, batches[s.index]])
                    s.retained.append((self.seq, data))
                    if s.ready:
                        self._send_bytes(s, data)
                        s.inflight += 1
                        if s.inflight >= WINDOW:
                            s.room.clear()
                await self._drain()
                if self._writing:
                    # The sink thread needs the GIL between every line it writes, and reading
                    # on (pure Python) starved it: the workers wait for these outputs' answer
                    # to finish their checkpoints.
                    await asyncio.wait(set(self._writing))
            if exhausted:
                self._eof_sent = True
                for s in self.shards:
                    if s.ready:
                        self._send(s, ["eof"])
                await self._drain()
                return
            for s in self.shards:
                while s.ready and s.inflight >= WINDOW and not self._stopping:
                    s.room.clear()  # set again by its "took", its end, or a stop
                    await s.room.wait()
            if not count:
                assert self._wake is not None
                try:
                    await asyncio.wait_for(self._wake.wait(), self.config.follow_poll)
                except TimeoutError:
                    pass
                self._wake.clear()

    def _shard_of(self, key: Any, n: int) -> int:
        """`shard_of`, remembered per str or int key: the hash costs about as much as parsing
        the input line, and keys repeat (the memo is dropped when it grows past `_PLACES`)."""
        if type(key) is not str and type(key) is not int:
            return shard_of(key, n)  # True == 1 and 1.0 == 1 as dict keys, not as shards
        places = self._places
        place = places.get(key)
        if place is not None:
            return place
        if len(places) >= _PLACES:
            places.clear()
        place = places[key] = shard_of(key, n)
        return place

    def _keep_bad_line(self, rec: Record) -> None:
        """`--on-bad-input dead-letter`: keep the bad line as a dead letter, durably, before any
        input after it is sent to a shard (so no shard can checkpoint past it first).

        Kept in the shard a row naming no key belongs to (where re-sharding puts it too), and
        at most once: after a restart the line is read again from the same source position,
        which is its natural key (an existing dead letter at that position means done)."""
        n = len(self.shards)
        target = self.layout.dirs[shard_of("", n)]
        pos = self.source.position()
        where = json.dumps(pos, sort_keys=True, default=str)
        detail = codec.encode({"position": pos, "line": rec.line})

        def put(conn: Any) -> bool:
            for (blob,) in conn.execute("SELECT detail FROM dead_letters WHERE kind = 'bad-input'"):
                try:
                    had = codec.decode(blob, unknown="generic").get("position")
                except Exception:  # noqa: BLE001 - a damaged row is not this line
                    continue
                if json.dumps(had, sort_keys=True, default=str) == where:
                    return False
            conn.execute(
                "INSERT INTO dead_letters(key, key_text, seq, event, reason, at, kind, detail) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (codec.encode(None), "", -1, codec.encode(rec.raw or ""), rec.error,
                 SYSTEM_CLOCK.now(), "bad-input", detail),
            )  # fmt: skip
            return True

        log.warning("bad input kept as a dead letter (%s): %s", target.name, rec.error)
        self.result.bad_inputs.append(str(rec.error))
        if write_in_force(self.state_dir, target, put):
            self.result.dead_letters += 1

    async def _drain(self) -> None:
        for s in self.shards:
            w = s.writer
            if s.ready and w is not None and not w.is_closing():
                try:
                    await w.drain()
                except ConnectionError:
                    pass  # its reader sees the end and restarts it

    # -- the job ---------------------------------------------------------------------------

    async def run(self, handle_signals: bool = False) -> EngineResult:
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._all_done = asyncio.Event()
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop, f"signal {sig.name}")
        try:
            for s in self.shards:
                await self._spawn(s)
            hellos = [s.hello for s in self.shards if s.hello is not None]
            stopper = asyncio.ensure_future(self._all_done.wait())
            while not stopper.done() and not all(h.done() for h in hellos):
                waiting: list[asyncio.Future[Any]] = [h for h in hellos if not h.done()]
                waiting.append(stopper)
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if self._fatal is None:
                # Re-read from the shard that is furthest behind; the others drop what they have.
                low = min(self.shards, key=lambda s: s.committed[1])
                self.seq = low.committed[1]
                self.source.restore(low.committed[2])
                self.result.restored_from = {"shards": {s.index: s.next for s in self.shards}}
                await self._feed()
            await self._all_done.wait()
        finally:
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            self.end_workers()
            for s in self.shards:
                if s.writer is not None:
                    s.writer.close()
            for t in list(self._tasks):
                t.cancel()
            self._sink_thread.shutdown(wait=True)
        if self._fatal is not None:
            raise self._fatal
        self._sum()
        if self._bad is not None:
            raise self._bad
        return self.result

    def _sum(self) -> None:
        r = self.result
        for s in self.shards:
            add_counts(r, s.result or {})
            for got in s.partials:
                add_counts(r, got)
        # A bounded job whose shards ended with runs parked on signals says so, as one
        # process does (and `ratchet run` then says they stay parked): it said "end of input".
        parked = sum(
            runs_waiting_for_signals(str((s.result or {}).get("stopped_by") or ""))
            for s in self.shards
        )
        r.stopped_by = self._stop_reason or (
            waiting_for_signals(parked) if parked else "end of input"
        )
        r.checkpoints = {str(s.index): (s.result or {}).get("checkpoints", {}) for s in self.shards}
        r.metrics = {"workers": float(len(self.shards))}


def _refusal(exc: Exception) -> list[Any]:
    """A failed sink write as a nack tells the worker: why, and the server and its address
    when the sink's server is away (the worker then raises `ServerUnreachableError`, and its
    engine waits for the server at the end of the input as one process does)."""
    log.warning("sink write failed; the shard keeps its outputs and retries: %s", exc)
    away = [exc.server, exc.address] if isinstance(exc, ServerUnreachableError) else None
    return [f"{type(exc).__name__}: {exc}", away]


def add_counts(into: EngineResult, got: dict[str, Any]) -> None:
    """Add what another engine's result (`asdict`) counted to `into`: a shard's, or the
    drain before a change of the number of workers."""
    for name in (
        "inputs", "runs_completed", "outputs", "tasks_executed", "tasks_replayed",
        "restored_runs", "runs_failed", "dead_letters", "redriven",
    ):  # fmt: skip
        setattr(into, name, getattr(into, name) + int(got.get(name) or 0))
    into.bad_inputs.extend(got.get("bad_inputs") or [])


__all__ = [
    "Coordinator",
    "PipeSink",
    "PipeSource",
    "WorkerConn",
    "die_with_parent",
    "wait_for_lock",
]
