"""HTTP ingestion (`--input http://HOST:PORT`): answers, limits, idempotency, the inbox."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from connector_servers import AGENT, RATCHET, free_port, post

from ratchet._errors import ConfigError, StateError
from ratchet.connectors import source_for
from ratchet.connectors._http import INBOX_FILE, TOKEN_ENV, HttpSource
from ratchet.runtime._io import JobIdentity, Record


def opened(tmp: Path, **kw: Any) -> HttpSource:
    src = HttpSource("127.0.0.1", free_port(), **kw)
    src.open(JobIdentity("job1", tmp), checkpoint_interval=0.2)
    src.restore({})
    return src


@pytest.fixture
def source(tmp_path: Path) -> Iterator[HttpSource]:
    src = opened(tmp_path, max_pending=5)
    yield src
    src.close()


def url(src: HttpSource) -> str:
    return f"http://127.0.0.1:{src.port}"


def send(src: HttpSource, body: Any, **headers: str) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = post(url(src), raw, {k.replace("_", "-"): v for k, v in headers.items()})
    assert answer is not None
    return answer


def drain(src: HttpSource) -> list[Record]:
    out = []
    while (rec := src.next_record()) is not None:
        out.append(rec)
    return out


def test_one_object_or_an_array_is_admitted_and_read_in_order(source: HttpSource) -> None:
    assert send(source, {"key": "a", "n": 1}) == (
        202,
        {"accepted": 1, "first": 1, "duplicate": False},
    )
    assert send(source, [{"key": "b", "n": 2}, {"key": 7, "n": 3}])[1]["first"] == 2
    recs = drain(source)
    assert [(r.line, r.key, r.value["n"]) for r in recs] == [(1, "a", 1), (2, "b", 2), (3, 7, 3)]
    assert source.position() == {"inbox": 3}


def test_a_202_means_the_events_are_committed_to_the_inbox(
    source: HttpSource, tmp_path: Path
) -> None:
    send(source, [{"key": "a"}, {"key": "b"}])
    # Another connection (as a restarted process would open it) sees both rows.
    with sqlite3.connect(tmp_path / INBOX_FILE) as db:
        assert db.execute("SELECT count(*) FROM inbox").fetchone() == (2,)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b'{"key": "a"', "the body is not JSON: Expecting ',' delimiter at line 1 column 12"),
        (b"[]", "the body is an empty array"),
        (b"3", "the body is a JSON int; send an object or an array of them"),
        (b'{"n": 1}', "the event: missing key field 'key'"),
        (b'[{"key": "a"}, {"key": [1]}]', "event 1: key field 'key' is list"),
        (b'[{"key": "a"}, 5]', "event 1: expected a JSON object, got int"),
        (b"\xff", "the body is not UTF-8"),
        (b"\xff\xfe", "the body is not UTF-8"),
        ('{"key": "a"}'.encode("utf-16"), "the body is not UTF-8"),  # with its BOM
        ('{"key": "a"}'.encode("utf-32"), "the body is not UTF-8"),
        (b'[{"key": "a"}, {"key": null}]', "event 1: key field 'key' is null (NULL)"),
        (b"[" * 100_000 + b"]" * 100_000, "the body is not JSON: arrays or objects nested"),
        (b'{"key": "a", "v": ' + b"[" * 97 + b"]" * 97 + b"}", "the event: the input nests more"),
        (b'{"key": "a", "v": ' + b"1" * 5000 + b"}", "the body is not JSON: Exceeds the limit"),
        (b'{"key": "a", "v": NaN}', "the body is not JSON: NaN is not JSON"),
        (b'[{"key": "a", "v": -Infinity}]', "the body is not JSON: -Infinity is not JSON"),
    ],
)
def test_a_malformed_body_gets_400_naming_the_problem_and_admits_nothing(
    source: HttpSource, body: bytes, problem: str
) -> None:
    status, answer = send(source, body)
    assert status == 400
    assert problem in answer["error"]
    assert drain(source) == []


def test_an_idempotency_key_makes_a_retry_harmless(source: HttpSource) -> None:
    first = send(source, [{"key": "a"}, {"key": "b"}], Idempotency_Key="order-17")
    again = send(source, [{"key": "a"}, {"key": "b"}], Idempotency_Key="order-17")
    assert first == (202, {"accepted": 2, "first": 1, "duplicate": False})
    assert again == (202, {"accepted": 2, "first": 1, "duplicate": True})
    assert len(drain(source)) == 2
    status, answer = send(source, {"key": "c"}, Idempotency_Key="order-17")
    assert status == 422
    assert "Idempotency-Key 'order-17' was used for a request with another body" in answer["error"]


def test_a_full_inbox_answers_429_with_retry_after(source: HttpSource) -> None:
    assert send(source, [{"key": i} for i in range(5)])[0] == 202
    req_url = url(source) + "/v1/events"
    import urllib.error
    import urllib.request

    req = urllib.request.Request(req_url, data=b'{"key": 9}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 429
    assert err.value.headers["Retry-After"] == "1"
    assert "holds 5 events not yet read" in json.loads(err.value.read())["error"]
    drain(source)  # the job reads them: there is room again
    assert send(source, {"key": 9})[0] == 202


def test_acknowledged_rows_are_pruned_and_their_idempotency_keys_kept(
    source: HttpSource, tmp_path: Path
) -> None:
    send(source, [{"key": "a"}, {"key": "b"}], Idempotency_Key="k1")
    send(source, {"key": "c"})
    drain(source)
    source.acknowledge({"inbox": 2})
    deadline = time.monotonic() + 30
    with sqlite3.connect(tmp_path / INBOX_FILE) as db:
        while db.execute("SELECT min(id) FROM inbox").fetchone() != (3,):
            assert time.monotonic() < deadline, "rows 1-2 were not pruned"
            time.sleep(0.01)
    assert send(source, [{"key": "a"}, {"key": "b"}], Idempotency_Key="k1")[1]["duplicate"]


def test_other_requests_get_a_clear_answer(source: HttpSource) -> None:
    status, answer = post(url(source) + "/v2", b"{}", {}) or (0, None)
    assert status == 404 and "POST events to /v1/events" in answer["error"]
    small = opened(source_dir(source), max_body=16)
    try:
        status, answer = send(small, b'{"key": "a", "pad": "xxxxxxxx"}')
        assert status == 413 and "the body has 31 bytes; the limit is 16" in answer["error"]
    finally:
        small.close()


def source_dir(src: HttpSource) -> Path:
    assert src._inbox is not None
    other = src._inbox.path.parent / "other"
    other.mkdir(exist_ok=True)
    return other


def test_restore_checks_the_inbox_and_the_kind_of_position(tmp_path: Path) -> None:
    src = opened(tmp_path)
    try:
        with pytest.raises(
            StateError, match=r"read the HTTP inbox up to row 10, but .* ends at row 0"
        ):
            src.restore({"inbox": 10})
        with pytest.raises(ConfigError, match="not from an HTTP ingestion endpoint"):
            src.restore({"offset": 0, "path": "in.jsonl"})
    finally:
        src.close()


def test_a_token_is_required_off_loopback_and_checked_when_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(
        ConfigError, match=f"needs a token; set the environment variable {TOKEN_ENV}"
    ):
        source_for("http://0.0.0.0:8090", key="key", follow=False)
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    src = opened(tmp_path)
    try:
        assert send(src, {"key": "a"})[0] == 401
        assert send(src, {"key": "a"}, Authorization="Bearer wrong")[0] == 401
        assert send(src, {"key": "a"}, Authorization="Bearer s3cret")[0] == 202
    finally:
        src.close()


def test_a_port_in_use_is_a_config_error(tmp_path: Path) -> None:
    first = opened(tmp_path)
    try:
        second = HttpSource("127.0.0.1", first.port)
        with pytest.raises(ConfigError, match=f"http://127.0.0.1:{first.port} cannot listen"):
            second.open(JobIdentity("job1", tmp_path / "other"), checkpoint_interval=0.2)
    finally:
        first.close()


@pytest.mark.kill
def test_an_event_answered_202_survives_a_sigkill_right_after(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "out.jsonl"

    def start(interval: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*RATCHET, "run", AGENT, "--input", f"http://127.0.0.1:{port}", "--output", str(out),
             "--state", str(tmp_path / "state"), "--checkpoint-interval", interval],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    proc = start("60000")  # no checkpoint before the kill
    try:
        while (answer := post(f"http://127.0.0.1:{port}", b'{"key": "a", "i": 0}', {})) is None:
            assert proc.poll() is None
            time.sleep(0.01)
        assert answer[0] == 202
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not out.exists() or out.read_text() == ""
        proc = start("20")
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text().count("\n") == 1):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        assert json.loads(out.read_text())["output"] == {"i": 0, "n": 1}
    finally:
        proc.kill()
        proc.wait()


def test_a_state_fed_by_http_refuses_another_input_and_the_other_way_round(
    tmp_path: Path,
) -> None:
    port = free_port()
    out, state = tmp_path / "out.jsonl", tmp_path / "state"
    src = tmp_path / "in.jsonl"
    src.write_text('{"key": "a", "i": 0}\n')

    job = subprocess.Popen(
        [*RATCHET, "run", AGENT, "--input", f"http://127.0.0.1:{port}", "--output", str(out),
         "--state", str(state), "--checkpoint-interval", "20"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while post(f"http://127.0.0.1:{port}", b'{"key": "a", "i": 0}', {}) is None:
            assert job.poll() is None
            time.sleep(0.01)
        while not (out.exists() and out.read_text().endswith("\n")):
            assert job.poll() is None
            time.sleep(0.01)
    finally:
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=60)
    refused = subprocess.run(
        [*RATCHET, "run", AGENT, "--input", str(src), "--output", str(out), "--state", str(state)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert (
        "this state directory read its inputs from an HTTP ingestion endpoint (--input "
        f"http://...), not from the file {src}" in refused.stderr
    )
    other = tmp_path / "other"
    done = subprocess.run(
        [*RATCHET, "run", AGENT, "--input", str(src), "--output", str(tmp_path / "o2.jsonl"),
         "--state", str(other)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    back = subprocess.run(
        [*RATCHET, "run", AGENT, "--input", f"http://127.0.0.1:{port}", "--output",
         str(tmp_path / "o2.jsonl"), "--state", str(other)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert back.returncode == 2 and "Traceback" not in back.stderr
    assert (
        f"read its inputs from the file {src}, not from an HTTP ingestion endpoint" in back.stderr
    )
