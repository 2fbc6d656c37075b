"""What every peer module shares: the workloads' inputs, the result line, and the model server.

Standard library only: each peer imports this from its own venv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# The five workloads (issue 7). Slow peers may run fewer inputs for (1); the result says so.
W1_INPUTS, W1_KEYS = 20_000, 1_000
W2_INPUTS, W2_KEYS, W2_DELAY, CONCURRENCY = 2_000, 200, 0.05, 64
W3_INPUTS, W3_KEYS, W3_KILL_AFTER, W3_DELAY = 500, 100, 250, 0.05
W4_KEYS = 10_000


def w1_inputs(n: int, keys: int = W1_KEYS) -> list[dict[str, Any]]:
    return [{"key": f"k{i % keys}", "id": f"i{i}", "v": i} for i in range(n)]


def w2_inputs(n: int = W2_INPUTS, keys: int = W2_KEYS) -> list[dict[str, Any]]:
    return [{"key": f"k{i % keys}", "id": f"i{i}", "v": i} for i in range(n)]


def w3_inputs(n: int = W3_INPUTS, keys: int = W3_KEYS) -> list[dict[str, Any]]:
    return [{"key": f"k{i % keys}", "id": f"i{i}", "v": i} for i in range(n)]


def w4_inputs(keys: int = W4_KEYS) -> list[dict[str, Any]]:
    return [{"key": f"k{i}", "id": f"i{i}", "v": i} for i in range(keys)]


def w4_new_input() -> dict[str, Any]:
    """The one input a restarted process gets after the kill; its id is new for every repetition."""
    return {"key": "k1", "id": os.environ.get("PEER_NEW_ID", "new"), "v": W4_KEYS + 1}


def write_jsonl(path: Path, rows: list[dict[str, Any]], mode: str = "w") -> None:
    with open(path, mode) as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def _output_files(path: Path) -> list[Path]:
    """A JSONL file, or a folder's finished part files (hidden ones are Flink's in-progress
    and pending parts: not outputs yet)."""
    files: list[Path] = []
    if path.is_dir():
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files += [Path(root) / n for n in names if not n.startswith(".")]
    elif path.exists():
        files = [path]
    return files


def _ids_in(lines: list[bytes]) -> list[str]:
    """The output ids of complete lines: our payload `{"id": ...}` or ratchet's
    `{"output": {"id": ...}, ...}`; anything else (a line cut short by a kill) is skipped."""
    ids = []
    for line in lines:
        try:
            obj = json.loads(line.decode(errors="replace"))
        except ValueError:
            continue
        obj = obj.get("output", obj) if isinstance(obj, dict) else obj
        if isinstance(obj, dict) and "id" in obj:
            ids.append(str(obj["id"]))
    return ids


def _complete_lines(data: bytes) -> tuple[list[bytes], int]:
    """The newline-terminated lines of `data` and how many bytes they take."""
    end = data.rfind(b"\n") + 1
    return data[:end].splitlines(), end


def output_ids(path: Path) -> list[str]:
    """Output ids with their multiplicity, from a JSONL file or a folder of finished part files."""
    ids = []
    for f in _output_files(path):
        try:
            data = f.read_bytes()
        except OSError:  # renamed or just created as a folder under our feet: not an output yet
            continue
        ids += _ids_in(_complete_lines(data)[0])
    return ids


class OutputTail:
    """What `output_ids(path)` says, kept up to date by reading only what was appended since.

    For a waiting loop: re-reading a whole sink every few milliseconds (10,000 lines in
    workload 4) took a third of a core from the peer being measured.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._read: dict[Path, tuple[int, list[str]]] = {}  # file -> (bytes consumed, its ids)
        self.distinct: set[str] = set()
        self.total = 0

    def poll(self) -> None:
        for f in _output_files(self.path):
            done, ids = self._read.get(f, (0, []))
            try:
                with open(f, "rb") as fh:
                    if os.fstat(fh.fileno()).st_size < done:  # rewritten: read it again
                        self._read.pop(f)
                        self.distinct = {i for _, old in self._read.values() for i in old}
                        self.total = sum(len(old) for _, old in self._read.values())
                        done, ids = 0, []
                    fh.seek(done)
                    data = fh.read()
            except OSError:
                continue
            lines, used = _complete_lines(data)
            if used:
                new = _ids_in(lines)
                ids.extend(new)
                self.distinct.update(new)
                self.total += len(new)
                self._read[f] = (done + used, ids)

    def has(self, want: int | str) -> bool:
        """Whether the sink holds `want` distinct outputs (a count), or the output id `want`."""
        self.poll()
        return len(self.distinct) >= want if isinstance(want, int) else want in self.distinct


def installed_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) as a user's installed Python has it: modules compiled
    once and read back. With `PYTHONDONTWRITEBYTECODE` set (as on the machines these figures
    are taken on), an editable ratchet is compiled from source at every start while the
    peers, installed by pip, read compiled files: a cost only the benchmark's ratchet paid."""
    out = dict(os.environ if env is None else env)
    out.pop("PYTHONDONTWRITEBYTECODE", None)
    return out


def compile_ratchet(python: str | Path, env: dict[str, str] | None = None) -> None:
    """Compile the ratchet package that `python` imports (with `env`'s PYTHONPATH), as
    `pip install` does, before anything is timed. Without `env`, also let this process's
    children read and write compiled files (`installed_env`)."""
    if env is None:
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    code = "import compileall, os, ratchet; compileall.compile_dir(os.path.dirname(ratchet.__file__), quiet=1)"
    subprocess.run([str(python), "-c", code], env=installed_env(env), check=True)


