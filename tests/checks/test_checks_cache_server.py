"""Issue 17: the HTTP cache server (`ratchet checks cache serve`) and `--cache-url`.

Every test talks to a real server process the test starts on 127.0.0.1 (with `--port 0`,
so the system picks a free port, which the server prints) and stops by its PID. Runs go
through the command line in their own processes, as CI would run them. Whether a stage
ran is read from a marker file every stage command appends to, outside every repository.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from checks_helpers import Workspace, by_id, check

from ratchet.checks.common import read_json
from ratchet.store import seal

PY = sys.executable
KEY = "k" * 32
TOKEN = "t" * 32
_BUILD = (
    "import pathlib\n"
    "pathlib.Path('out').mkdir(exist_ok=True)\n"
    "pathlib.Path('out/data.txt').write_text(pathlib.Path('src.txt').read_text().upper())\n"
)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_CHECKS_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "xdg")
    env.update(extra)
    return env


class Server:
    """A `ratchet checks cache serve` process over `directory`."""

    def __init__(self, tmp_path: Path, directory: Path, *argv: str, **env: str) -> None:
        self.directory = directory
        self.stderr_path = tmp_path / f"server-{len(list(tmp_path.glob('server-*')))}.err"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [PY, "-m", "ratchet.checks", "cache", "serve", "--dir", str(directory)]
                + ["--port", "0", *argv],
                stdout=subprocess.PIPE,
                stderr=err,
                env=_env(tmp_path, **env),
                cwd=tmp_path,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        assert line.startswith("serving cache "), self.stderr_path.read_text()
        self.url = line.split(" at ", 1)[1].split()[0]
        assert self.url.startswith("http://127.0.0.1:")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code

    def entries(self) -> list[Path]:
        return sorted((self.directory / "entries").glob("*/*.json"))

    def put(self, path: str, data: bytes, token: str | None = None) -> int:
        request = urllib.request.Request(f"{self.url}{path}", data=data, method="PUT")
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            exc.close()
            return int(exc.code)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.stop()


def _start(servers: list[Server], tmp_path: Path, *argv: str, **env: str) -> Server:
    server = Server(tmp_path, tmp_path / f"served-{len(servers)}", *argv, **env)
    servers.append(server)
    return server


def _clones(tmp_path: Path, count: int, *, clean: bool = False) -> list[Workspace]:
    """Clones of one workspace: each its own folder and state folder, one project. Every
    stage appends a line to tmp_path/marker (the same path in every clone's commands).
    With `clean`, build removes its output folder first."""
    marker = tmp_path / "marker"
    made = []
    for n in range(count):
        (tmp_path / f"clone{n}").mkdir()
        ws = Workspace(tmp_path / f"clone{n}")
        ws.repo("app", {"src.txt": "good", ".gitignore": "out/\n"})
        ws.project(
            [
                check(
                    "build",
                    f"open({str(marker)!r}, 'a').write('build\\n'); print('built')\n"
                    + ("import shutil; shutil.rmtree('out', ignore_errors=True)\n" if clean else "")
                    + _BUILD,
                    cwd="app",
                    repos=["app"],
                    outputs=["app/out"],
                ),
                check(
                    "test",
                    f"open({str(marker)!r}, 'a').write('test\\n'); print('tested')\n"
                    "assert open('app/out/data.txt').read() == 'GOOD'",
                    deps=["build"],
                    repos=["app"],
                ),
            ]
        )
        made.append(ws)
    return made


def _run(ws: Workspace, tmp_path: Path, *argv: str, **env: str) -> tuple[int, dict[str, Any], str]:
    done = subprocess.run(
        [PY, "-m", "ratchet.checks", "--workspace-root", str(ws.root)]
        + ["--state-dir", str(ws.state_dir), "run", "--json", *argv],
        capture_output=True,
        text=True,
        env=_env(tmp_path, **env),
        cwd=ws.root,
    )
    assert "Traceback" not in done.stderr, done.stderr
    result = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, result, done.stderr


def _marker(tmp_path: Path) -> list[str]:
    path = tmp_path / "marker"
    return path.read_text().splitlines() if path.exists() else []


def test_a_second_clone_reuses_a_verified_stage_through_the_server(
    tmp_path: Path, servers: list[Server]
) -> None:
    server = _start(servers, tmp_path)
    one, two, three, four = _clones(tmp_path, 4)
    code, first, err = _run(one, tmp_path, "--cache-url", server.url)
    assert (code, first["status"]) == (0, "passed"), err
    assert _marker(tmp_path) == ["build", "test"]
    assert len(server.entries()) == 2
    assert "warning" not in err
    # The other clone has no local cache and no outputs: both come from the server.
    code, second, err = _run(two, tmp_path, "--cache-url", server.url)
    assert (code, second["status"]) == (0, "passed"), err
    assert _marker(tmp_path) == ["build", "test"]  # neither stage ran again
    stages = by_id(second)
    assert stages["build"]["cache_hit"] is True and stages["test"]["cache_hit"] is True
    assert stages["build"]["reused_from"] == first["run_id"]
    assert "outputs were restored" in stages["build"]["explain"]["reasons"][0]
    assert (two.root / "app" / "out" / "data.txt").read_text() == "GOOD"
    assert Path(stages["test"]["log_path"]).is_file()  # the log blob is in the local mirror
    # --dry-run predicts the hit through the server and runs nothing.
    code, dry, err = _run(four, tmp_path, "--dry-run", "--cache-url", server.url)
    assert code == 0, err
    assert [s["prediction"] for s in dry["stages"]] == ["reuse", "reuse"]
    assert _marker(tmp_path) == ["build", "test"]
    # The environment variable works like the option.
    code, third, err = _run(three, tmp_path, RATCHET_CHECKS_CACHE_URL=server.url)
    assert code == 0, err
    assert by_id(third)["build"]["reused_from"] == first["run_id"]
    assert _marker(tmp_path) == ["build", "test"]


KEY_ENV = "RATCHET_CHECKS_SIGNING_KEY"


def _signed(**env: str) -> dict[str, str]:
    return {KEY_ENV: KEY, **env}


def test_a_damaged_or_forged_entry_on_the_server_is_a_miss(
    tmp_path: Path, servers: list[Server]
) -> None:
    server = _start(servers, tmp_path)
    one, two, three = _clones(tmp_path, 3)
    url = ["--cache-url", server.url]
    code, first, err = _run(one, tmp_path, *url, **_signed())
    assert code == 0, err
    assert _marker(tmp_path) == ["build", "test"]
    test_entry = next(p for p in server.entries() if read_json(p)["stage_id"] == "test")
    assert read_json(test_entry)["seal"].startswith("hmac-sha256:")
    # Damage: the server's copy of test's log is altered.
    log_sha = by_id(first)["test"]["log_sha256"]
    (server.directory / "blobs" / log_sha[:2] / log_sha).write_text("ok, trust me\n")
    code, second, err = _run(two, tmp_path, *url, **_signed())
    assert code == 0, err
    assert _marker(tmp_path) == ["build", "test", "test"]  # test ran, build was reused
    assert "altered" in by_id(second)["test"]["explain"]["cache"]
    # That run uploaded the intact log again (the server hid its damaged copy on HEAD).
    assert (server.directory / "blobs" / log_sha[:2] / log_sha).read_text() != "ok, trust me\n"
    # Forgery: an entry sealed by someone without the signing key.
    forged = read_json(test_entry)
    forged["origin_run_id"] = "someone-else"
    forged.pop("seal")
    test_entry.write_text(json.dumps(seal(forged)))
    code, third, err = _run(three, tmp_path, *url, **_signed())
    assert code == 0, err
    assert _marker(tmp_path) == ["build", "test", "test", "test"]
    assert "not signed" in by_id(third)["test"]["explain"]["cache"]
    assert by_id(third)["build"]["cache_hit"] is True


def test_a_read_only_server_refuses_writes_and_the_run_still_passes(
    tmp_path: Path, servers: list[Server]
) -> None:
    server = _start(servers, tmp_path, "--read-only")
    (one,) = _clones(tmp_path, 1)
    code, result, err = _run(one, tmp_path, "--cache-url", server.url)
    assert (code, result["status"]) == (0, "passed"), err
    assert _marker(tmp_path) == ["build", "test"]
    assert err.count("refused a write: 403") == 1  # one warning, not one per stage
    assert "read-only" in err
    assert server.entries() == []
    assert server.put("/v1/entries/" + "a" * 64, b"{}") == 403
    assert server.stop() == 0  # SIGTERM stops it cleanly


def test_a_server_that_is_down_is_a_miss_with_one_warning(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (one,) = _clones(tmp_path, 1)
    code, result, err = _run(one, tmp_path, "--cache-url", f"http://127.0.0.1:{port}")
    assert (code, result["status"]) == (0, "passed"), err
    assert _marker(tmp_path) == ["build", "test"]
    assert err.count("cannot be reached") == 1
    assert "cache server" in by_id(result)["build"]["explain"]["cache"]


def test_writes_need_the_token_and_a_public_address_needs_one(
    tmp_path: Path, servers: list[Server]
) -> None:
    # Without a token the server will not listen on a non-loopback address (exit 2).
    refused = subprocess.run(
        [PY, "-m", "ratchet.checks", "cache", "serve", "--dir", str(tmp_path / "c")]
        + ["--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        cwd=tmp_path,
    )
    assert refused.returncode == 2
    assert "RATCHET_CHECKS_CACHE_TOKEN" in refused.stderr and "Traceback" not in refused.stderr
    short = subprocess.run(
        [PY, "-m", "ratchet.checks", "cache", "serve", "--dir", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        env=_env(tmp_path, RATCHET_CHECKS_CACHE_TOKEN="short"),
        cwd=tmp_path,
    )
    assert short.returncode == 2 and "at least 16" in short.stderr
    # With a token set, writes need it; reads do not.
    server = _start(servers, tmp_path, RATCHET_CHECKS_CACHE_TOKEN=TOKEN)
    one, two, three = _clones(tmp_path, 3)
    code, _, err = _run(one, tmp_path, "--cache-url", server.url)
    assert code == 0 and err.count("refused a write: 401") == 1
    assert server.entries() == []
    assert server.put("/v1/entries/" + "a" * 64, b"{}", token="wrong" * 8) == 401
    code, _, err = _run(two, tmp_path, "--cache-url", server.url, RATCHET_CHECKS_CACHE_TOKEN=TOKEN)
    assert code == 0 and "warning" not in err
    assert len(server.entries()) == 2
    code, third, err = _run(three, tmp_path, "--cache-url", server.url)  # reading: no token
    assert code == 0 and by_id(third)["test"]["cache_hit"] is True
    assert _marker(tmp_path) == ["build", "test", "build", "test"]  # the third run reused


def test_cache_options_are_checked(tmp_path: Path) -> None:
    (one,) = _clones(tmp_path, 1)
    code, _, err = _run(one, tmp_path, "--cache-url", "ftp://x", "--cache-dir", "d")
    assert code == 2 and "alternatives" in err
    code, _, err = _run(one, tmp_path, "--cache-url", "cache.internal:8765")
    assert code == 2 and "not an http:// or https:// URL" in err
    # A URL urllib would only refuse at the first request (every stage failed on it) is
    # refused before anything runs, in one line naming where it came from.
    for url, why in [
        ("http://127.0.0.1:abc", "no valid port"),
        ("http://127.0.0.1:99999", "no valid port"),
        ("http://exa mple.com", "a space or a control character"),
        ("http://cache.internal:8765/?x=1", "a query"),
    ]:
        code, _, err = _run(one, tmp_path, "--cache-url", url)
        assert code == 2, (url, err)
        assert err.startswith("ratchet checks: error: --cache-url: ") and why in err, err
        assert err.count("\n") == 1, err
    code, _, err = _run(one, tmp_path, RATCHET_CHECKS_CACHE_URL="http://h:port")
    assert code == 2 and "RATCHET_CHECKS_CACHE_URL: " in err and "no valid port" in err
    assert _marker(tmp_path) == []


class FakeServer:
    """A misbehaving "cache server" on 127.0.0.1: `answer(self, connection, request bytes)`
    in a thread per connection. It records the request lines it saw."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.requests: list[str] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = conn.recv(65536)
                self.requests.append(request.split(b"\r\n", 1)[0].decode(errors="replace"))
                self.answer(self, conn, request)
            except OSError:
                pass

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


@pytest.fixture
def fakes() -> Iterator[list[FakeServer]]:
    made: list[FakeServer] = []
    yield made
    for fake in made:
        fake.close()


def _not_http(fake: FakeServer, conn: socket.socket, request: bytes) -> None:
    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")


def _header_too_long(fake: FakeServer, conn: socket.socket, request: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Junk: " + b"j" * 100_000 + b"\r\n\r\n")


@pytest.mark.parametrize("answer", [_not_http, _header_too_long])
def test_an_answer_that_is_not_http_is_a_miss_with_one_warning(
    tmp_path: Path, fakes: list[FakeServer], answer: Any
) -> None:
    fake = FakeServer(answer)
    fakes.append(fake)
    (one,) = _clones(tmp_path, 1)
    code, result, err = _run(one, tmp_path, "--cache-url", fake.url)
    assert (code, result["status"]) == (0, "passed"), err
    assert _marker(tmp_path) == ["build", "test"]
    assert err.count("warning") == 1 and f"the cache server {fake.url}" in err, err
    assert "this run goes on without it" in err
    assert "cache server" in by_id(result)["build"]["explain"]["cache"]
    assert len(fake.requests) == 1  # asked once, then never again this run


def _drip_body(fake: FakeServer, conn: socket.socket, request: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    while not fake.closed.wait(0.2):  # a byte at a time, forever: no read ever times out
        conn.sendall(b" ")


def _drip_headers(fake: FakeServer, conn: socket.socket, request: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    while not fake.closed.wait(0.2):
        conn.sendall(b"X: y\r\n")


@pytest.mark.parametrize("answer", [_drip_body, _drip_headers])
def test_a_server_that_drips_its_answer_is_cut_at_the_deadline(
    tmp_path: Path, fakes: list[FakeServer], answer: Any
) -> None:
    from ratchet.checks._remote import RemoteCheckCache

    fake = FakeServer(answer)
    fakes.append(fake)
    cache = RemoteCheckCache(fake.url, tmp_path / "mirror", timeout=1.0)
    found: list[tuple[Any, str]] = []
    started = time.monotonic()
    asking = threading.Thread(target=lambda: found.append(cache.lookup("a" * 64)), daemon=True)
    asking.start()
    asking.join(20)
    assert not asking.is_alive(), "the lookup still waits on the dripping server"
    assert time.monotonic() - started < 5  # 1 s (the deadline), and the watchdog's tick
    ((entry, why),) = found
    assert entry is None and why.startswith("cache server: no complete answer within 1 s")
    (warning,) = cache.warnings
    assert warning.startswith(f"the cache server {fake.url} is too slow (")
    assert cache.lookup("b" * 64)[1] == "cache server: the cache server is unreachable"
    assert len(fake.requests) == 1


def _sealed_entry(key: str, log_sha: str) -> bytes:
    """A passed stage's cache entry, sealed, for `key` and a log blob `log_sha`."""
    return json.dumps(
        seal(
            {
                "version": 1,
                "cache_key": key,
                "stage_id": "s",
                "checkpoint_id": "0" * 64,
                "exit_code": 0,
                "log_sha256": log_sha,
                "outputs": None,
                "outputs_digest": None,
                "origin_run_id": "r",
                "stored_at": 1.0,
            }
        )
    ).encode()


def test_the_deadline_grows_with_the_bytes_a_transfer_moves(
    tmp_path: Path, fakes: list[FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blob that keeps arriving at a decent rate is not cut at the base deadline: each
    byte buys time (1 s per MIN_RATE_BYTES)."""
    from ratchet.checks._remote import MIN_RATE_BYTES, RemoteCheckCache

    monkeypatch.delenv("RATCHET_CHECKS_SIGNING_KEY", raising=False)
    log = b"L" * (3 * MIN_RATE_BYTES)
    log_sha = hashlib.sha256(log).hexdigest()
    key = "c" * 64
    entry = _sealed_entry(key, log_sha)

    def answer(fake: FakeServer, conn: socket.socket, request: bytes) -> None:
        body = entry if b"/v1/entries/" in request else log
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        step = MIN_RATE_BYTES // 5  # 2 x MIN_RATE_BYTES a second: about 1.5 s in all
        for at in range(0, len(body), step):
            conn.sendall(body[at : at + step])
            time.sleep(0.1)

    fake = FakeServer(answer)
    fakes.append(fake)
    cache = RemoteCheckCache(fake.url, tmp_path / "mirror", timeout=1.0)
    started = time.monotonic()
    found, why = cache.lookup(key)
    assert time.monotonic() - started > 1.2  # longer than the base deadline
    assert found is not None and why == "hit", why
    assert cache.warnings == []


def test_a_blob_answer_without_end_is_cut_at_the_largest_blob_the_server_takes(
    tmp_path: Path, fakes: list[FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server (or something in between) that answers a blob request with bytes that never
    end, fast enough that the deadline keeps growing, filled the disk: the answer is cut
    once it is longer than any blob a server takes, and nothing of it is kept."""
    from ratchet.checks import _remote
    from ratchet.checks._remote import RemoteCheckCache

    monkeypatch.delenv("RATCHET_CHECKS_SIGNING_KEY", raising=False)
    monkeypatch.setattr(_remote, "MAX_BLOB_BYTES", 1 << 20)  # 4 GiB in use: a MiB here
    key = "d" * 64
    entry = _sealed_entry(key, "e" * 64)
    sent = [0]

    def answer(fake: FakeServer, conn: socket.socket, request: bytes) -> None:
        if b"/v1/entries/" in request:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(entry) + entry)
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")  # no length: to EOF
        chunk = b"x" * 65536
        while not fake.closed.is_set() and sent[0] < 64 << 20:  # the test's own bound
            conn.sendall(chunk)
            sent[0] += len(chunk)

    fake = FakeServer(answer)
    fakes.append(fake)
    cache = RemoteCheckCache(fake.url, tmp_path / "mirror", timeout=5.0)
    found: list[tuple[Any, str]] = []
    asking = threading.Thread(target=lambda: found.append(cache.lookup(key)), daemon=True)
    asking.start()
    asking.join(60)
    assert not asking.is_alive(), f"the lookup still reads the endless blob ({sent[0]} bytes)"
    ((got, why),) = found
    assert (
        got is None and why == f"cache server: its blob {'e' * 64} is longer than {1 << 20} bytes"
    )
    assert sent[0] < 64 << 20, "read to the test's bound: not cut"
    kept = [p for p in (tmp_path / "mirror").rglob("*") if p.is_file()]
    assert kept == [], kept  # no part of it stays in the mirror


def test_sigterm_stops_a_run_waiting_on_a_slow_cache_server(
    tmp_path: Path, fakes: list[FakeServer]
) -> None:
    fake = FakeServer(_drip_body)
    fakes.append(fake)
    (one,) = _clones(tmp_path, 1)
    proc = subprocess.Popen(
        [PY, "-m", "ratchet.checks", "--workspace-root", str(one.root)]
        + ["--state-dir", str(one.state_dir), "run", "--json", "--cache-url", fake.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp_path),
        cwd=one.root,
    )
    try:
        for _ in range(200):
            if fake.requests:
                break
            time.sleep(0.05)
        assert fake.requests, "the run never asked the cache server"
        time.sleep(0.5)  # the lookup is now blocked on the dripping answer
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert time.monotonic() - signalled < 10  # not the 30 s deadline, not forever
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    assert "warning" not in err  # an interrupted request is not the server's fault
    assert _marker(tmp_path) == []
    (receipt,) = one.state_dir.glob("runs/*/receipt.json")
    assert read_json(receipt)["status"] == "interrupted"


@pytest.mark.parametrize("where", ["--cache-dir", "--cache-url"])
def test_outputs_that_cannot_be_restored_are_a_miss_and_the_stage_runs(
    tmp_path: Path, servers: list[Server], where: str
) -> None:
    if where == "--cache-url":
        shared = [where, _start(servers, tmp_path).url]
    else:
        shared = [where, str(tmp_path / "shared")]
    one, two = _clones(tmp_path, 2, clean=True)
    code, first, err = _run(one, tmp_path, *shared)
    assert code == 0, err
    # A leftover folder where the cached output file goes: restoring it fails.
    (two.root / "app" / "out" / "data.txt" / "sub").mkdir(parents=True)
    code, second, err = _run(two, tmp_path, *shared)
    assert (code, second["status"]) == (0, "passed"), err
    assert _marker(tmp_path) == ["build", "test", "build"]  # build ran; test was reused
    build = by_id(second)["build"]
    assert build["explain"]["decision"] == "ran"
    assert "its outputs could not be restored" in build["explain"]["cache"]
    assert "data.txt" in build["explain"]["cache"]
    assert by_id(second)["test"]["cache_hit"] is True
    assert (two.root / "app" / "out" / "data.txt").read_text() == "GOOD"


def test_a_restore_that_fails_half_way_removes_what_it_wrote(tmp_path: Path) -> None:
    from ratchet.checks._cache import CheckCache

    cache = CheckCache(tmp_path / "cache")
    blob = hashlib.sha256(b"A").hexdigest()
    assert cache.write_blob(blob, [b"A"])
    root = tmp_path / "ws"
    (root / "out" / "z.txt" / "sub").mkdir(parents=True)  # the last file cannot be written
    manifest = {
        "out/a.txt": f"sha256:{blob}",
        "out/new/b.txt": f"sha256:{blob}",
        "out/z.txt": f"sha256:{blob}",
    }
    problem = cache.restore_outputs(root, manifest, ["out"])
    assert problem is not None and problem.startswith("its outputs could not be restored (")
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "out",
        "out/z.txt",
        "out/z.txt/sub",
    ]


def test_a_result_too_large_for_the_server_is_not_offered_and_the_server_stays_in_use(
    tmp_path: Path, servers: list[Server]
) -> None:
    server = _start(servers, tmp_path)
    (tmp_path / "one").mkdir()
    ws = Workspace(tmp_path / "one")
    ws.repo("app", {"src.txt": "x", ".gitignore": "out/\n"})
    # 4,000 output files with long names: an entry (its output manifest) over 1 MiB.
    many = (
        "import pathlib\n"
        "out = pathlib.Path('out'); out.mkdir(exist_ok=True)\n"
        "for i in range(4000):\n"
        "    (out / (f'{i:05d}' + 'x' * 200)).write_text('same')\n"
        "print('big built')\n"
    )
    ws.project(
        [
            check("big", many, cwd="app", repos=["app"], outputs=["app/out"]),
            check("small", "print('small')", repos=["app"], after=["big"]),
        ]
    )
    code, result, err = _run(ws, tmp_path, "--cache-url", server.url)
    assert (code, result["status"]) == (0, "passed"), err
    assert err.count("warning") == 1, err
    assert "stage 'big''s result is not shared: its entry is " in err
    assert "cannot be reached" not in err
    # Nothing of big was offered (not its log, not its files); small was shared.
    assert [read_json(p)["stage_id"] for p in server.entries()] == ["small"]
    big = by_id(result)["big"]
    assert not (server.directory / "blobs" / big["log_sha256"][:2] / big["log_sha256"]).exists()
    log = server.stderr_path.read_text()
    assert log.count("HEAD /v1/blobs/") == 1 and "PUT /v1/entries/" in log
    # The entry stays in the local mirror: the next run reuses big from it.
    code, again, err = _run(ws, tmp_path, "--cache-url", server.url)
    assert code == 0 and by_id(again)["big"]["cache_hit"] is True, err


def test_the_server_answers_413_to_an_entry_too_large(
    tmp_path: Path, servers: list[Server]
) -> None:
    server = _start(servers, tmp_path)
    # Read before the answer, the body does not cut the upload: the client reads the 413.
    for _ in range(3):
        assert server.put("/v1/entries/" + "a" * 64, b" " * (3 << 20)) == 413
    assert server.put("/v1/entries/" + "a" * 64, b"{}") == 400  # and it still serves
