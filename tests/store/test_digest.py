"""`ratchet.store._digest` gives the digests `hashlib` and `hmac` give, byte for byte, on
either side of the size and of the budget where it stops using CPython's builtin SHA-256
for OpenSSL's: receipts, seals and cache keys must not change with the implementation."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest

from ratchet.store import _digest, compute_seal, sha256_bytes, sha256_file
from ratchet.store._digest import (
    BUDGET,
    SMALL,
    compare_digest,
    hmac_sha256_hex,
    sha256,
    sha256_hex,
)

SIZES = [0, 1, 55, 56, 63, 64, 65, 1000, SMALL - 1, SMALL, SMALL + 1, 3 * SMALL + 7]


def _data(size: int) -> bytes:
    return bytes((i * 31 + 7) % 256 for i in range(size))


@pytest.mark.parametrize("spent", [0, BUDGET])
@pytest.mark.parametrize("size", SIZES)
def test_every_digest_is_hashlibs(
    size: int, spent: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_digest, "_spent", spent)
    data = _data(size)
    expected = hashlib.sha256(data).hexdigest()
    assert sha256_hex(data) == sha256_bytes(data) == expected
    assert sha256(data).digest() == hashlib.sha256(data).digest()
    grown = sha256(data[: size // 2], size=size - size // 2)
    grown.update(data[size // 2 :])
    assert grown.hexdigest() == expected
    path = tmp_path / "log"
    path.write_bytes(data)
    assert sha256_file(path) == sha256_file(path, chunk=7) == expected
    key = b"k" * 32
    assert hmac_sha256_hex(key, data) == hmac.new(key, data, hashlib.sha256).hexdigest()


def test_seals_are_unchanged() -> None:
    payload = {"b": [1, 2], "a": "x" * SMALL, "seal": "ignored"}
    body = b'{"a":"' + b"x" * SMALL + b'","b":[1,2]}'
    assert compute_seal(payload) == "sha256:" + hashlib.sha256(body).hexdigest()
    key = b"0123456789abcdef"
    signed = hmac.new(key, body, hashlib.sha256).hexdigest()
    assert compute_seal(payload, key) == "hmac-sha256:" + signed


def test_small_inputs_use_the_builtin_hash_until_the_budget_is_spent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if _digest._builtin is None:
        pytest.skip("this interpreter has no builtin SHA-256 module")
    monkeypatch.setattr(_digest, "_spent", 0)
    openssl = type(hashlib.sha256())
    assert type(sha256(b"x" * SMALL)) is openssl
    assert type(sha256(b"x", size=SMALL - 1)) is openssl
    assert _digest._spent == 0
    while _digest._spent < BUDGET:
        assert type(sha256(b"x" * (SMALL - 1))) is not openssl
    assert type(sha256(b"x")) is openssl


def test_compare_digest_is_hmacs() -> None:
    for a, b in [("sha256:ab", "sha256:ab"), ("sha256:ab", "sha256:ac"), ("", "x")]:
        assert compare_digest(a, b) == hmac.compare_digest(a, b)
    assert compare_digest(b"ab", b"ab") and not compare_digest(b"ab", b"ba")
    for args in [("sha256:é", "sha256:e"), ("x", b"x")]:
        with pytest.raises(TypeError):
            hmac.compare_digest(*args)
        with pytest.raises(TypeError):
            compare_digest(*args)  # type: ignore[call-overload]