def emit(result: dict[str, Any]) -> None:
    """The one line the driver reads from a peer's stdout."""
    print("RESULT " + json.dumps(result), flush=True)


def peer_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=["w1", "w2", "w3", "w4-seed", "w4-resume"])
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--n", type=int, default=0, help="inputs (0: the workload's size)")
    p.add_argument("--url", default="", help="the model server (w3)")
    p.add_argument("--mode", default="default", help="a peer's durability setting")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------
# The simulated model: an HTTP/1.1 server on 127.0.0.1 that answers POST /call after a delay
# and counts every request per (input id, call number). It can SIGKILL a process group at a
# fixed point: when the N-th distinct input makes its first call. It runs in its own process
# (started by the driver), so its counts survive the peer's kill.
# ---------------------------------------------------------------------------------------


class ModelServer:
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.reset()

    def reset(self) -> None:
        self.requests: dict[str, int] = {}  # "id/call" -> times requested
        self.answered_before_kill: set[str] = set()
        self.inflight_at_kill: set[str] = set()
        self.answered: set[str] = set()
        self.inflight: dict[str, int] = {}
        self.started_inputs: set[str] = set()
        self.arm_pgid = 0
        self.arm_after = 0
        self.killed_at = 0.0
        self.after_kill: dict[str, int] = {}

    def stats(self) -> dict[str, Any]:
        repeated = {k: n for k, n in self.after_kill.items() if k in self.answered_before_kill}
        return {
            "requests": sum(self.requests.values()),
            "distinct_calls": len(self.requests),
            "killed": bool(self.killed_at),
            "answered_before_kill": len(self.answered_before_kill),
            "inflight_at_kill": len(self.inflight_at_kill),
            "repeated_after_answer": sum(repeated.values()),
            "repeated_calls_distinct": len(repeated),
            "repeated_inflight": sum(
                n for k, n in self.after_kill.items() if k in self.inflight_at_kill
            ),
        }

    async def call(self, body: dict[str, Any]) -> dict[str, Any]:
        cid = f"{body.get('id')}/{body.get('call')}"
        self.requests[cid] = self.requests.get(cid, 0) + 1
        if self.killed_at:
            self.after_kill[cid] = self.after_kill.get(cid, 0) + 1
        self.inflight[cid] = self.inflight.get(cid, 0) + 1
        iid = str(body.get("id"))
        if iid not in self.started_inputs:
            self.started_inputs.add(iid)
            if self.arm_pgid and not self.killed_at and len(self.started_inputs) >= self.arm_after:
                self.killed_at = time.time()
                self.answered_before_kill = set(self.answered)
                self.inflight_at_kill = {k for k, n in self.inflight.items() if n > 0}
                try:
                    os.killpg(self.arm_pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.inflight[cid] -= 1
        self.answered.add(cid)
        return {"id": body.get("id"), "call": body.get("call"), "text": f"answer {cid}"}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode().split(" ", 2)
                length = 0
                while True:
                    h = await reader.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = h.decode().partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                raw = await reader.readexactly(length) if length else b""
                body = json.loads(raw) if raw else {}
                if target.startswith("/call"):
                    out: Any = await self.call(body)
                elif target.startswith("/stats"):
                    out = self.stats()
                elif target.startswith("/arm"):
                    self.arm_pgid, self.arm_after = int(body["pgid"]), int(body["after"])
                    out = {"ok": True}
                elif target.startswith("/reset"):
                    self.reset()
                    out = {"ok": True}
                else:
                    out = {"error": target}
                data = json.dumps(out).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
                )
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            writer.close()


async def serve(port: int, delay: float) -> None:
    server = ModelServer(delay)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", port, backlog=1024)
    print(f"LISTENING {srv.sockets[0].getsockname()[1]}", flush=True)
    async with srv:
        await srv.serve_forever()


class AsyncModelClient:
    """The model client of the asyncio-based peers: keep-alive HTTP/1.1 connections, pooled.

    Every peer calls the model server through this client (or `SyncModelClient`), so no HTTP
    library's own overhead is in the figures (httpx's pool served only ~100 calls/s at 64
    concurrent requests here, while the server answers 1,000+/s).
    """

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def call(self, iid: str, n: int) -> str:
        conn = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        reader, writer = conn
        body = json.dumps({"id": iid, "call": n}).encode()
        writer.write(
            b"POST /call HTTP/1.1\r\nHost: model\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()
        status = await reader.readline()
        length = 0
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b""):
                break
            if h.lower().startswith(b"content-length:"):
                length = int(h.split(b":", 1)[1])
        data = await reader.readexactly(length)
        if not status.startswith(b"HTTP/1.1 200"):
            writer.close()
            raise RuntimeError(f"model server: {status!r}")
        self.idle.append(conn)
        return str(json.loads(data)["text"])


class SyncModelClient:
    """The model client of the thread-based peers: one keep-alive connection per thread."""

    def __init__(self, url: str) -> None:
        import threading

        self.hostport = url.removeprefix("http://")
        self.local = threading.local()

    def call(self, iid: str, n: int) -> str:
        import http.client

        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(self.hostport, timeout=60)
        conn.request("POST", "/call", json.dumps({"id": iid, "call": n}),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"model server: {resp.status}")
        return str(json.loads(data)["text"])


def control(url: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """A stdlib client for the driver (stats, arm, reset)."""
    import urllib.request

    req = urllib.request.Request(
        url + path, data=json.dumps(body or {}).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the simulated model server")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--delay", type=float, default=W3_DELAY)
    a = ap.parse_args()
    try:
        asyncio.run(serve(a.port, a.delay))
    except KeyboardInterrupt:
        sys.exit(0)
