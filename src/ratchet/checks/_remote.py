"""A cache behind an HTTP cache server (`ratchet checks cache serve`), for `--cache-url`.

The state folder's `cache/` is its local mirror: a lookup asks the mirror first, then the
server; an entry from the server is verified exactly as a directory cache's entry is (its
seal, or signature, and its log blob's SHA-256) before it is kept in the mirror and
reused. A store writes the mirror, then uploads the blobs and the entry. The server is
never trusted, and never needed: a network error (or a refusal) is a miss, or an entry not
shared, with one warning; it never fails a run.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ratchet._clock import SYSTEM_CLOCK, Clock
from ratchet._errors import ConfigError
from ratchet.checks._cache import CheckCache, check_entry, is_digest
from ratchet.store import sha256_file

__all__ = [
    "MAX_BLOB_BYTES",
    "MAX_ENTRY_BYTES",
    "MIN_RATE_BYTES",
    "TIMEOUT_SECONDS",
    "TOKEN_ENV",
    "URL_ENV",
    "RemoteCheckCache",
    "check_url",
]

URL_ENV = "RATCHET_CHECKS_CACHE_URL"
TOKEN_ENV = "RATCHET_CHECKS_CACHE_TOKEN"
# A request must end within TIMEOUT_SECONDS plus the time its bytes take at MIN_RATE_BYTES
# a second (an entry lookup: about 30 s; a 100 MiB blob: 30 s + 17 min), and no single read,
# write or connect may wait longer than TIMEOUT_SECONDS. A server that answers slower than
# that (one that drips its answer byte by byte) is treated as one that cannot be reached.
TIMEOUT_SECONDS = 30.0
MIN_RATE_BYTES = 100 << 10
_WATCH_SECONDS = 0.25
_CHUNK = 1 << 20
MAX_ENTRY_BYTES = 1 << 20  # what the server accepts
MAX_BLOB_BYTES = 4 << 30


def check_url(url: str, option: str = "--cache-url") -> str:
    """`url` without a trailing slash, if it is an http(s) URL with a host (and, if it has
    one, a numeric port), no query and no space or control character; `option` names where
    it came from in the error."""
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ConfigError(
            f"{option}: the cache URL {url!r} has a space or a control character in it"
        )
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{option}: the cache URL {url!r} is not an http:// or https:// URL "
            "(e.g. http://cache.internal:8765)"
        )
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(
            f"{option}: the cache URL {url!r} has no valid port (a number 1-65535 after the "
            "host, e.g. http://cache.internal:8765)"
        )
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise ConfigError(f"{option}: the cache URL {url!r} has a query or a fragment")
    return url.rstrip("/")


# What a request to the server may raise besides an HTTP error status: OSError (URLError,
# timeouts, resets), http.client.HTTPException (an answer that is not HTTP: BadStatusLine,
# LineTooLong, IncompleteRead, ...), ValueError (a response urllib cannot parse).
_NETWORK_ERRORS = (OSError, http.client.HTTPException, ValueError)


class _Unavailable(Exception):
    """The server could not be reached, or answered with an error."""


class _Cut(OSError):
    """A request was cut short: the run was interrupted."""


class _TooSlow(_Cut, TimeoutError):
    """A request was cut short: it outlived its deadline."""


_CURRENT = threading.local()  # the `_Call` whose connection this thread is opening


class _Call:
    """One request in flight: its deadline, and its socket, which the watchdog (at the
    deadline) or `abort` (when the run is interrupted) shuts down, ending whatever read,
    write or connect is blocked on it."""

    def __init__(self, owner: RemoteCheckCache) -> None:
        self.owner = owner
        self.started = owner.clock.monotonic()
        self.moved = 0  # bytes received or sent so far
        self.sock: socket.socket | None = None
        self.cut: _Cut | None = None

    def deadline(self) -> float:
        return self.started + self.owner.timeout + self.moved / MIN_RATE_BYTES

    def attach(self, sock: socket.socket) -> None:
        with self.owner._lock:
            self.sock, cut = sock, self.cut
        if cut is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            raise cut

    def shut(self, why: _Cut) -> None:
        with self.owner._lock:
            if self.cut is None:
                self.cut = why
            sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def why(self, exc: BaseException) -> BaseException:
        """What a failure of this call is: its cut, if it was cut short."""
        return self.cut if self.cut is not None else exc


class _Counted:
    """A request body (a file) that counts the bytes sent, for the call's deadline."""

    def __init__(self, handle: Any, call: _Call) -> None:
        self.handle, self.call = handle, call

    def read(self, size: int = -1) -> bytes:
        chunk: bytes = self.handle.read(size)
        self.call.moved += len(chunk)
        return chunk


