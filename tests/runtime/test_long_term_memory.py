"""Long-term memory (`ctx.long_term_memory`): adds, searches, gets and deletes, per key and
shared; durable with the run, answered from the journal on replay, exactly once across SIGKILL.

The agents are in tests/runtime/ltm_support/ltm_agent.py. In-process runs use real SQLite
state directories; the kill test runs `ratchet run` subprocesses and SIGKILLs them at seeded
points (the seed is printed on failure).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import ratchet
from ratchet import ConfigError

pytest.importorskip("numpy", reason="long-term memory needs numpy (the memory extra)")

sys.path.insert(0, str(Path(__file__).parent / "ltm_support"))
import ltm_agent  # noqa: E402

AGENT = Path(__file__).parent / "ltm_support" / "ltm_agent.py"


_STREAMS: dict[Path, list[dict[str, Any]]] = {}


def run(tmp: Path, inputs: list[dict[str, Any]], agent: Any = None) -> list[dict[str, Any]]:
    """Append `inputs` to the job's input stream and run it (the state resumes where it was);
    the outputs of this call."""
    stream = _STREAMS.setdefault(tmp, [])
    stream.extend(inputs)
    out = tmp / "out.jsonl"
    start = len(out.read_text().splitlines()) if out.exists() else 0
    ratchet.run(
        agent or ltm_agent.Notebook(),
        inputs=list(stream),
        output=out,
        state_dir=tmp / "state",
        append_output=True,
    )
    return [json.loads(x).get("output") for x in out.read_text().splitlines()[start:]]


def rows(tmp: Path) -> list[tuple[str, str, str]]:
    conn = sqlite3.connect(tmp / "state" / "ratchet.db")
    try:
        return conn.execute("SELECT scope, id, text FROM ltm ORDER BY scope, text").fetchall()
    finally:
        conn.close()


NOTES = [
    {"key": "ann", "n": 1, "note": "the cat sat on the mat", "tag": "pets"},
    {"key": "ann", "n": 2, "note": "dogs chase the cat", "tag": "pets"},
    {"key": "ann", "n": 3, "note": "stock prices fell sharply", "tag": "money"},
    {"key": "bob", "n": 4, "note": "the cat is bob's", "tag": "pets"},
]


def test_add_then_search_get_and_filters(tmp_path: Path) -> None:
    out = run(tmp_path, NOTES)
    added = [o for o in out if "added" in o]
    # A later task of the same run reads the add by id before it is committed.
    assert sorted(o["text"] for o in added) == sorted(n["note"] for n in NOTES)
    out = run(
        tmp_path,
        [
            {"key": "ann", "q": "cat on the mat", "k": 2},
            {"key": "ann", "q": "cat", "tag": "money"},
            {"key": "bob", "q": "prices"},
        ],
    )
    by_q = {(o["q"], len(o["hits"])): o for o in out}
    best = by_q[("cat on the mat", 2)]
    assert best["hits"] == ["the cat sat on the mat", "dogs chase the cat"]
    assert best["scores"] == sorted(best["scores"], reverse=True) and best["scores"][0] > 0.5
    assert best["count"] == 3  # ann's own three; bob's note is in bob's memory
    assert by_q[("cat", 1)]["hits"] == ["stock prices fell sharply"]  # the filter decides
    assert by_q[("prices", 1)]["hits"] == ["the cat is bob's"]  # bob's only memory
    assert by_q[("prices", 1)]["count"] == 1
    assert len(rows(tmp_path)) == 4


def test_a_completed_runs_adds_are_seen_by_the_next_run_before_its_checkpoint(
    tmp_path: Path,
) -> None:
    # One call: every run completes in the same process, most before any checkpoint.
    out = run(tmp_path, [*NOTES[:2], {"key": "ann", "q": "cat chase dogs", "k": 1}])
    assert out[-1]["hits"] == ["dogs chase the cat"] and out[-1]["count"] == 2


def test_delete_and_shared_memory(tmp_path: Path) -> None:
    out = run(
        tmp_path,
        [
            {"key": "ann", "n": 1, "note": "shared cat facts", "shared": True},
            {"key": "bob", "n": 2, "note": "shared dog facts", "shared": True},
        ],
    )
    ids = {o["text"]: o["added"] for o in out if "added" in o}
    out = run(tmp_path, [{"key": "carl", "q": "facts", "shared": True}])
    assert sorted(out[0]["hits"]) == ["shared cat facts", "shared dog facts"]
    cat = ids["shared cat facts"]
    out = run(tmp_path, [{"key": "carl", "forget": cat, "shared": True}])
    assert out == [{"forgot": cat, "count": 1}]
    # (Another key's run that ran beside carl's could still see the memory: a run's writes
    # reach other keys' runs when it completes.)
    out = run(tmp_path, [{"key": "dan", "q": "facts", "shared": True}])
    assert out[0]["hits"] == ["shared dog facts"]
    assert [r[2] for r in rows(tmp_path)] == ["shared dog facts"]
    assert {r[0] for r in rows(tmp_path)} == {"shared:team"}


def test_without_a_config_the_error_says_what_to_declare(tmp_path: Path) -> None:
    assert run(tmp_path, [{"key": "a"}], agent=ltm_agent.NoConfig()) == [None]  # no output:
    [record] = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert "ConfigError" in json.dumps(record["error"])  # the run's error record says why
    assert "LongTermMemoryConfig(embedding=" in json.dumps(record["error"])


def test_bad_arguments_are_refused_clearly() -> None:
    with pytest.raises(ConfigError, match="async embed"):
        ratchet.LongTermMemoryConfig(embedding=object())


def _kill_when(proc: subprocess.Popen[bytes], marks: Path, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in (marks.read_text() if marks.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None, f"{text!r} never embedded"
        time.sleep(0.02)
    time.sleep(0.3)  # the call's record is written through before the action goes on
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_returned_embeddings_and_searches_are_answered_from_the_journal(tmp_path: Path) -> None:
    """Kill a run after its add's embedding returned, and another after its search returned
    (each sleeps before finishing): the restarted job embeds neither again, and each run's
    output is written once, the search's with the answer it got before the kill."""
    marks = tmp_path / "marks"
    env = dict(os.environ, LTM_MARKS=str(marks))
    inputs = tmp_path / "in.jsonl"

    def add_input(row: dict[str, Any]) -> None:
        with inputs.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", f"{AGENT}:Notebook", "--input", str(inputs),
        "--output", str(tmp_path / "out.jsonl"), "--state", str(tmp_path / "state"),
        "--checkpoint-interval", "20",
    ]  # fmt: skip
    add_input({"key": "ann", "n": 1, "note": "the cat sat", "tag": "pets"})
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=60)
    slow = {**env, "LTM_SLOW": "30"}
    add_input({"key": "ann", "n": 2, "note": "a dog sat", "tag": "pets"})
    _kill_when(subprocess.Popen(cmd, env=slow, stderr=subprocess.DEVNULL), marks, "a dog sat")
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=60)
    add_input({"key": "ann", "q": "sat where"})
    _kill_when(subprocess.Popen(cmd, env=slow, stderr=subprocess.DEVNULL), marks, "sat where")
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=60)

    embedded = [json.loads(x)[0] for x in marks.read_text().splitlines()]
    assert embedded.count("a dog sat") == 1 and embedded.count("sat where") == 1
    out = [json.loads(x)["output"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o.get("text") for o in out[:2]] == ["the cat sat", "a dog sat"]
    assert len(out) == 3 and sorted(out[2]["hits"]) == ["a dog sat", "the cat sat"]
    assert sorted(r[2] for r in rows(tmp_path)) == ["a dog sat", "the cat sat"]


@pytest.mark.slow
@pytest.mark.kill
def test_every_add_lands_exactly_once_across_kills(tmp_path: Path) -> None:
    seed = int(os.environ.get("LTM_KILL_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    n = 60
    notes = [
        {"key": f"k{i % 5}", "n": i, "note": f"note number {i} about topic {i % 7}",
         "shared": i % 3 == 0}
        for i in range(n)
    ]  # fmt: skip
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(x) + "\n" for x in notes))
    out_file = tmp_path / "out.jsonl"
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", f"{AGENT}:Notebook", "--input", str(inputs),
        "--output", str(out_file), "--state", str(tmp_path / "state"),
        "--checkpoint-interval", "30", "--max-concurrent-runs", "2",
    ]  # fmt: skip
    env = dict(os.environ, LTM_SLOW="0.1")  # about 3 s of work, killed every 0.6-1.5 s
    kills = 0
    try:
        for _ in range(6):
            proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0.6, 1.5))
            if proc.poll() is not None:
                break
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=120)
        assert kills >= 2, "the job finished before it was killed twice: make it slower"
        out = [json.loads(x)["output"] for x in out_file.read_text().splitlines()]
        texts = sorted(o["text"] for o in out)
        assert texts == sorted(x["note"] for x in notes), "every output exactly once"
        stored = rows(tmp_path)
        assert sorted(r[2] for r in stored) == texts, "every add stored exactly once"
        assert len({r[1] for r in stored}) == n
        assert {o["added"] for o in out} == {r[1] for r in stored}  # the ids the runs saw
        shared = sum(1 for r in stored if r[0] == "shared:team")
        assert shared == sum(1 for x in notes if x["shared"])
    except AssertionError as exc:
        raise AssertionError(f"{exc} (seed {seed}, {kills} kills; LTM_KILL_SEED={seed})") from exc


