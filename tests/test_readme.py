"""The README's agent example runs as printed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return next(b for b in blocks if "class Counter(Agent)" in b)


def test_readme_example_runs_and_is_idempotent(tmp_path: Path) -> None:
    example = _example()
    assert len(example.strip().splitlines()) <= 25
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for _ in range(2):
            namespace: dict[str, object] = {"__name__": "__main__"}
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


def test_readme_cli_command_runs_only_the_agent(tmp_path: Path) -> None:
    # `ratchet run my_agents.py:Counter` imports the file: its inline job must not run too
    # (it wrote out.jsonl and .ratchet-state of its own at import).
    (tmp_path / "my_agents.py").write_text(_example())
    (tmp_path / "events.jsonl").write_text('{"key": "carol"}\n')
    command = re.search(r"^ratchet run (my_agents\.py:Counter .*)$", README.read_text(), re.M)
    assert command is not None
    args = command.group(1).replace("out.jsonl", "cli.jsonl").replace(".ratchet-state", "st")
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "run", *args.split()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "out.jsonl").exists()
    assert not (tmp_path / ".ratchet-state").exists()
    lines = [json.loads(x) for x in (tmp_path / "cli.jsonl").read_text().splitlines()]
    assert [x["output"] for x in lines] == [{"key": "carol", "label": "SEEN 1 TIMES"}]
