"""`ratchet.open_state`: a read-only Python view of a state directory. States are built by real
jobs (in-process `ratchet.run`, and a `ratchet run --follow` process); what the API returns is
compared with what the CLI prints for the same state, and reading a running job's state
neither disturbs the job nor needs its lock."""

from __future__ import annotations

import hashlib
import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import ratchet
from ratchet import Agent, InputEvent, OutputEvent, StateError, action
from ratchet._state_api import State, open_state
from ratchet.store._sqlite import StateLock

RATCHET = [sys.executable, "-m", "ratchet.cli"]


def cli(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [*RATCHET, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def cli_json(*args: str | Path) -> Any:
    return json.loads(cli(*args, "--json").stdout)


def as_json(value: Any) -> Any:
    """What the CLI's `json.dumps(..., default=str)` makes of a value, read back."""
    return json.loads(json.dumps(value, default=str))


class Desk(Agent):
    """Writes memory, fails on request, or waits for a signal."""

    @action(InputEvent)
    async def handle(self, event: InputEvent, ctx: Any) -> None:
        op = event.input["op"]
        mem = ctx.short_term_memory
        if op == "fail":
            raise RuntimeError(f"cannot handle {event.input['key']}")
        if op == "wait":
            mem.set("asked", True)
            got = await ctx.wait_for_signal("x")
            mem.set("answer", got)
        else:
            mem.set("count", mem.get("count", 0) + 1)
            if "name" in event.input:
                mem.new_object("profile").set("name", event.input["name"])
            mem.set("tags", {"a", "b"})
        ctx.send_event(OutputEvent(output={"op": op}))


INPUTS = [
    {"key": "alice", "op": "write", "name": "Alice"},
    {"key": "alice", "op": "write"},
    {"key": "bob", "op": "fail"},
    {"key": "carol", "op": "wait"},
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stopped job's state: memory of two keys, a failed run (a dead letter), a run parked
    on a signal, a signal nobody waits for yet, and a savepoint."""
    tmp = tmp_path_factory.mktemp("state_api")
    state = tmp / "state"
    result = ratchet.run(Desk(), inputs=INPUTS, output=str(tmp / "out.jsonl"), state_dir=state)
    assert result.runs_failed == 1, result
    assert "waiting for signals" in result.stopped_by, result
    ratchet.send_signal(state, "dave", "y", {"a": 1})
    cli("savepoint", "--state", state, tmp / "sp.db")
    return state


def test_summary_is_what_ratchet_status_prints(built: Path) -> None:
    with open_state(built) as state:
        summary = state.summary()
    assert as_json(summary) == cli_json("status", "--state", built)
    assert summary["agent"].endswith("Desk")
    assert summary["in_flight_runs"] == 1 and summary["dead_letters"] == 1
    assert summary["runs_failed"] == 1 and summary["memory_version"] == 1
    assert [w["key"] for w in summary["waiting"]] == ["carol"]


def test_keys_and_memory_are_what_ratchet_inspect_prints(built: Path) -> None:
    inspected = cli_json("inspect", "--state", built)
    with open_state(built) as state:
        assert state.keys() == list(inspected)
        assert "alice" in state.keys()
        alice = state.memory("alice")
        assert alice == {"count": 2, "profile": {"name": "Alice"}, "tags": {"a", "b"}}
        for key in state.keys():
            assert state.memory(key, as_json=True) == inspected[key], key
        assert state.memory("nobody") is None
        # carol's run is in flight: its writes are not committed memory
        assert "asked" not in (state.memory("carol") or {})


def test_runs_in_flight_waits_and_signals(built: Path) -> None:
    listed = cli_json("runs", "list", "--state", built)
    status = cli_json("status", "--state", built)
    with open_state(built) as state:
        runs = state.runs_in_flight()
        waiting = state.waiting()
        signals = state.pending_signals()
    assert as_json(runs) == listed["in_flight"]
    assert [(r["key"], r["seq"]) for r in runs] == [("carol", 3)]
    assert as_json(waiting) == status["waiting"]
    assert len(waiting) == 1 and waiting[0]["key"] == "carol" and waiting[0]["on"] == "signal x"
    assert waiting[0]["until"] is None and waiting[0]["since"] is not None
    assert [{k: v for k, v in s.items() if k != "value"} for s in signals] == status[
        "pending_signals"
    ]
    assert [(s["key"], s["name"], s["value"]) for s in signals] == [("dave", "y", {"a": 1})]


def test_dead_letters_are_what_ratchet_dead_letters_prints(built: Path) -> None:
    with open_state(built) as state:
        letters = state.dead_letters()
    assert as_json(letters) == cli_json("dead-letters", "--state", built)
    assert [(d["kind"], d["key"], d["seq"]) for d in letters] == [("failed-run", "bob", 2)]
    assert "cannot handle bob" in json.dumps(letters, default=str)


def test_traces_are_what_ratchet_trace_prints(built: Path) -> None:
    with open_state(built) as state:
        alice = state.traces("alice")
        first = state.traces("alice", seq=0)
        assert state.traces("carol") == []  # in flight: no trace yet
        assert state.traces("nobody") == []
    assert [t["seq"] for t in alice] == [1, 0]
    assert as_json(alice[0]) == cli_json("trace", "--state", built, "--key", "alice")
    assert as_json(first) == [cli_json("trace", "--state", built, "--key", "alice", "--seq", "0")]
    assert [t["action"] for t in first[0]["tasks"]] == ["handle"]


def test_checkpoints_are_what_ratchet_checkpoints_prints(built: Path) -> None:
    with open_state(built) as state:
        got = state.checkpoints()
    assert as_json(got) == cli_json("checkpoints", "--state", built)
    assert got["checkpoints"] and got["checkpoints"][-1]["restorable"]
    assert len(got["savepoints"]) == 1


def _files(state: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(state.iterdir())
        if p.is_file()
    }


def test_reading_writes_nothing_and_needs_no_lock(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    ratchet.run(Desk(), inputs=INPUTS, output=str(tmp_path / "out.jsonl"), state_dir=state_dir)
    ratchet.send_signal(state_dir, "dave", "y", 1)
    before = _files(state_dir)
    lock = StateLock(state_dir)
    lock.acquire()  # as a running engine holds it
    try:
        with open_state(state_dir) as state:
            state.summary()
            state.keys()
            state.memory("alice")
            state.runs_in_flight()
            state.waiting()
            state.pending_signals()
            state.dead_letters()
            state.traces("alice")
            state.checkpoints()
    finally:
        lock.release()
    after = _files(state_dir)
    for name in ("ratchet.db", "job.json"):
        assert after[name] == before[name], name
    # SQLite's coordination files of a WAL database may be created by any reader (as by
    # `ratchet status`): an empty write-ahead log and the shared-memory index. No data.
    added = set(after) - set(before) - {"ratchet.lock"}
    assert added <= {"ratchet.db-wal", "ratchet.db-shm"}, added
    if "ratchet.db-wal" in added:
        assert (state_dir / "ratchet.db-wal").stat().st_size == 0
    # and the job goes on from that state as usual
    again = ratchet.run(
        Desk(), inputs=INPUTS, output=str(tmp_path / "out.jsonl"), state_dir=state_dir
    )
    assert again.inputs == 0, again
    with open_state(state_dir) as state:
        assert state.memory("alice") == {
            "count": 2,
            "profile": {"name": "Alice"},
            "tags": {"a", "b"},
        }


def test_a_closed_state_refuses_reads(built: Path) -> None:
    state = open_state(built)
    assert isinstance(state, State) and not state.closed and state.path == built
    state.close()
    state.close()  # idempotent
    assert state.closed
    with pytest.raises(StateError, match="closed"):
        state.keys()
    with open_state(built) as again:
        pass
    assert again.closed


def test_what_is_not_a_state_is_refused_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "ratchet.db").write_bytes(b"not a database at all" * 100)
    other = tmp_path / "other"
    other.mkdir()
    conn = sqlite3.connect(other / "ratchet.db")
    conn.execute("CREATE TABLE t(x)")
    conn.commit()
    conn.close()
    for path in (missing, a_file, empty, garbage, other):
        with pytest.raises(StateError) as info:
            open_state(path)
        assert str(path) in str(info.value), info.value
    assert not missing.exists()  # nothing was created


def test_a_state_is_also_read_through_the_package(built: Path) -> None:
    # `ratchet.open_state` once it is exported; the module's name otherwise.
    opener = getattr(ratchet, "open_state", open_state)
    with opener(built) as state:
        assert state.keys() == open_state(built).keys()


# -- a running job -------------------------------------------------------------------------------

LIVE_AGENT = """
import dataclasses
import ratchet
from ratchet import Agent, InputEvent, OutputEvent, action


@ratchet.register_type
@dataclasses.dataclass
class Seen:
    last: int


class Counter(Agent):
    @action(InputEvent)
    def count(self, event, ctx):
        mem = ctx.short_term_memory
        mem.set("n", mem.get("n", 0) + 1)
        mem.set("seen", Seen(last=event.input["i"]))
        ctx.send_event(OutputEvent(output=event.input["i"]))
"""


def _append(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_reading_while_a_job_runs_follows_it_and_leaves_it_alone(tmp_path: Path) -> None:
    agent = tmp_path / "live_agent.py"
    agent.write_text(LIVE_AGENT)
    inp, out, state, err = (tmp_path / x for x in ("in.jsonl", "out.jsonl", "state", "err"))
    inp.write_text("")
    keys, total = 4, 400
    rows = [{"key": f"k{i % keys}", "i": i} for i in range(total)]
    with err.open("wb") as errfh:
        job = subprocess.Popen(
            [*RATCHET, "run", f"{agent}:Counter", "--input", str(inp), "--output", str(out),
             "--state", str(state), "--follow", "--checkpoint-interval", "10"],
            stdout=subprocess.DEVNULL, stderr=errfh,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (state / "ratchet.db").exists():
            assert job.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.01)
        time.sleep(0.2)  # the first checkpoint
        reads = 0
        seen_counts: list[int] = []
        with open_state(state) as held:  # one reader held open across the job's checkpoints
            for start in range(0, total, 20):
                _append(inp, rows[start : start + 20])
                with open_state(state) as fresh:  # and readers opened and closed meanwhile
                    summary = fresh.summary()
                    assert summary["agent"].endswith("Counter")
                    for key in fresh.keys():
                        mem = fresh.memory(key)
                        assert mem is not None and mem["n"] >= 1
                        assert mem["seen"]["$unregistered"].endswith("Seen")
                    fresh.runs_in_flight()
                    fresh.waiting()
                    fresh.dead_letters()
                    fresh.checkpoints()
                seen_counts.append(held.summary()["checkpoints"]["counts"]["completed"])
                reads += 1
                assert job.poll() is None, err.read_text()
                time.sleep(0.01)

            deadline = time.monotonic() + 60
            while len(_lines(out)) < total:
                assert job.poll() is None, err.read_text()
                assert time.monotonic() < deadline, f"{len(_lines(out))} outputs: {err.read_text()}"
                held.summary()
                time.sleep(0.02)

            def settled() -> bool:
                s = held.summary()
                return bool(
                    s["in_flight_runs"] == 0
                    and s["queued_inputs"] == 0
                    and sum((held.memory(f"k{k}") or {}).get("n", 0) for k in range(keys)) == total
                )

            deadline = time.monotonic() + 60
            while not settled():
                assert time.monotonic() < deadline, held.summary()
                time.sleep(0.02)
            # The held reader saw the job progress: each call is a new snapshot.
            assert seen_counts[-1] > seen_counts[0], seen_counts
            assert held.summary()["checkpoints"]["counts"]["completed"] > seen_counts[-1]
        assert reads == total // 20
        assert job.poll() is None, "the job stopped while it was read"
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
        job.wait(timeout=60)
    assert job.returncode == 0, err.read_text()
    outputs = _lines(out)
    assert sorted(o["output"] for o in outputs) == list(range(total))
    assert len({o["id"] for o in outputs}) == total
    with open_state(state) as after:
        assert after.keys() == [f"k{k}" for k in range(keys)]
        for k in range(keys):
            mem = after.memory(f"k{k}", as_json=True)
            assert mem is not None and mem["n"] == total // keys
            assert mem == cli_json("inspect", "--state", state, "--key", f"k{k}")[f"k{k}"]
            assert mem["seen"] == {
                "$unregistered": mem["seen"]["$unregistered"],
                "$state": {"last": max(i for i in range(total) if i % keys == k)},
            }


def test_a_state_dir_whose_name_has_uri_characters_is_read_right(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    odd = tmp_path / "a#b?c%d" / "state"
    shutil.copytree(built, odd)
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with open_state(built) as plain, open_state(odd) as state:
        assert state.keys() == plain.keys()
        assert state.memory("alice") == plain.memory("alice")
        assert state.dead_letters() == plain.dead_letters()
        got = state.checkpoints()
        assert got["checkpoints"] == plain.checkpoints()["checkpoints"]
        assert got["state_dir"] == str(odd.resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no stray database made


def test_the_examples_in_docs_api_md_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import re

    doc = Path(__file__).resolve().parents[2] / "docs" / "api.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert len(blocks) >= 10
    monkeypatch.setattr(ratchet, "open_state", open_state, raising=False)
    monkeypatch.chdir(tmp_path)
    ratchet.run(Desk(), inputs=INPUTS, output="out.jsonl", state_dir="state")
    namespace: dict[str, Any] = {"__name__": "docs_api"}
    for block in blocks:
        exec(compile(block, str(doc), "exec"), namespace)
    shown = capsys.readouterr().out
    # What a `print(...)  # comment` line says it prints, it prints.
    said = re.findall(r"^\s*print\(.*\)\s+# (.*)$", "\n".join(blocks), re.M)
    assert len(said) >= 6, said
    for comment in said:
        assert comment in shown, comment


def test_damaged_rows_are_a_state_error_naming_the_database(built: Path, tmp_path: Path) -> None:
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(built, damaged)
    conn = sqlite3.connect(damaged / "ratchet.db")
    conn.execute("UPDATE traces SET trace = x'c1c1c1' WHERE key_text = 'alice'")
    conn.execute("UPDATE keys SET memory = x'c1c1c1' WHERE key_text = 'alice'")
    conn.commit()
    conn.close()
    with open_state(damaged) as state:
        for read in (lambda: state.traces("alice"), lambda: state.memory("alice")):
            with pytest.raises(StateError) as info:
                read()
            assert str(damaged / "ratchet.db") in str(info.value), info.value
        assert state.keys() == ["alice", "bob"]  # the rest reads as before
