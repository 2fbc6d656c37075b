"""What mypy infers for users: `durable_execute_async` gives the awaited type of an async
function and the return type of a sync one; the package ships py.typed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import ratchet

SAMPLE = """
from typing import Any
from ratchet import RunnerContext

async def fetch(n: int) -> dict[str, int]:
    return {"n": n}

def compute(n: int) -> list[str]:
    return [str(n)]

async def action(ctx: RunnerContext) -> None:
    a = await ctx.durable_execute_async(fetch, 1)
    b = await ctx.durable_execute_async(compute, 2)
    c = ctx.durable_execute(compute, 3)
    reveal_type(a)
    reveal_type(b)
    reveal_type(c)
"""


def test_py_typed_ships_with_the_package() -> None:
    assert (Path(ratchet.__file__).parent / "py.typed").exists()


def test_durable_execute_async_infers_the_awaited_type(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(SAMPLE)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(sample)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    revealed = re.findall(r'Revealed type is "([^"]+)"', proc.stdout)
    plain = [t.replace("builtins.", "") for t in revealed]
    assert plain == ["dict[str, int]", "list[str]", "list[str]"], proc.stdout + proc.stderr
