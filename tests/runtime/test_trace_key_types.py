"""The integer key 1 and the string key "1" are two keys, and each has its own run traces:
`ratchet trace --key 1` showed the newest run of either (traces were kept by the key's text
alone), and `state.traces(1)` listed both keys' runs as one key's. Real `ratchet run`,
`ratchet trace` and `ratchet fork` processes on a SQLite state, one worker and two."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import ratchet
from ratchet.store import codec
from ratchet.store._sqlite import DB_NAME, SCHEMA_VERSION
from support.key_types import TAG_AGENT, cli

# Input seqs 0 and 2 are the string key's runs, 1 and 3 the integer key's.
BOTH = '{"key": "1", "n": 0}\n{"key": 1, "n": 1}\n{"key": "1", "n": 2}\n{"key": 1, "n": 3}\n'


def run_job(tmp: Path, lines: str, *extra: str) -> Path:
    """Run the agent over `lines` (appended to its input file) to the end; its state dir."""
    (tmp / "agent.py").write_text(TAG_AGENT)
    with (tmp / "in.jsonl").open("a") as fh:
        fh.write(lines)
    state = tmp / "st"
    done = cli("run", f"{tmp / 'agent.py'}:Tag", "--input", str(tmp / "in.jsonl"),
               "--output", str(tmp / "out.jsonl"), "--state", str(state), *extra)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return state


def shown(state: Path, *argv: str) -> dict[str, Any]:
    """What `ratchet trace --json` prints for the newest run it selects."""
    got = cli("trace", "--state", str(state), *argv, "--json")
    assert got.returncode == 0, got.stderr
    found: dict[str, Any] = json.loads(got.stdout)
    return found


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-worker", "two-workers"])
def test_ratchet_trace_shows_the_runs_of_the_key_of_the_type_asked(
    tmp_path: Path, workers: str
) -> None:
    state = run_job(tmp_path, BOTH, "--workers", workers)
    as_int = shown(state, "--key", "1", "--key-type", "int")
    assert (as_int["seq"], as_int["key_type"]) == (3, "int")
    as_str = shown(state, "--key", "1", "--key-type", "str")
    # By the text alone it was input 3, the integer key's run.
    assert (as_str["seq"], as_str["key_type"]) == (2, "str")
    assert shown(state, "--key", "1", "--key-type", "str", "--seq", "0")["seq"] == 0
    other = cli("trace", "--state", str(state), "--key", "1", "--key-type", "str", "--seq", "1")
    # Not there: a usage error (exit 2); exit 1 is work that ran and failed.
    assert other.returncode == 2 and "no trace kept for input 1 of the str key '1'" in other.stderr
    tree = cli("trace", "--state", str(state), "--key", "1", "--key-type", "int")
    assert tree.returncode == 0 and "key 1 (int) input 3" in tree.stdout, tree.stdout


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-worker", "two-workers"])
def test_a_key_whose_text_the_state_holds_twice_is_refused_until_its_type_is_given(
    tmp_path: Path, workers: str
) -> None:
    state = run_job(tmp_path, BOTH, "--workers", workers)
    got = cli("trace", "--state", str(state), "--key", "1")
    assert got.returncode == 2, (got.returncode, got.stdout)
    assert "holds both the string key '1' and the integer key 1" in got.stderr
    assert "--key-type" in got.stderr and "Traceback" not in got.stderr
    # An input seq names one run: it is that run's, whichever key it was.
    assert shown(state, "--key", "1", "--seq", "2")["key_type"] == "str"


def test_a_text_the_state_holds_once_needs_no_type(tmp_path: Path) -> None:
    state = run_job(tmp_path, '{"key": 7, "n": 0}\n{"key": "a", "n": 1}\n{"key": 7, "n": 2}\n')
    assert (shown(state, "--key", "7")["seq"], shown(state, "--key", "a")["seq"]) == (2, 1)
    nothing = cli("trace", "--state", str(state), "--key", "7", "--key-type", "str")
    assert nothing.returncode == 2 and "holds no str key '7'" in nothing.stderr
    not_int = cli("trace", "--state", str(state), "--key", "a", "--key-type", "int")
    assert not_int.returncode == 2 and "key 'a' is not an integer" in not_int.stderr


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-worker", "two-workers"])
def test_the_python_api_reads_the_traces_of_one_key(tmp_path: Path, workers: str) -> None:
    state = run_job(tmp_path, BOTH, "--workers", workers)
    with ratchet.open_state(state) as st:
        assert [t["seq"] for t in st.traces(1)] == [3, 1]  # an int is the integer key
        assert [t["seq"] for t in st.traces("1", key_type="str")] == [2, 0]
        assert [t["seq"] for t in st.traces("1", key_type="int")] == [3, 1]
        with pytest.raises(ratchet.InvalidArgumentError, match="key_type='str'"):
            st.traces("1")  # the text of both
        assert [t["seq"] for t in st.traces("1", seq=2)] == [2]
        recent = {r["seq"]: r["key_type"] for r in st.recent_runs()}
        assert recent == {0: "str", 1: "int", 2: "str", 3: "int"}


def test_rest_reads_the_traces_of_one_key(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from ratchet.runtime._rest import create_app

    state = run_job(tmp_path, BOTH)
    app = create_app(
        lambda: {}, lambda *a: {}, lambda *a: {}, open_state=lambda: ratchet.open_state(state)
    )
    client = TestClient(app)
    ambiguous = client.get("/v1/keys/1/runs")
    assert ambiguous.status_code == 400 and "key_type" in ambiguous.json()["detail"]
    runs = client.get("/v1/keys/1/runs?key_type=int").json()
    assert [(r["seq"], r["key_type"]) for r in runs] == [(3, "int"), (1, "int")]
    runs = client.get("/v1/keys/1/runs?key_type=str").json()
    assert [(r["seq"], r["key_type"]) for r in runs] == [(2, "str"), (0, "str")]
    assert client.get("/v1/keys/1/runs/2/trace").json()["key_type"] == "str"
    assert client.get("/v1/keys/1/runs/2/trace?key_type=int").status_code == 404
    assert client.get("/v1/keys/a/runs?key_type=int").status_code == 404  # no integer reads so


def _put_back_to_schema_11(state: Path) -> None:
    """The state as a ratchet of schema 11 wrote it: traces without their key's type."""
    with sqlite3.connect(state / DB_NAME) as db:
        db.execute("ALTER TABLE traces DROP COLUMN key_type")
        db.execute("UPDATE meta SET value = ? WHERE name = 'schema_version'", (codec.encode(11),))
        db.execute("PRAGMA user_version = 11")
    db.close()


