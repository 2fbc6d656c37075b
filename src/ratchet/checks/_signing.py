"""The receipt signing key: where it comes from, and what it signs and hashes.

With a key configured, every receipt's seal is an HMAC-SHA256 under it, and a receipt whose
seal is not (an unsigned one, or one signed with another key) is refused. The key is read
from `RATCHET_CHECKS_SIGNING_KEY` (the key itself) or `RATCHET_CHECKS_SIGNING_KEY_FILE` (a
file holding it); it is never written to a receipt and never passed to a stage.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ratchet._errors import ConfigError
from ratchet.store._digest import hmac_sha256_hex, sha256_hex

__all__ = [
    "CACHE_TOKEN_ENV",
    "KEY_ENV",
    "KEY_FILE_ENV",
    "MIN_KEY_BYTES",
    "SECRET_ENV",
    "hash_value",
    "signing_key",
]

KEY_ENV = "RATCHET_CHECKS_SIGNING_KEY"
KEY_FILE_ENV = "RATCHET_CHECKS_SIGNING_KEY_FILE"
CACHE_TOKEN_ENV = "RATCHET_CHECKS_CACHE_TOKEN"  # the cache server's write token
# never passed to a stage, never fingerprinted
SECRET_ENV = (KEY_ENV, KEY_FILE_ENV, CACHE_TOKEN_ENV)
MIN_KEY_BYTES = 16


def signing_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The configured key, or None. A key that is set but unusable is an error, not a
    quiet fallback to unsigned receipts."""
    env = os.environ if environ is None else environ
    value, path = env.get(KEY_ENV), env.get(KEY_FILE_ENV)
    if value and path:
        raise ConfigError(f"both {KEY_ENV} and {KEY_FILE_ENV} are set: set only one of them")
    if path:
        try:
            with open(path, "rb") as handle:
                key = handle.read().strip()
        except OSError as exc:
            raise ConfigError(
                f"{KEY_FILE_ENV}={path}: the signing key file cannot be read ({exc.strerror}); "
                "fix the path or its permissions"
            ) from exc
        source = f"{KEY_FILE_ENV} ({path})"
    elif value:
        key, source = value.encode("utf-8"), KEY_ENV
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"the signing key from {source} is {len(key)} bytes; use at least {MIN_KEY_BYTES} "
            "random bytes (e.g. `openssl rand -hex 32`)"
        )
    return key


def hash_value(value: str, key: bytes | None) -> str:
    """An environment value as the receipt keeps it: a digest, never the value (an HMAC under
    the signing key when there is one, so a short secret cannot be guessed from it)."""
    data = value.encode("utf-8", "surrogateescape")
    if key is None:
        return "sha256:" + sha256_hex(data)
    return "hmac-sha256:" + hmac_sha256_hex(key, data)
