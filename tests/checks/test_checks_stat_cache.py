"""Issue 17: the stat cache is a speed-up that fails closed.

A file's remembered identity is used only for exactly the same (device, inode, size,
mtime_ns, ctime_ns), only once the file had been still for RACY_SECONDS when it was
hashed, and only from a cache file whose seal (or signature) verifies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ratchet.checks.checkpoints import RACY_SECONDS, StatCache, _entry, seal_stat_cache
from ratchet.testing import FakeClock


def _later(path: Path) -> FakeClock:
    """A clock well past the file's last change: the file counts as settled."""
    return FakeClock(start=os.stat(path).st_ctime + 10 * RACY_SECONDS)


def _poison(cache_file: Path, path: Path, identity: str, *, key: bytes | None = None) -> None:
    """Edit one remembered identity and seal the file again (under `key`, or unkeyed)."""
    entries = json.loads(cache_file.read_bytes().partition(b"\n")[2])
    entries[str(path)] = entries[str(path)].rsplit(" ", 1)[0] + " " + identity
    cache_file.write_bytes(seal_stat_cache(entries, key))


def test_a_settled_file_is_remembered_and_any_change_to_it_is_seen(tmp_path: Path) -> None:
    f = tmp_path / "a.py"
    f.write_text("one\n")
    cache_file = tmp_path / "stat-cache.json"
    cache = StatCache(cache_file, _later(f))
    assert cache.entry(str(f), str(tmp_path)) == _entry(str(f))
    cache.save()
    # Show that the remembered identity is what a fresh cache answers with, unread.
    _poison(cache_file, f, "sha256:remembered")
    assert StatCache(cache_file, _later(f)).entry(str(f), str(tmp_path)) == "sha256:remembered"
    f.write_text("two\n")  # same size; mtime/ctime move
    fresh = StatCache(cache_file, _later(f))
    assert fresh.entry(str(f), str(tmp_path)) == _entry(str(f))
    assert _entry(str(f)).startswith("sha256:")


def test_a_racy_file_is_never_remembered(tmp_path: Path) -> None:
    f = tmp_path / "a.py"
    f.write_text("one\n")
    cache_file = tmp_path / "stat-cache.json"
    just_now = FakeClock(start=os.stat(f).st_ctime + RACY_SECONDS / 2)
    cache = StatCache(cache_file, just_now)
    cache.entry(str(f), str(tmp_path))
    cache.save()
    assert not cache_file.exists()  # nothing learned that could be trusted


@pytest.mark.parametrize("keyed", [False, True], ids=["unsigned", "signed"])
def test_a_stat_cache_that_does_not_verify_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyed: bool
) -> None:
    if keyed:
        monkeypatch.setenv("RATCHET_CHECKS_SIGNING_KEY", "k" * 32)
    f = tmp_path / "a.py"
    f.write_text("one\n")
    cache_file = tmp_path / "stat-cache.json"
    cache = StatCache(cache_file, _later(f))
    cache.entry(str(f), str(tmp_path))
    cache.save()
    # Someone who can write the state folder (but has no key) edits an identity.
    _poison(cache_file, f, "sha256:forged")
    if not keyed:  # without a key only a broken seal gives it away
        head, _, body = cache_file.read_bytes().partition(b"\n")
        broken = {**json.loads(head), "seal": "sha256:" + "0" * 64}
        cache_file.write_bytes(json.dumps(broken).encode() + b"\n" + body)
    assert StatCache(cache_file, _later(f)).entry(str(f), str(tmp_path)) == _entry(str(f))
