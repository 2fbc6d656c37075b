"""SHA-256 without loading OpenSSL for the small inputs of a short command.

`hashlib.sha256` is OpenSSL's: the first `import hashlib` (or `hmac`) loads `_hashlib` and
libcrypto, 2-3 ms of every `ratchet checks` start-up, while a no-op run hashes about half a
megabyte in pieces under 64 KiB (seals, `git ls-files` listings, lstat signatures, small
logs). CPython's own `_sha256` module computes the same digest (SHA-256 is one function)
and loads in 0.2 ms, but is about 5x slower per byte (330 MB/s against OpenSSL's 1.9 GB/s
here): 2.5 ns more per byte, so hashing `BUDGET` bytes with it costs about what loading
OpenSSL does. An input under `SMALL` bytes therefore goes to `_sha256` until the process
has hashed `BUDGET` bytes that way; anything larger, and everything after, to OpenSSL,
imported on first use. A run that hashes files by the gigabyte loses at most those 2-3 ms;
a no-op never loads OpenSSL. Keyed digests (HMAC) import `hmac` on first use.
"""

from __future__ import annotations

from collections.abc import Callable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from _hashlib import _HashObject as Hasher

__all__ = ["BUDGET", "SMALL", "compare_digest", "hmac_sha256_hex", "sha256", "sha256_hex"]

SMALL = 64 * 1024  # an input this large goes to OpenSSL
BUDGET = 1 << 20  # the bytes a process hashes with `_sha256` before it uses OpenSSL only
_spent = 0  # updated without a lock: threads may overshoot the budget a little, harmlessly

_builtin: Callable[[bytes], Hasher] | None
try:
    from _sha256 import sha256 as _builtin  # type: ignore[import-not-found,no-redef,unused-ignore]
except ImportError:  # CPython 3.12 and later name it `_sha2`; a build may have neither
    try:
        from _sha2 import sha256 as _builtin  # type: ignore[import-not-found,no-redef,unused-ignore]
    except ImportError:
        _builtin = None

try:
    # What `hmac.compare_digest` is (hmac takes it from `_hashlib` when OpenSSL is there):
    # a comparison in constant time, the same errors for the same arguments.
    from _operator import _compare_digest as compare_digest
except ImportError:  # not CPython
    from hmac import compare_digest  # type: ignore[assignment,no-redef,unused-ignore]


def sha256(data: bytes = b"", size: int = 0) -> Hasher:
    """A SHA-256 object over `data`, to be fed about `size` bytes more: the builtin one for
    a whole under `SMALL` bytes while the budget lasts, else OpenSSL's."""
    global _spent
    whole = len(data) + size
    if _builtin is not None and whole < SMALL and _spent < BUDGET:
        _spent += whole
        return _builtin(data)
    import hashlib

    return hashlib.sha256(data)


def sha256_hex(data: bytes) -> str:
    """The hex SHA-256 of `data`."""
    return sha256(data).hexdigest()


def hmac_sha256_hex(key: bytes, data: bytes) -> str:
    """The hex HMAC-SHA256 of `data` under `key`."""
    import hashlib
    import hmac

    return hmac.new(key, data, hashlib.sha256).hexdigest()
