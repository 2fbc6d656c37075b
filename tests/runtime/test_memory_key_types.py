"""The integer key 1 and the string key "1" are two keys, each with its own memory: `ratchet
inspect --key 1` showed both memories as the one key asked for, `GET /v1/keys/1/memory` gave
the string key's without a word, and /v1/keys listed the text twice with nothing to tell the
two apart (the dashboard's key view then answered 400). Real `ratchet run` and `ratchet
inspect` processes on a SQLite state, one worker and two (the two keys of the text "3" live
in two shards)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import ratchet
from ratchet.runtime._shards import shard_of
from support.key_types import TAG_AGENT, cli

# n is even for the string keys, odd for the integer keys; 7 is an integer key alone.
LINES = [("1", 0), (1, 1), ("3", 2), (3, 3), (7, 5)]


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-worker", "two-workers"])
def state(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("memory-key-types")
    (tmp / "agent.py").write_text(TAG_AGENT)
    (tmp / "in.jsonl").write_text("".join(json.dumps({"key": k, "n": n}) + "\n" for k, n in LINES))
    done = cli("run", f"{tmp / 'agent.py'}:Tag", "--input", str(tmp / "in.jsonl"),
               "--output", str(tmp / "out.jsonl"), "--state", str(tmp / "st"),
               "--workers", request.param)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return tmp / "st"


def test_the_two_keys_of_3_live_in_two_shards() -> None:
    assert shard_of("3", 2) != shard_of(3, 2)  # what the two-worker state covers


def inspected(state: Path, *argv: str) -> dict[str, Any]:
    got = cli("inspect", "--state", str(state), "--json", *argv)
    assert got.returncode == 0, got.stderr
    shown: dict[str, Any] = json.loads(got.stdout)
    return shown


def refused(state: Path, *argv: str) -> str:
    got = cli("inspect", "--state", str(state), *argv)
    assert got.returncode == 2, (got.returncode, got.stdout, got.stderr)
    assert "Traceback" not in got.stderr and not got.stdout, got.stdout
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ratchet: error: "), got.stderr
    return lines[0]


@pytest.mark.parametrize("text", ["1", "3"])
def test_inspect_shows_the_memory_of_the_key_of_the_type_asked(state: Path, text: str) -> None:
    n = int(text) - 1  # the string key's; the integer key's is n + 1
    # Each labelled as the whole list labels it: the integer key says its type.
    assert inspected(state, "--key", text, "--key-type", "str") == {text: {"n": n}}
    assert inspected(state, "--key", text, "--key-type", "int") == {f"{text} (int)": {"n": n + 1}}
    assert inspected(state)[f"{text} (int)"] == {"n": n + 1}


@pytest.mark.parametrize("text", ["1", "3"])
def test_inspect_refuses_a_key_whose_text_the_state_holds_twice(state: Path, text: str) -> None:
    # It showed both memories, as the one key asked for.
    line = refused(state, "--key", text)
    assert f"holds both the string key {text!r} and the integer key {text}" in line, line
    assert "--key-type str or --key-type int" in line, line
    assert "Traceback" not in refused(state, "--key", text, "--json")


def test_inspect_of_a_text_the_state_holds_once_needs_no_type(state: Path) -> None:
    assert inspected(state, "--key", "7") == {"7": {"n": 5}}
    assert inspected(state, "--key", "7", "--key-type", "int") == {"7": {"n": 5}}
    line = refused(state, "--key", "7", "--key-type", "str")
    assert "no committed memory for the str key '7'" in line, line
    assert "key 'x' is not an integer (--key-type int)" in refused(
        state, "--key", "x", "--key-type", "int"
    )
    line = refused(state, "--key-type", "int")
    assert "--key-type int says which key --key is: give --key KEY" in line, line


def test_the_python_api_reads_the_memory_of_one_key(state: Path) -> None:
    with ratchet.open_state(state) as st:
        for text in ("1", "3"):
            n = int(text) - 1
            # A key's own type says which (with two workers memory(3) found the string key's
            # memory when its shard was read first).
            assert (st.memory(text), st.memory(int(text))) == ({"n": n}, {"n": n + 1})
            assert st.memory(text, key_type="int") == {"n": n + 1}
            assert st.memory(int(text), key_type="str") == {"n": n}
            with pytest.raises(ratchet.InvalidArgumentError, match="key_type='str'"):
                st.memory(text, key_type="auto")
        assert st.memory("7", key_type="auto") == st.memory("7") == {"n": 5}
        assert st.memory("7", key_type="str") is None
        assert st.memory_fields("3", key_type="int") == [{"path": "n", "type": "int", "value": 3}]


def test_rest_lists_each_keys_type_and_reads_the_memory_of_one(state: Path) -> None:
    from fastapi.testclient import TestClient

    from ratchet.runtime._rest import create_app

    app = create_app(
        lambda: {}, lambda *a: {}, lambda *a: {}, open_state=lambda: ratchet.open_state(state)
    )
    client = TestClient(app)
    assert client.get("/v1/keys").json() == {
        "total": 5,
        "keys": ["1", "1", "3", "3", "7"],
        "key_types": ["int", "str", "int", "str", "int"],
    }
    assert client.get("/v1/keys?contains=3&limit=1").json() == {
        "total": 2, "keys": ["3"], "key_types": ["int"],
    }  # fmt: skip
    for text in ("1", "3"):
        n = int(text) - 1
        ambiguous = client.get(f"/v1/keys/{text}/memory")  # it gave the string key's
        assert ambiguous.status_code == 400, ambiguous.text
        assert "?key_type=str or int" in ambiguous.json()["detail"]
        got = client.get(f"/v1/keys/{text}/memory?key_type=int").json()
        assert (got["memory"], got["fields"][0]["value"]) == ({"n": n + 1}, n + 1)
        assert client.get(f"/v1/keys/{text}/memory?key_type=str").json()["memory"] == {"n": n}
    assert client.get("/v1/keys/7/memory").json()["memory"] == {"n": 5}
    missing = client.get("/v1/keys/7/memory?key_type=str")
    assert missing.status_code == 404 and "str key '7'" in missing.json()["detail"]
    assert client.get("/v1/keys/x/memory?key_type=int").status_code == 404
    assert client.get("/v1/keys/nobody/memory").status_code == 404
