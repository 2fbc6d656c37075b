"""The README's agent example runs as printed."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_is_idempotent(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "class Counter(Agent)" in b)
    assert len(example.strip().splitlines()) <= 25
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for _ in range(2):
            namespace: dict[str, object] = {"__name__": "readme_example"}
            exec(compile(example, "README.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    # Keys run concurrently, so only each key's own order is fixed.
    assert sorted((x["key"], x["output"]["label"]) for x in lines) == [
        ("alice", "SEEN 1 TIMES"),
        ("alice", "SEEN 2 TIMES"),
        ("bob", "SEEN 1 TIMES"),
    ]
    assert namespace["result"].inputs == 0  # the second run found everything done
