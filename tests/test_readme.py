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


def test_readme_cli_commands_run_as_written_after_the_python_example(tmp_path: Path) -> None:
    # As a newcomer follows the page: the Python example first (`python my_agents.py`), then
    # the shell lines as written. They reused its state and output (both refused, exit 2)
    # and never showed events.jsonl. `ratchet run my_agents.py:Counter` imports the file: its
    # inline job must not run again then.
    (tmp_path / "my_agents.py").write_text(_example())
    first = subprocess.run([sys.executable, "my_agents.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert first.returncode == 0, first.stderr
    inline_out = (tmp_path / "out.jsonl").read_text()
    block = re.search(r"```sh\n(printf .*?\nratchet run my_agents\.py:Counter .*?)\n```",
                      README.read_text(), re.S)  # fmt: skip
    assert block is not None
    printf, command = block.group(1).splitlines()
    subprocess.run(printf, shell=True, cwd=tmp_path, check=True)
    args = command.removeprefix("ratchet run ").split()
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "run", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.jsonl").read_text() == inline_out  # the inline job did not run
    lines = [json.loads(x) for x in (tmp_path / "cli-out.jsonl").read_text().splitlines()]
    assert sorted((x["output"]["key"], x["output"]["label"]) for x in lines) == [
        ("alice", "SEEN 1 TIMES"),
        ("alice", "SEEN 2 TIMES"),
        ("bob", "SEEN 1 TIMES"),
    ]
