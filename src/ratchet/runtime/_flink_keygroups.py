"""Flink's key groups for the keys PyFlink keys a stream by, and the reserved wake keys.

A keyed Flink operator owns a range of key groups; a key's group is fixed by a hash of the key
as the JVM sees it. PyFlink's `key_by` keys a stream by a `Row` holding the key, so for a
string key `s` the JVM hashes `Row(s)`: `62 + String.hashCode(s)` (a Row's hash starts from
its kind and its field array), then Flink's murmur mix, modulo the maximum parallelism.
`tests/flink/test_keygroups.py` checks this against the JVM's own `KeyGroupRangeAssignment`.

The Flink engine keeps, per key group, a registry of the keys with work under a reserved key
of that same group (`wake_key`): it moves with its keys when a job is rescaled, and a worker
reads the registries of the groups it owns after a restore (see `flink/_function.py`).
"""

from __future__ import annotations

from functools import lru_cache

_M32 = 0xFFFFFFFF

# Reserved Flink keys of the wake registries: user string keys starting with NUL are refused
# (`flink_key`), integer keys start with "\x00i:".
WAKE_PREFIX = "\x00w:"


def _i32(x: int) -> int:
    x &= _M32
    return x - (1 << 32) if x & 0x80000000 else x


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


def java_string_hash(s: str) -> int:
    """`String.hashCode()`: over UTF-16 code units (a character outside the BMP counts twice)."""
    h = 0
    b = s.encode("utf-16-be", "surrogatepass")
    for i in range(0, len(b), 2):
        h = (31 * h + ((b[i] << 8) | b[i + 1])) & _M32
    return _i32(h)


def _murmur(code: int) -> int:
    """Flink's `MathUtils.murmurHash(int)`: a non-negative int."""
    code = (code * 0xCC9E2D51) & _M32
    code = _rotl(code, 15)
    code = (code * 0x1B873593) & _M32
    code = _rotl(code, 13)
    code = (code * 5 + 0xE6546B64) & _M32
    code ^= 4
    code ^= code >> 16
    code = (code * 0x85EBCA6B) & _M32
    code ^= code >> 13
    code = (code * 0xC2B2AE35) & _M32
    code ^= code >> 16
    signed = _i32(code)
    if signed >= 0:
        return signed
    return -signed if signed != -(1 << 31) else 0


def key_group(fkey: str, max_parallelism: int) -> int:
    """The key group of the Flink (string) key `fkey` in a job of this maximum parallelism."""
    return _murmur(_i32(62 + java_string_hash(fkey))) % max_parallelism


def key_group_range(max_parallelism: int, parallelism: int, index: int) -> range:
    """The key groups subtask `index` of `parallelism` owns (Flink's
    `computeKeyGroupRangeForOperatorIndex`)."""
    start = (index * max_parallelism + parallelism - 1) // parallelism
    end = ((index + 1) * max_parallelism - 1) // parallelism
    return range(start, end + 1)


@lru_cache(maxsize=8)
def _wake_keys(max_parallelism: int) -> tuple[str, ...]:
    found: dict[int, str] = {}
    n = 0
    while len(found) < max_parallelism:
        k = f"{WAKE_PREFIX}{n}"
        found.setdefault(key_group(k, max_parallelism), k)
        n += 1
    return tuple(found[g] for g in range(max_parallelism))


def wake_key(group: int, max_parallelism: int) -> str:
    """The reserved key, in key group `group`, under which that group's wake registry lives."""
    return _wake_keys(max_parallelism)[group]
