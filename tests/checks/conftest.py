"""Fixtures for the checks tests: a real workspace of git repositories in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
from checks_helpers import Workspace


@pytest.fixture
def ws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Workspace:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    # The machine-wide resource locks of this test only (not those of other test runs).
    monkeypatch.setenv("RATCHET_CHECKS_LOCK_DIR", str(tmp_path / "machine-locks"))
    return Workspace(tmp_path)


@pytest.fixture
def two_repos(ws: Workspace) -> Workspace:
    """Repositories `app` and `lib`, one file each (plus a nested one in app)."""
    ws.repo("app", {"main.py": "print('app')\n", "pkg/util.py": "X = 1\n"})
    ws.repo("lib", {"lib.py": "Y = 2\n"})
    return ws
