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
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ratchet._clock import Clock
from ratchet._errors import ConfigError
from ratchet.checks._cache import CheckCache, check_entry, is_digest
from ratchet.store import sha256_file

__all__ = ["TIMEOUT_SECONDS", "TOKEN_ENV", "URL_ENV", "RemoteCheckCache", "check_url"]

URL_ENV = "RATCHET_CHECKS_CACHE_URL"
TOKEN_ENV = "RATCHET_CHECKS_CACHE_TOKEN"
TIMEOUT_SECONDS = 30.0
_CHUNK = 1 << 20
MAX_ENTRY_BYTES = 1 << 20  # what the server accepts


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
    ) -> None:
        super().__init__(mirror, read_only=read_only)
        self.url = check_url(url)
        self.token = token
        self.timeout = timeout
        self._lock = threading.Lock()
        self._down = False  # after a network error, the server is not asked again
        self._no_writes = False  # after a refused write, nothing more is uploaded
        self.warnings: list[str] = []

    # --- talking to the server ----------------------------------------------------------
    def _warn(self, message: str) -> None:
        with self._lock:
            self.warnings.append(message)
        print(f"ratchet checks: warning: {message}", file=sys.stderr, flush=True)

    def _request(self, method: str, path: str, data: Any = None, size: int | None = None) -> Any:
        headers = {"User-Agent": "ratchet-checks"}
        if self.token and method == "PUT":
            headers["Authorization"] = f"Bearer {self.token}"
        if size is not None:
            headers["Content-Length"] = str(size)
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, method=method, headers=headers
        )
        return urllib.request.urlopen(request, timeout=self.timeout)  # noqa: S310 (http(s) only)

    def _network_failed(self, exc: BaseException) -> None:
        with self._lock:
            first, self._down = not self._down, True
        if not first:
            return
        if isinstance(exc, http.client.HTTPException) and not isinstance(exc, OSError):
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
        try:
            response = self._request("GET", path)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 404:
                return None
            raise _Unavailable(f"the cache server answered {exc.code} {exc.reason}") from exc
        except _NETWORK_ERRORS as exc:  # URLError, timeouts, resets, answers not HTTP
            self._network_failed(exc)
            raise _Unavailable(str(exc) or type(exc).__name__) from exc

        def chunks() -> Iterator[bytes]:
            with response:
                while chunk := response.read(_CHUNK):
                    yield chunk

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
            if not self.write_blob(sha256, body):
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
        shas = [str(record["log_sha256"])]
        for ident in (outputs or {}).values():
            body = ident[2:] if ident.startswith("x:") else ident
            if body.startswith("sha256:"):
                shas.append(body[len("sha256:") :])
        for sha in shas:  # blobs first: an entry is never on the server without them
            if not self._put(f"/v1/blobs/{sha}", self.blob_path(sha)):
                return
        self._put(f"/v1/entries/{cache_key}", self.entry_path(cache_key))

    def _put(self, path: str, source: Path) -> bool:
        try:
            if path.startswith("/v1/blobs/"):
                try:  # already there: do not send it again
                    self._request("HEAD", path).close()
                    return True
                except urllib.error.HTTPError as exc:
                    exc.close()
                    if exc.code != 404:
                        raise
            size = os.path.getsize(source)
            with open(source, "rb") as handle:
                self._request("PUT", path, data=handle, size=size).close()
            return True
        except urllib.error.HTTPError as exc:
            exc.close()
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
            self._network_failed(exc)
            return False