def test_traces_kept_at_schema_11_are_either_keys_and_new_ones_say_which(tmp_path: Path) -> None:
    state = run_job(tmp_path, BOTH)
    _put_back_to_schema_11(state)
    with ratchet.open_state(state) as st:  # read as it is, not migrated
        assert [t["seq"] for t in st.traces("1", key_type="int")] == [3, 2, 1, 0]
        assert all("key_type" not in t for t in st.traces(1))
    # The next run migrates the state: the column comes, the traces kept before stay untyped.
    run_job(tmp_path, '{"key": "1", "n": 4}\n')
    with sqlite3.connect(state / DB_NAME) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 13
        rows = db.execute("SELECT seq, key_type FROM traces ORDER BY seq").fetchall()
    db.close()
    assert rows == [(0, None), (1, None), (2, None), (3, None), (4, "str")]
    assert shown(state, "--key", "1", "--key-type", "str")["seq"] == 4
    # An untyped trace is either key's: the integer key's newest is the one kept before.
    as_int = shown(state, "--key", "1", "--key-type", "int")
    assert as_int["seq"] == 3 and "key_type" not in as_int
    with ratchet.open_state(state) as st:
        assert [t["seq"] for t in st.traces("1", key_type="int")] == [3, 2, 1, 0]


def test_traces_move_with_their_own_key_when_the_workers_change(tmp_path: Path) -> None:
    from ratchet.runtime._shards import shard_dir, shard_of

    assert shard_of("3", 2) != shard_of(3, 2)  # the two keys of the text live apart
    state = run_job(tmp_path, '{"key": "3", "n": 0}\n{"key": 3, "n": 1}\n')
    run_job(tmp_path, '{"key": 3, "n": 2}\n', "--workers", "2")
    for key, seqs in (("3", [0]), (3, [1, 2])):
        db = shard_dir(state, shard_of(key, 2), 2) / DB_NAME
        with sqlite3.connect(db) as conn:  # each key's traces in its own key's shard
            rows = conn.execute("SELECT seq, key_type FROM traces ORDER BY seq").fetchall()
        conn.close()
        assert rows == [(s, type(key).__name__) for s in seqs], (key, rows)
    run_job(tmp_path, '{"key": "3", "n": 3}\n', "--workers", "1")
    with sqlite3.connect(state / DB_NAME) as conn:
        rows = conn.execute("SELECT seq, key_type FROM traces ORDER BY seq").fetchall()
    conn.close()
    assert rows == [(0, "str"), (1, "int"), (2, "int"), (3, "str")]
    assert shown(state, "--key", "3", "--key-type", "int")["seq"] == 2
    assert shown(state, "--key", "3", "--key-type", "str")["seq"] == 3


