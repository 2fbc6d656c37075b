"""Suite-wide hooks.

`make test` asks for proof that pytest finished its session: a test that ends the process
(`os._exit` in code under test) would otherwise stop the run with exit code 0 and every
later test unrun. `RATCHET_TEST_FINISHED` names the file written when the session ends.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    finished = os.environ.get("RATCHET_TEST_FINISHED")
    if finished:
        Path(finished).write_text(f"{int(exitstatus)} {session.testscollected}\n")
