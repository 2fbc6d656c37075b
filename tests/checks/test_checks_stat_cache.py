"""Issue 17: the stat cache and the tree cache are speed-ups that fail closed.

A file's remembered identity is used only for exactly the same (device, inode, size,
mtime_ns, ctime_ns), only once the file had been still for RACY_SECONDS when it was
hashed, and only from a cache file whose seal (or signature) verifies. A repository's
remembered digest (the tree cache) is used only for the same `git ls-files` listing and
the same lstat signature of every listed file, all of them plain, settled files.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from ratchet.checks.checkpoints import (
    RACY_SECONDS,
    Checkpoints,
    StatCache,
    _entry,
    seal_stat_cache,
)
from ratchet.store import canonical_json
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


# --- the tree cache: a whole repository's digest by its listing and every file's lstat ---


def _git_repo(tmp_path: Path, files: dict[str, str]) -> Path:
    repo = tmp_path / "ws" / "app"
    repo.mkdir(parents=True)
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    return repo  # untracked files are listed (`--others`) as tracked ones are


def _prober(repo: Path, state: Path, clock: FakeClock) -> Checkpoints:
    return Checkpoints(repo.parent, {"app": repo}, state, clock=clock)


def _settled(repo: Path) -> FakeClock:
    newest = max(os.lstat(p).st_ctime for p in [repo, *repo.rglob("*")])
    return FakeClock(start=newest + 10 * RACY_SECONDS)


def _forge_tree_records(state: Path, digest: str, key: bytes | None = None) -> int:
    """Replace the digest in every tree cache record and seal it again (under `key`)."""
    records = list((state / "tree-cache").glob("*.json"))
    for record in records:
        body = json.loads(record.read_bytes().partition(b"\n")[2])
        body["digest"] = digest
        data = canonical_json(body)
        if key is None:
            seal = "sha256:" + hashlib.sha256(data).hexdigest()
        else:
            seal = "hmac-sha256:" + hmac.new(key, data, hashlib.sha256).hexdigest()
        record.write_bytes(canonical_json({"seal": seal}) + b"\n" + data)
    return len(records)


FORGED = "f" * 64


def _chmod_x(repo: Path) -> None:
    (repo / "a.py").chmod(0o755)


def _same_size_edit(repo: Path) -> None:
    (repo / "a.py").write_text("two\n")


def _add_untracked(repo: Path) -> None:
    (repo / "new.py").write_text("new\n")


def _remove(repo: Path) -> None:
    (repo / "pkg" / "b.py").unlink()


def _touch(repo: Path) -> None:
    os.utime(repo / "a.py", ns=(1, 1))  # same bytes, same size; mtime and ctime move


def _replace_by_copy(repo: Path) -> None:
    data = (repo / "a.py").read_bytes()
    (repo / "a.py").unlink()
    (repo / "a.py").write_bytes(data)  # same bytes: a new inode


@pytest.mark.parametrize(
    "change",
    [_same_size_edit, _add_untracked, _remove, _chmod_x, _touch, _replace_by_copy],
)
def test_the_tree_cache_answers_for_an_unchanged_repository_and_misses_on_any_change(
    tmp_path: Path, change: Callable[[Path], None]
) -> None:
    repo = _git_repo(tmp_path, {"a.py": "one\n", "pkg/b.py": "b\n"})
    state = tmp_path / "state"
    digest = _prober(repo, state, _settled(repo)).repository_digest("app")
    assert _forge_tree_records(state, FORGED) == 1
    # A sealed record is what a no-op probe answers with, without building the manifest.
    assert _prober(repo, state, _settled(repo)).repository_digest("app") == FORGED
    change(repo)
    prober = _prober(repo, state, _settled(repo))
    got = prober.repository_digest("app")
    assert got != FORGED
    assert got == prober._build("app", fast=False)[0]  # what a full read says
    if change is _touch or change is _replace_by_copy:
        assert got == digest  # the same bytes: the same digest, only re-read


def test_a_repository_with_a_racy_file_gets_no_tree_record(tmp_path: Path) -> None:
    repo = _git_repo(tmp_path, {"a.py": "one\n"})
    state = tmp_path / "state"
    just_now = FakeClock(start=os.lstat(repo / "a.py").st_ctime + RACY_SECONDS / 2)
    _prober(repo, state, just_now).repository_digest("app")
    assert _forge_tree_records(state, FORGED) == 0


@pytest.mark.parametrize("extra", ["symlink", "nested-repo", "ignored-repo"])
def test_a_tree_record_needs_every_listed_file_to_be_a_plain_file(
    tmp_path: Path, extra: str
) -> None:
    repo = _git_repo(tmp_path, {"a.py": "one\n"})
    if extra == "symlink":  # a link's identity may follow a target outside the repository
        os.symlink(tmp_path / "outside.txt", repo / "link")
        (tmp_path / "outside.txt").write_text("outside\n")
    elif extra == "nested-repo":  # listed as a directory: its files are another listing
        _git_repo(tmp_path / "app" / "nested", {"n.py": "n\n"})
        os.rename(tmp_path / "app" / "nested" / "ws" / "app", repo / "nested")
    else:  # git lists nothing; every file is walked, which no listing can vouch for
        (repo / ".gitignore").write_text("*\n")
    state = tmp_path / "state"
    prober = _prober(repo, state, _settled(repo))
    assert prober.repository_digest("app") == prober._build("app", fast=False)[0]
    assert _forge_tree_records(state, FORGED) == 0


@pytest.mark.parametrize("keyed", [False, True], ids=["unsigned", "signed"])
def test_a_tree_record_that_does_not_verify_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keyed: bool
) -> None:
    key = b"k" * 32
    if keyed:
        monkeypatch.setenv("RATCHET_CHECKS_SIGNING_KEY", key.decode())
    repo = _git_repo(tmp_path, {"a.py": "one\n"})
    state = tmp_path / "state"
    digest = _prober(repo, state, _settled(repo)).repository_digest("app")
    if keyed:  # someone without the key seals a forged record the unkeyed way
        _forge_tree_records(state, FORGED)
    else:  # someone edits the digest without sealing it again
        for record in (state / "tree-cache").glob("*.json"):
            record.write_bytes(record.read_bytes().replace(digest.encode(), FORGED.encode()))
    assert _prober(repo, state, _settled(repo)).repository_digest("app") == digest
    if keyed:  # and a record signed with the key is used
        _forge_tree_records(state, FORGED, key)
        assert _prober(repo, state, _settled(repo)).repository_digest("app") == FORGED