class _TrackedHTTP(http.client.HTTPConnection):
    """An HTTP connection whose socket the `_Call` being opened (`_CURRENT`) can shut down,
    from the moment it is created (so a hanging connect is cut too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ratchet_call: _Call | None = getattr(_CURRENT, "call", None)
        self._create_connection = self._open_socket

    def _open_socket(
        self,
        address: tuple[str, int],
        timeout: float | None = None,
        source_address: tuple[str, int] | None = None,
    ) -> socket.socket:
        call = self._ratchet_call
        if call is None:
            return socket.create_connection(address, timeout, source_address)
        host, port = address
        error: OSError | None = None
        for family, kind, proto, _, where in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                call.attach(sock)
                sock.settimeout(timeout)
                if source_address:
                    sock.bind(source_address)
                sock.connect(where)
                return sock
            except OSError as exc:
                error = exc
                sock.close()
        raise error if error is not None else OSError(f"{host} has no address")

    def connect(self) -> None:
        super().connect()
        if self._ratchet_call is not None and self.sock is not None:
            self._ratchet_call.attach(self.sock)  # with https, the TLS socket


class _TrackedHTTPS(_TrackedHTTP, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_TrackedHTTP, req, **kwargs)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_TrackedHTTPS, req, **kwargs)


def _at_most(chunks: Iterator[bytes], limit: int, sha256: str) -> Iterator[bytes]:
    """`chunks`, cut with _Unavailable past `limit` bytes: the server takes no blob larger,
    so a longer answer is not one, and one without end must not fill the disk (the deadline
    grows with the bytes that come, so it never ends a fast one)."""
    moved = 0
    try:
        for chunk in chunks:
            moved += len(chunk)
            if moved > limit:
                raise _Unavailable(f"its blob {sha256} is longer than {limit} bytes")
            yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # ends the request (its socket and its deadline) now


class RemoteCheckCache(CheckCache):
    """A cache server, with a local directory cache in front of it."""

    def __init__(
        self,
        url: str,
        mirror: Path,
        *,
        read_only: bool = False,
        token: str | None = None,
        timeout: float = TIMEOUT_SECONDS,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(mirror, read_only=read_only)
        self.url = check_url(url)
        self.token = token
        self.timeout = timeout
        self.clock = clock  # the deadlines' time (a test's clock, through the run's seams)
        self._lock = threading.Lock()
        self._down = False  # after a network error, the server is not asked again
        self._no_writes = False  # after a refused write, nothing more is uploaded
        self._stopped = False  # the run was interrupted: nothing more is asked, or said
        self._said_too_large = False
        self._calls: set[_Call] = set()  # the requests in flight
        self._watchdog: threading.Thread | None = None
        self._opener = urllib.request.build_opener(_HTTPHandler(), _HTTPSHandler())
        self.warnings: list[str] = []

    def abort(self) -> None:
        """The run was interrupted: cut every request in flight (a blocked read, write or
        connect ends at once) and ask the server nothing more, without a warning."""
        with self._lock:
            self._stopped = self._down = True
            calls = list(self._calls)
        for call in calls:
            call.shut(_Cut("the run was interrupted"))

    # --- talking to the server ----------------------------------------------------------
    def _warn(self, message: str) -> None:
        with self._lock:
            self.warnings.append(message)
        print(f"ratchet checks: warning: {message}", file=sys.stderr, flush=True)

    def _begin(self) -> _Call:
        call = _Call(self)
        with self._lock:
            if self._stopped:
                call.cut = _Cut("the run was interrupted")
            self._calls.add(call)
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, name="ratchet-cache-watchdog", daemon=True
                )
                self._watchdog.start()
        return call

    def _end(self, call: _Call) -> None:
        with self._lock:
            self._calls.discard(call)

    def _watch(self) -> None:
        """Cut every request past its deadline; ends when none is in flight."""
        while True:
            self.clock.sleep_sync(_WATCH_SECONDS)
            now = self.clock.monotonic()
            with self._lock:
                if not self._calls:
                    self._watchdog = None
                    return
                late = [c for c in self._calls if c.cut is None and c.deadline() <= now]
            for call in late:
                allowed = call.deadline() - call.started
                call.shut(
                    _TooSlow(
                        f"no complete answer within {allowed:.0f} s: a request may take "
                        f"{self.timeout:g} s plus 1 s per {MIN_RATE_BYTES >> 10} KiB it moves"
                    )
                )

    def _request(
        self, call: _Call, method: str, path: str, data: Any = None, size: int | None = None
    ) -> Any:
        if call.cut is not None:
            raise call.cut
        headers = {"User-Agent": "ratchet-checks"}
        if self.token and method == "PUT":
            headers["Authorization"] = f"Bearer {self.token}"
        if size is not None:
            headers["Content-Length"] = str(size)
        body = None if data is None else _Counted(data, call)
        request = urllib.request.Request(
            f"{self.url}{path}", data=body, method=method, headers=headers
        )
        _CURRENT.call = call
        try:
            return self._opener.open(request, timeout=self.timeout)
        finally:
            _CURRENT.call = None

    def _network_failed(self, exc: BaseException) -> None:
        with self._lock:
            first, self._down = not self._down, True
        if not first or self._stopped:
            return
        if isinstance(exc, _TooSlow):
            what = f"is too slow ({exc})"
        elif isinstance(exc, http.client.HTTPException) and not isinstance(exc, OSError):
            # not an HTTP answer (another service on that port, a proxy's garbage, a cut)
            what = f"gave an answer that is not HTTP ({type(exc).__name__}: {exc})"
        else:
            what = f"cannot be reached ({exc})"
        self._warn(
            f"the cache server {self.url} {what}; this run goes on without it "
            "(every lookup is a miss)"
        )

    def _get(self, path: str) -> Iterator[bytes] | None:
        """The body of GET `path` in chunks, None on 404; raises _Unavailable otherwise."""
        if self._down:
            raise _Unavailable("the cache server is unreachable")
        call = self._begin()
        try:
            response = self._request(call, "GET", path)
        except urllib.error.HTTPError as exc:
            self._end(call)
            exc.close()
            if exc.code == 404:
                return None
            raise _Unavailable(f"the cache server answered {exc.code} {exc.reason}") from exc
        except _NETWORK_ERRORS as exc:  # URLError, timeouts, resets, answers not HTTP
            self._end(call)
            failure = call.why(exc)
            self._network_failed(failure)
            raise _Unavailable(str(failure) or type(failure).__name__) from exc

        def chunks() -> Iterator[bytes]:
            # read1: one read at a time, so the deadline is checked between them (read(n)
            # waits for n bytes, however slowly they come)
            length = response.getheader("Content-Length")
            try:
                with response:
                    while chunk := response.read1(_CHUNK):
                        call.moved += len(chunk)
                        yield chunk
                if call.cut is not None:
                    raise call.cut  # a read that was cut ends like a short body
                if length is not None and length.isdigit() and call.moved < int(length):
                    raise http.client.IncompleteRead(b"", int(length) - call.moved)
            except _NETWORK_ERRORS as exc:
                failure = call.why(exc)
                if failure is exc:
                    raise
                raise failure from exc
            finally:
                self._end(call)

        return chunks()

    def _fetch_blob(self, sha256: str) -> str | None:
        """Have blob `sha256` in the mirror, intact; None, or why not."""
        blob = self.blob_path(sha256)
        with contextlib.suppress(OSError):
            if sha256_file(blob) == sha256:
                return None  # here and intact (a damaged one is fetched again)
        try:
            body = self._get(f"/v1/blobs/{sha256}")
            if body is None:
                return f"the cache server has no blob {sha256}"
            if not self.write_blob(sha256, _at_most(body, MAX_BLOB_BYTES, sha256)):
                return f"the cache server's blob {sha256} was altered"
        except _Unavailable as exc:
            return f"cache server: {exc}"
        except _NETWORK_ERRORS as exc:
            self._network_failed(exc)
            return f"cache server: {exc or type(exc).__name__}"
        return None

    # --- the cache interface ------------------------------------------------------------
    def lookup(self, cache_key: str) -> tuple[dict[str, Any] | None, str]:
        entry, why = super().lookup(cache_key)
        if entry is not None or not is_digest(cache_key):
            return entry, why
        where = f"{self.url}/v1/entries/{cache_key}"
        try:
            body = self._get(f"/v1/entries/{cache_key}")
            if body is None:
                return None, "no cache entry (on the cache server)"
            raw = b""
            for chunk in body:
                raw += chunk
                if len(raw) > MAX_ENTRY_BYTES:
                    return None, f"cache entry {where} is larger than {MAX_ENTRY_BYTES} bytes"
        except _Unavailable as exc:
            return None, f"cache server: {exc}"
        except _NETWORK_ERRORS as exc:
            self._network_failed(exc)
            return None, f"cache server: {exc or type(exc).__name__}"
        try:
            remote = json.loads(raw)
        except ValueError as exc:
            return None, f"cache entry {where} is unreadable ({exc})"
        problem = check_entry(remote, cache_key, where)
        if problem is not None:
            return None, problem
        problem = self._fetch_blob(str(remote["log_sha256"]))
        if problem is not None:
            return None, problem
        entry, why = self.check_log(remote, where)
        if entry is not None:
            self.write_entry_bytes(cache_key, raw)  # verified: kept in the mirror
        return entry, why

    def _restore_plan(
        self, workspace_root: Path, manifest: Mapping[str, str], patterns: list[str]
    ) -> tuple[list[tuple[Path, str, bool]] | None, str | None]:
        problem = self.undeclared_output(workspace_root, manifest, patterns)
        if problem is not None:
            return None, problem  # nothing fetched for it either
        for ident in manifest.values():
            body = ident[2:] if ident.startswith("x:") else ident
            if body.startswith("sha256:") and is_digest(body[len("sha256:") :]):
                problem = self._fetch_blob(body[len("sha256:") :])
                if problem is not None:
                    return None, problem
        return super()._restore_plan(workspace_root, manifest, patterns)

    def store(
        self,
        cache_key: str,
        record: Mapping[str, Any],
        *,
        workspace_root: Path,
        outputs: Mapping[str, str] | None,
        stage_id: str,
        clock: Clock,
    ) -> None:
        super().store(
            cache_key,
            record,
            workspace_root=workspace_root,
            outputs=outputs,
            stage_id=stage_id,
            clock=clock,
        )
        if self.read_only or self._down or self._no_writes or not is_digest(cache_key):
            return
        shas = {str(record["log_sha256"]): None}  # each blob once, in order
        for ident in (outputs or {}).values():
            body = ident[2:] if ident.startswith("x:") else ident
            if body.startswith("sha256:"):
                shas[body[len("sha256:") :]] = None
        # What the server would refuse is not offered, and nothing of its entry is sent: a
        # refusal mid-upload is a cut connection, and the server would be lost for the run.
        try:
            size = os.path.getsize(self.entry_path(cache_key))
            biggest = max(os.path.getsize(self.blob_path(sha)) for sha in shas)
        except OSError:
            return
        if size > MAX_ENTRY_BYTES or biggest > MAX_BLOB_BYTES:
            what = (
                f"its entry is {size} bytes (its outputs list {len(outputs or {})} files), "
                f"more than the {MAX_ENTRY_BYTES} a cache server accepts"
                if size > MAX_ENTRY_BYTES
                else f"a file of it is {biggest} bytes, more than the {MAX_BLOB_BYTES} a "
                "cache server accepts"
            )
            self._too_large(f"stage {stage_id!r}'s result is not shared: {what}")
            return
        for sha in shas:  # blobs first: an entry is never on the server without them
            if not self._put(f"/v1/blobs/{sha}", self.blob_path(sha)):
                return
        self._put(f"/v1/entries/{cache_key}", self.entry_path(cache_key))

    def _too_large(self, message: str) -> None:
        """Say once per run that a result is too large for the server (it stays in the
        local mirror); the server is used for everything else."""
        with self._lock:
            first, self._said_too_large = not self._said_too_large, True
        if first:
            self._warn(
                f"{message}; it stays in the local cache (the cache server is still used "
                "for the other stages, and other results too large are not named)"
            )

    def _put(self, path: str, source: Path) -> bool:
        call = self._begin()
        try:
            if path.startswith("/v1/blobs/"):
                try:  # already there: do not send it again
                    self._request(call, "HEAD", path).close()
                    return True
                except urllib.error.HTTPError as exc:
                    exc.close()
                    if exc.code != 404:
                        raise
            size = os.path.getsize(source)
            with open(source, "rb") as handle:
                self._request(call, "PUT", path, data=handle, size=size).close()
            return True
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 413:  # this one is too large: the others may still be shared
                self._too_large(
                    f"the cache server {self.url} refused {path} as too large (413), so a "
                    "result is not shared"
                )
                return False
            with self._lock:
                first, self._no_writes = not self._no_writes, True
            if first:
                hint = {
                    401: f" (set {TOKEN_ENV} to the server's token)",
                    403: " (the server is read-only)",
                }.get(exc.code, "")
                self._warn(
                    f"the cache server {self.url} refused a write: {exc.code} {exc.reason}"
                    f"{hint}; this run's results are not shared"
                )
            return False
        except _NETWORK_ERRORS as exc:
            self._network_failed(call.why(exc))
            return False
        finally:
            self._end(call)