def _errors(tmp: Path) -> list[str]:
    out = [json.loads(x) for x in (tmp / "out.jsonl").read_text().splitlines()]
    return [json.dumps(r["error"]) for r in out if "error" in r]


def test_an_embedding_of_another_size_is_refused_at_the_add_not_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was committed, and every later read of the scope failed (the right model's too): all
    # the key's inputs became dead letters; in one process it stopped the whole job.
    assert run(
        tmp_path, [{"key": "a", "try": "add", "text": "alpha beta"}], ltm_agent.Misuse()
    ) == [{"count": 1}]
    other = ltm_agent.Misuse()
    monkeypatch.setattr(type(other), "long_term_memory", ratchet.LongTermMemoryConfig(
        embedding=ltm_agent.SizedEmbedding(8)))  # fmt: skip
    assert run(tmp_path, [{"key": "a", "try": "add", "text": "gamma"}], other) == [None]
    assert "an embedding of 8 dimensions for long-term memory 'key:a', which holds " \
        "embeddings of 16" in _errors(tmp_path)[-1]  # fmt: skip
    monkeypatch.undo()
    # The scope still works with its own model; only the first memory is in it.
    assert run(tmp_path, [{"key": "a", "try": "add", "text": "delta"}], ltm_agent.Misuse()) == [
        {"count": 2}
    ]
    assert [r[2] for r in rows(tmp_path)] == ["alpha beta", "delta"]


def test_metadata_is_stored_and_returned_as_copies(tmp_path: Path) -> None:
    # add kept the caller's dict (a change after the add was stored), and search returned the
    # index's own dicts (a reader's change was seen by later runs, until a restart).
    run(tmp_path, [{"key": "a", "try": "mutate"}], ltm_agent.Misuse())
    assert run(tmp_path, [{"key": "a", "try": "read"}], ltm_agent.Misuse()) == [{"tag": "orig"}]


def test_a_lone_surrogate_and_a_broken_embedding_model_are_named(tmp_path: Path) -> None:
    assert run(
        tmp_path, [{"key": "a", "try": "add", "text": "hello\ud800"}], ltm_agent.Misuse()
    ) == [None]  # the run failed: its error record says why
    assert "holds '\\\\ud800' at position 5, a lone surrogate" in _errors(tmp_path)[-1]
    broken = ltm_agent.Misuse()
    type(broken).long_term_memory = ratchet.LongTermMemoryConfig(
        embedding=ltm_agent.BrokenEmbedding()
    )
    try:
        assert run(tmp_path, [{"key": "b", "try": "add", "text": "fine"}], broken) == [None]
    finally:
        type(broken).long_term_memory = ratchet.LongTermMemoryConfig(
            embedding=ltm_agent.SizedEmbedding(16)
        )
    assert "returned [['x']], not one list of numbers per text" in _errors(tmp_path)[-1]


def test_the_integer_key_1_and_the_string_key_1_have_memories_of_their_own(
    tmp_path: Path,
) -> None:
    # Both read and wrote scope `key:1`: the string key found the integer key's secret.
    out = run(
        tmp_path,
        [{"key": 1, "text": "secret of int key one"}, {"key": "1", "text": "note of str key"}],
        ltm_agent.Secrets(),
    )
    assert len(out) == 2
    found = run(tmp_path, [{"key": "1", "q": "secret note key"}, {"key": 1, "q": "secret note"}],
                ltm_agent.Secrets())  # fmt: skip
    assert sorted(map(json.dumps, found)) == sorted(
        map(json.dumps, [{"found": ["note of str key"]}, {"found": ["secret of int key one"]}])
    )
    assert sorted(r[0] for r in rows(tmp_path)) == ["key#int:1", "key:1"]


def test_a_state_from_before_gives_an_integer_keys_memories_their_own_scope(
    tmp_path: Path,
) -> None:
    # Schema 9 kept them under `key:<text>`: migration 10 moves them when no string key of
    # that text exists (where one does, the two shared a scope and stay together).
    run(tmp_path, [{"key": 7, "text": "int seven"}, {"key": 8, "text": "int eight"},
                   {"key": "8", "text": "str eight"}], ltm_agent.Secrets())  # fmt: skip
    db = tmp_path / "state" / "ratchet.db"
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE ltm SET scope = replace(scope, 'key#int:', 'key:')")
        conn.execute("PRAGMA user_version = 9")
        conn.execute("UPDATE meta SET value = ? WHERE name = 'schema_version'",
                     (ratchet.store.codec.encode(9),))  # fmt: skip
    conn.close()
    found = run(tmp_path, [{"key": 7, "q": "seven"}], ltm_agent.Secrets())
    assert found == [{"found": ["int seven"]}]
    assert sorted((r[0], r[2]) for r in rows(tmp_path)) == [
        ("key#int:7", "int seven"), ("key:8", "int eight"), ("key:8", "str eight"),
    ]  # fmt: skip
