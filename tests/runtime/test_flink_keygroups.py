"""Flink's key groups computed without a JVM (`runtime/_flink_keygroups.py`). The vectors were
read from Flink 2.3's `KeyGroupRangeAssignment.assignToKeyGroup(Row.of(key), n)` through
PyFlink's gateway; `tests/flink/test_keygroups.py` compares against the JVM itself."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratchet.runtime._flink_keygroups import (
    WAKE_PREFIX,
    java_string_hash,
    key_group,
    key_group_range,
    wake_key,
)

JVM = [  # (key, Row hash, group of 128, group of 4096)
    ("abc", 96416, 68, 1348),
    ("", 62, 33, 3233),
    ("f0", 3272, 11, 11),
    ("\x00i:5", 102818, 126, 1790),
    ("é", 295, 106, 1514),
    ("日本", 835109, 85, 2901),
    ("😀x", 54960051, 17, 3089),
]


@pytest.mark.parametrize(("key", "row_hash", "g128", "g4096"), JVM)
def test_key_groups_match_the_jvm(key: str, row_hash: int, g128: int, g4096: int) -> None:
    assert 62 + java_string_hash(key) == row_hash
    assert key_group(key, 128) == g128
    assert key_group(key, 4096) == g4096


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.sampled_from([128, 256, 4096]))
def test_subtask_ranges_cover_every_group_once(parallelism: int, max_par: int) -> None:
    parallelism = min(parallelism, max_par)
    seen = [g for i in range(parallelism) for g in key_group_range(max_par, parallelism, i)]
    assert seen == list(range(max_par))


@pytest.mark.parametrize("max_par", [128, 4096])
def test_each_group_has_a_reserved_wake_key_in_that_group(max_par: int) -> None:
    keys = [wake_key(g, max_par) for g in range(max_par)]
    assert all(k.startswith(WAKE_PREFIX) for k in keys)
    assert [key_group(k, max_par) for k in keys] == list(range(max_par))