def test_a_fork_and_a_savepoint_keep_the_key_types(tmp_path: Path) -> None:
    state = run_job(tmp_path, BOTH)
    forked = cli(
        "fork", "--state", str(state), "--to", str(tmp_path / "fork"), "--key", "1",
        "--key-type", "str",
    )  # fmt: skip
    assert forked.returncode == 0, forked.stderr
    # The string key's traces only: the fork holds one key of the text, so none is asked.
    assert shown(tmp_path / "fork", "--key", "1")["seq"] == 2
    other = cli("trace", "--state", str(tmp_path / "fork"), "--key", "1", "--key-type", "int")
    assert other.returncode == 2 and "holds no int key '1'" in other.stderr
    saved = cli("savepoint", "--state", str(state), str(tmp_path / "sp.db"))
    assert saved.returncode == 0, saved.stderr
    with sqlite3.connect(tmp_path / "sp.db") as db:
        rows = db.execute("SELECT seq, key_type FROM traces ORDER BY seq").fetchall()
    db.close()
    assert rows == [(0, "str"), (1, "int"), (2, "str"), (3, "int")]


def test_retention_keeps_the_last_n_of_each_key_of_a_text(tmp_path: Path) -> None:
    """Cut down by the text alone, the newest run of one key took the other's place."""
    state = run_job(tmp_path, BOTH, "--trace-retention", "1")
    with ratchet.open_state(state) as st:
        assert [t["seq"] for t in st.traces("1", key_type="str")][:1] == [2]
        assert [t["seq"] for t in st.traces(1)][:1] == [3]


def test_the_in_memory_store_keeps_traces_by_key_type_too() -> None:
    from ratchet import Agent, InputEvent, OutputEvent, action
    from ratchet.store._memory import MemoryStore
    from ratchet.testing import FakeClock
    from support.fakeclock import START, Drive

    class Tag(Agent):
        @action(InputEvent)
        async def tag(self, event: InputEvent, ctx: Any) -> None:
            ctx.send_event(OutputEvent(output=None))

    store = MemoryStore(FakeClock(START))
    rows = [{"key": k} for k in ("1", 1, "1", 1)]
    Drive(Tag(), rows, store).run(trace_retention="1")
    kept = {seq: (text, kind) for (text, seq), (*_row, kind) in store.traces.items()}
    assert kept == {2: ("1", "str"), 3: ("1", "int")}
