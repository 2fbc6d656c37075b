"""`ratchet checks cache serve`: an HTTP server over a cache directory.

Endpoints (keys and digests are 64 lowercase hex characters):

    GET / HEAD / PUT  /v1/entries/<cache key>   an entry (JSON), as `_cache.py` stores it
    GET / HEAD / PUT  /v1/blobs/<sha256>        a blob (a log, an output file)

The server trusts nothing it is sent and vouches for nothing it serves: it keeps entries
as given (a JSON object for the key in the URL) and blobs only if they hash to their name;
clients verify every entry's seal or signature and re-hash every blob before reuse. Who may
write is the server's whole policy: nobody with `--read-only` (403), whoever holds the
token (`RATCHET_CHECKS_CACHE_TOKEN`, as `Authorization: Bearer ...`) when one is set, and
a token is required when the server listens on anything but a loopback address.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import os
import socket
import sys
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ratchet._errors import ConfigError
from ratchet.checks._cache import CheckCache, is_digest
from ratchet.checks._remote import MAX_BLOB_BYTES, MAX_ENTRY_BYTES, TOKEN_ENV
from ratchet.store import sha256_file

__all__ = ["MAX_BLOB_BYTES", "MAX_ENTRY_BYTES", "MIN_TOKEN_BYTES", "is_loopback", "serve"]

MIN_TOKEN_BYTES = 16
_CHUNK = 1 << 20
# A body over the limit but under this is read (and dropped) before the 413, so the client
# reads the answer instead of seeing its upload cut (a broken pipe, as if the server were
# down); a larger one is not worth the bytes: the connection is closed.
_DRAIN_BYTES = 16 << 20


def is_loopback(host: str) -> bool:
    """True if every address `host` names is a loopback one."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as exc:
        raise ConfigError(f"cache serve: --host {host!r} cannot be resolved ({exc})") from exc
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], cache: CheckCache, read_only: bool, token: str | None
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.cache = cache
        self.read_only = read_only
        self.token = token


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "ratchet-checks-cache"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        sys.stderr.write(f"{self.address_string()} {format % args}\n")

    # --- answers ------------------------------------------------------------------------
    def _answer(self, status: HTTPStatus, message: str = "") -> None:
        body = (json.dumps({"status": status.value, "message": message}) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _target(self) -> tuple[str, str] | None:
        parts = self.path.split("?", 1)[0].strip("/").split("/")
        if len(parts) == 3 and parts[0] == "v1" and parts[1] in ("entries", "blobs"):
            if is_digest(parts[2]):
                return parts[1], parts[2]
        return None

    def _file(self, kind: str, name: str) -> Path:
        cache = self.server.cache
        return cache.entry_path(name) if kind == "entries" else cache.blob_path(name)

    # --- reading ------------------------------------------------------------------------
    def do_HEAD(self) -> None:  # noqa: N802 (the base's naming)
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        target = self._target()
        if target is None:
            self._answer(HTTPStatus.NOT_FOUND, "no such endpoint: see `ratchet checks cache`")
            return
        path = self._file(*target)
        try:
            handle = open(path, "rb")  # noqa: SIM115 (closed below)
        except OSError:
            self._answer(
                HTTPStatus.NOT_FOUND, "no such entry" if target[0] == "entries" else "no such blob"
            )
            return
        with handle:
            size = os.fstat(handle.fileno()).st_size
            if self.command == "HEAD" and target[0] == "blobs":
                # a client asks before uploading: a damaged blob is absent, so it is replaced
                if sha256_file(path) != target[1]:
                    self._answer(HTTPStatus.NOT_FOUND, "no such blob (the stored one is damaged)")
                    return
            self.send_response(HTTPStatus.OK)
            kind = "application/json" if target[0] == "entries" else "application/octet-stream"
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            if self.command == "HEAD":
                return
            while chunk := handle.read(_CHUNK):
                self.wfile.write(chunk)

    # --- writing ------------------------------------------------------------------------
    def _body(self, limit: int) -> Iterator[bytes] | None:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._answer(HTTPStatus.LENGTH_REQUIRED, "a Content-Length is required")
            return None
        remaining = int(length)
        if remaining > limit:
            self.close_connection = True
            if remaining <= _DRAIN_BYTES:
                with contextlib.suppress(OSError):
                    while remaining > 0:
                        chunk = self.rfile.read(min(_CHUNK, remaining))
                        if not chunk:
                            break
                        remaining -= len(chunk)
            self._answer(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"more than {limit} bytes")
            return None

        def chunks() -> Iterator[bytes]:
            nonlocal remaining
            while remaining > 0:
                chunk = self.rfile.read(min(_CHUNK, remaining))
                if not chunk:
                    raise ConnectionError("the request body ended early")
                remaining -= len(chunk)
                yield chunk

        return chunks()

    def _may_write(self) -> bool:
        if self.server.read_only:
            self.close_connection = True
            self._answer(HTTPStatus.FORBIDDEN, "this cache server is read-only")
            return False
        token = self.server.token
        if token is not None:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                self.close_connection = True
                self._answer(HTTPStatus.UNAUTHORIZED, "a valid bearer token is required")
                return False
        return True

    def do_PUT(self) -> None:  # noqa: N802
        target = self._target()
        if target is None:
            self.close_connection = True
            self._answer(HTTPStatus.NOT_FOUND, "no such endpoint")
            return
        if not self._may_write():
            return
        kind, name = target
        cache = self.server.cache
        body = self._body(MAX_ENTRY_BYTES if kind == "entries" else MAX_BLOB_BYTES)
        if body is None:
            return
        try:
            if kind == "blobs":
                if not cache.write_blob(name, body):
                    self._answer(HTTPStatus.BAD_REQUEST, f"the body does not hash to {name}")
                    return
            else:
                data = b"".join(body)
                try:
                    entry = json.loads(data)
                except ValueError:
                    entry = None
                if not isinstance(entry, dict) or entry.get("cache_key") != name:
                    self._answer(HTTPStatus.BAD_REQUEST, f"not a JSON cache entry for {name}")
                    return
                cache.write_entry_bytes(name, data)
        except ConnectionError:
            self.close_connection = True
            return
        except OSError as exc:
            self._answer(HTTPStatus.INTERNAL_SERVER_ERROR, f"cannot store it: {exc.strerror}")
            return
        self._answer(HTTPStatus.CREATED, "stored")


def serve(
    directory: Path,
    *,
    host: str,
    port: int,
    read_only: bool,
    environ: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Serve `directory` until SIGINT or SIGTERM. Prints `serving ... at URL` on stdout
    once it listens (with `port` 0, the port the system chose)."""
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_ENV) or None
    if not 0 <= port <= 65535:
        raise ConfigError(f"cache serve: --port {port} is not a port number (0-65535)")
    if token is not None and len(token.encode()) < MIN_TOKEN_BYTES:
        raise ConfigError(
            f"cache serve: the token in {TOKEN_ENV} is {len(token.encode())} bytes; use at "
            f"least {MIN_TOKEN_BYTES} random bytes (e.g. `openssl rand -hex 32`)"
        )
    if token is None and not read_only and not is_loopback(host):
        raise ConfigError(
            f"cache serve: --host {host} is not a loopback address, so writes need a token: "
            f"set {TOKEN_ENV} (e.g. `openssl rand -hex 32`), or pass --read-only"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cache serve: --dir {directory}: {exc.strerror}") from exc
    if not directory.is_dir():
        raise ConfigError(f"cache serve: --dir {directory} is not a directory")
    try:
        server = _Server((host, port), CheckCache(directory), read_only, token)
    except OSError as exc:
        raise ConfigError(f"cache serve: cannot listen on {host}:{port} ({exc})") from exc
    bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"http://{shown}:{bound_port}"
    mode = "read-only" if read_only else ("writes need the token" if token else "writable")
    print(f"serving cache {directory} at {url} ({mode})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        with contextlib.suppress(Exception):
            server.server_close()
    return {"ok": True, "url": url, "text": f"cache server at {url} stopped"}
