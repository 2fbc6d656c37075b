"""The integer key 1 and the string key "1" are two keys for `ratchet redrive --key`, `ratchet
dead-letters` and `ratchet fork --key`, as for `signal` and `trace` (--key-type); and a key the
state does not hold is a usage error (exit 2) for `trace`, `inspect` and `fork`. Real `ratchet`
processes on real states, one worker and two, and REST on a supervised job (docs/runtime.md,
"Dead letters")."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.kill

AGENT = f"{Path(__file__).with_name('deadletter_agent.py')}:Payments"
RATCHET = [sys.executable, "-m", "ratchet.cli"]
# Two poison inputs, of the integer key 1 and of the string key "1": two dead letters whose
# keys read alike; the string key "2" runs fine.
BOTH = [
    {"key": 1, "n": 1, "poison": True},
    {"key": "1", "n": 2, "poison": True},
    {"key": "2", "n": 3},
]


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RATCHET, *args], capture_output=True, text=True, env=env, timeout=120)


def job(tmp: Path, rows: list[dict[str, Any]], *extra: str) -> tuple[Path, dict[str, str]]:
    """A stopped job whose poison inputs are dead letters (the run exits 4)."""
    env = dict(os.environ, FIXED_FLAG=str(tmp / "fixed"), CHARGES=str(tmp / "charges.txt"))
    (tmp / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    state = tmp / "state"
    ran = cli(
        env, "run", AGENT, "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl"),
        "--state", str(state), *extra,
    )  # fmt: skip
    assert ran.returncode == 4, ran.stderr
    return state, env


def letters(state: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    shown = cli(env, "dead-letters", "--state", str(state), "--json")
    assert shown.returncode == 0, shown.stderr
    return list(json.loads(shown.stdout))


def asked(state: Path, env: dict[str, str]) -> list[tuple[str, str | None]]:
    """The dead letters marked for redrive: (key text, key type)."""
    return sorted(
        (d["key"], d.get("key_type")) for d in letters(state, env) if d["redrive_requested"]
    )


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-worker", "two-workers"])
def test_redrive_marks_the_dead_letters_of_the_key_of_the_type_asked(
    tmp_path: Path, workers: str
) -> None:
    state, env = job(tmp_path, BOTH, "--workers", workers)
    # By the text alone both were marked: the integer key's and the string key's.
    both = cli(env, "redrive", "--state", str(state), "--key", "1")
    assert both.returncode == 2, (both.returncode, both.stdout)
    assert "holds both the string key '1' and the integer key 1" in both.stderr
    assert "--key-type" in both.stderr and "Traceback" not in both.stderr
    assert asked(state, env) == []
    shown = letters(state, env)
    assert sorted((d["key"], d.get("key_type")) for d in shown) == [("1", "int"), ("1", "str")]
    one = cli(env, "redrive", "--state", str(state), "--key", "1", "--key-type", "int", "--json")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["marked"] == 1
    assert asked(state, env) == [("1", "int")]
    other = cli(env, "redrive", "--state", str(state), "--key", "1", "--key-type", "str", "--json")
    assert json.loads(other.stdout)["marked"] == 1
    assert asked(state, env) == [("1", "int"), ("1", "str")]
    not_int = cli(env, "redrive", "--state", str(state), "--key", "a", "--key-type", "int")
    assert not_int.returncode == 2 and "key 'a' is not an integer" in not_int.stderr


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-worker", "two-workers"])
def test_redrive_of_a_text_the_state_holds_once_needs_no_type_and_is_admitted(
    tmp_path: Path, workers: str
) -> None:
    state, env = job(tmp_path, [{"key": 7, "n": 1, "poison": True}], "--workers", workers)
    wrong = cli(env, "redrive", "--state", str(state), "--key", "7", "--key-type", "str", "--json")
    assert wrong.returncode == 0 and json.loads(wrong.stdout)["marked"] == 0
    done = cli(env, "redrive", "--state", str(state), "--key", "7", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["marked"] == 1, done.stderr
    (tmp_path / "fixed").touch()
    again = cli(
        env, "run", AGENT, "--input", str(tmp_path / "in.jsonl"),
        "--output", str(tmp_path / "out.jsonl"), "--state", str(state), "--workers", workers,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert [d["redriven_as"] is not None for d in letters(state, env)] == [True]
    assert (tmp_path / "charges.txt").read_text().split() == ["1"]


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-worker", "two-workers"])
def test_redrive_of_a_key_without_dead_letters_waiting_says_so(
    tmp_path: Path, workers: str
) -> None:
    """It printed "0 dead letter(s) marked for redrive ..." and nothing of why. Exit 0, as
    docs/runtime.md says: nothing is wrong, and a redrive run again must not fail."""
    state, env = job(tmp_path, BOTH, "--workers", workers)
    lists = f"(`ratchet dead-letters --state {state}` lists them)"
    none = cli(env, "redrive", "--state", str(state), "--key", "2")
    assert none.returncode == 0 and "Traceback" not in none.stderr, none.stderr
    assert none.stdout.strip() == (
        f"key '2' has no dead letters in {state}: nothing marked; dead letters wait for a "
        f"redrive for 2 key(s): 1, '1' {lists}"
    )
    marked = cli(env, "redrive", "--state", str(state), "--key", "1", "--key-type", "int")
    assert marked.returncode == 0 and marked.stdout.startswith("1 dead letter(s) marked")
    again = cli(env, "redrive", "--state", str(state), "--key", "1", "--key-type", "int")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == (
        f"the int key '1' has no dead letter waiting for a redrive in {state}: its 1 dead "
        f"letter(s) were redriven or asked for already; nothing marked"
    )
    typo = cli(env, "redrive", "--state", str(state), "--key", "nokey")
    assert typo.returncode == 0, typo.stderr
    assert f"key 'nokey' has no dead letters in {state}" in typo.stdout
    assert f"dead letters wait for a redrive for 1 key(s): '1' {lists}" in typo.stdout
    # --json says it as it did: what was marked.
    quiet = cli(env, "redrive", "--state", str(state), "--key", "2", "--json")
    assert json.loads(quiet.stdout)["marked"] == 0 and quiet.returncode == 0


def test_the_dead_letters_table_shows_each_key_type(tmp_path: Path) -> None:
    state, env = job(tmp_path, BOTH)
    table = cli(env, "dead-letters", "--state", str(state))
    assert table.returncode == 0, table.stderr
    assert "key type" in table.stdout
    rows = [line for line in table.stdout.splitlines() if "failed-run" in line]
    assert len(rows) == 2 and any(" int " in r for r in rows) and any(" str " in r for r in rows)


def test_fork_copies_the_key_of_the_type_asked(tmp_path: Path) -> None:
    state, env = job(tmp_path, BOTH)
    both = cli(env, "fork", "--state", str(state), "--to", str(tmp_path / "f0"), "--key", "1")
    assert both.returncode == 2, (both.returncode, both.stdout)
    assert "holds both the string key '1' and the integer key 1" in both.stderr
    assert "--key-type" in both.stderr and not (tmp_path / "f0").exists()
    made = cli(
        env, "fork", "--state", str(state), "--to", str(tmp_path / "f1"), "--key", "1",
        "--key-type", "int", "--json",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    forked = letters(tmp_path / "f1", env)
    # By the text alone both keys' dead letters came along.
    assert [(d["key"], d.get("key_type")) for d in forked] == [("1", "int")]
    as_str = cli(
        env, "fork", "--state", str(state), "--to", str(tmp_path / "f2"), "--key", "1",
        "--key-type", "str",
    )  # fmt: skip
    assert as_str.returncode == 0, as_str.stderr
    assert [(d["key"], d.get("key_type")) for d in letters(tmp_path / "f2", env)] == [("1", "str")]


def test_fork_of_a_key_the_state_does_not_hold_counts_its_keys_by_type(tmp_path: Path) -> None:
    state, env = job(tmp_path, BOTH)
    got = cli(env, "fork", "--state", str(state), "--to", str(tmp_path / "f"), "--key", "nokey")
    assert got.returncode == 2, (got.returncode, got.stdout)
    # It said "it holds 2 key(s): '1', '2'": the two keys of the text "1" counted as one.
    assert "it holds 3 key(s): 1, '1', '2'" in got.stderr, got.stderr
    assert f"ratchet inspect --state {state}" in got.stderr
    assert len(got.stderr.strip().splitlines()) == 1 and "Traceback" not in got.stderr


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-worker", "two-workers"])
@pytest.mark.parametrize("command", ["trace", "inspect"])
def test_a_key_the_state_does_not_hold_is_a_usage_error(
    tmp_path: Path, workers: str, command: str
) -> None:
    state, env = job(tmp_path, BOTH, "--workers", workers)
    got = cli(env, command, "--state", str(state), "--key", "nokey")
    # Exit 1 is "the work ran and failed"; asking for a key that is not there is a usage error.
    assert got.returncode == 2, (got.returncode, got.stderr)
    assert "'nokey'" in got.stderr and f"ratchet inspect --state {state}" in got.stderr
    assert len(got.stderr.strip().splitlines()) == 1 and "Traceback" not in got.stderr


def post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(
            "POST", "/v1/dead-letters/redrive", body=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_rest_redrive_takes_the_key_type(tmp_path: Path) -> None:
    pytest.importorskip("fastapi", reason="the REST API needs ratchet[server] (fastapi, uvicorn)")
    state, env = job(tmp_path, BOTH)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    sup = subprocess.Popen(
        [*RATCHET, "run", AGENT, "--input", str(tmp_path / "in.jsonl"),
         "--output", str(tmp_path / "out.jsonl"), "--state", str(state), "--follow",
         "--supervise", "--rest-port", str(port), "--allow-errors"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                code, body = post(port, {"key": "1"})
                break
            except OSError:
                assert time.monotonic() < deadline and sup.poll() is None
                time.sleep(0.1)
        # By the text alone both keys' dead letters were marked.
        assert code == 400 and "holds both the string key '1'" in body["detail"], body
        code, body = post(port, {"key": "1", "key_type": "str"})
        assert code == 202 and body["marked"] == 1, body
        assert asked(state, env) == [("1", "str")]
        # No integer key has the text "a": not found, as the key endpoints answer it (a 400
        # refused a request its OpenAPI document says is valid).
        code, body = post(port, {"key": "a", "key_type": "int"})
        assert code == 404 and "no integer key has that text" in body["detail"], body
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.communicate(timeout=60)
