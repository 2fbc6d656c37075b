"""Durable storage: the safe codec, the SQLite store, atomic files and seals."""

from ratchet.store._files import (
    atomic_json,
    atomic_write_bytes,
    canonical_json,
    compute_seal,
    read_json,
    seal,
    sha256_bytes,
    sha256_file,
    verify_seal,
)

__all__ = [
    "atomic_json",
    "atomic_write_bytes",
    "canonical_json",
    "compute_seal",
    "read_json",
    "seal",
    "sha256_bytes",
    "sha256_file",
    "verify_seal",
]
