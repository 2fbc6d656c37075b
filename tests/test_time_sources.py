"""Time is an input: nothing in src/ratchet reads a clock or sleeps except through `_clock.py`
(the engine, stores, supervisor and check runner take a `Clock`). An AST scan, so a new direct
call anywhere fails here with its file and line."""

from __future__ import annotations

import ast
import datetime
from pathlib import Path

import pytest

import ratchet
from ratchet._clock import utc_iso

SRC = Path(ratchet.__file__).parent
FORBIDDEN = {
    ("time", "time"),
    ("time", "monotonic"),
    ("time", "perf_counter"),
    ("time", "sleep"),
    ("time", "time_ns"),
    ("time", "monotonic_ns"),
    ("datetime", "now"),
    ("datetime", "utcnow"),
    ("date", "today"),
}
ALLOWED_FILES = {SRC / "_clock.py"}


def direct_clock_reads(path: Path, root: Path = SRC) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if (name, node.func.attr) in FORBIDDEN:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {name}.{node.func.attr}()")
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            bad = {a.name for a in node.names} & {"time", "monotonic", "perf_counter", "sleep"}
            if bad:
                found.append(f"{path.relative_to(root)}:{node.lineno}: from time import {bad}")
    return found


def test_no_clock_is_read_outside_the_clock_module() -> None:
    found = [
        hit
        for path in sorted(SRC.rglob("*.py"))
        if path not in ALLOWED_FILES
        for hit in direct_clock_reads(path)
    ]
    assert found == [], "read time through an injected Clock:\n" + "\n".join(found)


def test_the_scan_finds_a_direct_read(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import time\nimport datetime as dt\nx = time.monotonic()\ny = dt.datetime.now()\n"
    )
    hits = [h.split(": ", 1)[1] for h in direct_clock_reads(probe, tmp_path)]
    assert hits == ["time.monotonic()", "datetime.now()"]


class _At:
    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


@pytest.mark.parametrize(
    "t",
    [0.0, 0.0005, 0.9999995, 1.4999995, 1_800_000_000.0, 1_800_000_000.9999996, 1764630000.1234565],
)
@pytest.mark.parametrize("timespec", ["seconds", "milliseconds", "microseconds"])
def test_utc_iso_says_what_datetime_says(t: float, timespec: str) -> None:
    # utc_iso formats with `time` (so `ratchet checks` never imports datetime); the text,
    # rounding included, is datetime's.
    expected = datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec=timespec)
    assert utc_iso(_At(t), timespec) == expected.replace("+00:00", "Z")
