"""Half a UTF-16 pair in a JSON input ("\\ud800"): valid JSON to Python's reader, but no UTF-8
text can hold it.

In a key it was admitted and then failed every checkpoint (the state keeps keys as text), so
the job stopped and every restart stopped the same way, `--on-bad-input skip` or not, with
nothing before it committed. In a value an output echoes, the JSONL sink's write failed at
every release and held back every output of the job, exit 1 on every run. `inspect --json`
printed a traceback for such a value in memory.

Now the key is a bad input (its policy applies: exit 3 naming the line, or skipped), and the
output is replaced by an error record under its id (as any output a sink cannot write), with
one and two workers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

RATCHET = [sys.executable, "-m", "ratchet.cli"]
AGENT_SRC = """
from ratchet import Agent, InputEvent, OutputEvent, action

class Echo(Agent):
    @action(InputEvent, inline=True)
    def echo(self, event, ctx):
        ctx.short_term_memory.set("p", event.input.get("p"))
        ctx.send_event(OutputEvent(output={"i": event.input["i"], "p": event.input.get("p")}))
"""


def job(tmp: Path, lines: list[str], *extra: str) -> subprocess.CompletedProcess[str]:
    (tmp / "agent.py").write_text(AGENT_SRC)
    (tmp / "in.jsonl").write_text("".join(line + "\n" for line in lines))
    argv = [*RATCHET, "run", f"{tmp / 'agent.py'}:Echo", "--input", str(tmp / "in.jsonl"),
            "--output", str(tmp / "out.jsonl"), "--state", str(tmp / "state"), *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def outputs(tmp: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp / "out.jsonl").read_text().splitlines()]


def test_a_key_holding_half_a_pair_is_a_bad_input(tmp_path: Path) -> None:
    lines = ['{"key": "a", "i": 0}', '{"key": "\\ud800", "i": 1}', '{"key": "b", "i": 2}']
    done = job(tmp_path, lines)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    said = [x for x in done.stderr.splitlines() if x.startswith("ratchet: bad input:")]
    assert said, done.stderr
    assert "in.jsonl:2: key field 'key' holds a lone surrogate (\\ud800" in said[0], said
    assert [o["output"]["i"] for o in outputs(tmp_path)] == [0]  # what came before: committed
    skipped = job(tmp_path, lines, "--on-bad-input", "skip")
    assert skipped.returncode == 0, skipped.stderr
    assert sorted(o["output"]["i"] for o in outputs(tmp_path)) == [0, 2]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_output_holding_half_a_pair_is_an_error_record_and_holds_back_nothing(
    tmp_path: Path, workers: str
) -> None:
    lines = [json.dumps({"key": f"k{i % 3}", "i": i, "p": "ok"}) for i in range(6)]
    lines[3] = '{"key": "k0", "i": 3, "p": "x\\udfffy"}'
    done = job(tmp_path, lines, "--workers", workers)
    assert done.returncode == 0, done.stderr
    got = {o["id"]: o for o in outputs(tmp_path)}
    assert len(got) == 6, got
    bad = [o for o in got.values() if o.get("error")]
    assert len(bad) == 1 and bad[0]["key"] == "k0", bad
    assert "output['p'] holds a lone surrogate (\\udfff" in bad[0]["error"]["message"], bad
    assert sorted(o["output"]["i"] for o in got.values() if not o.get("error")) == [0, 1, 2, 4, 5]
    if workers == "1":
        shown = subprocess.run(
            [*RATCHET, "inspect", "--state", str(tmp_path / "state"), "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        # k0's last input (i = 3) left the value in memory: shown by its JSON escape.
        assert json.loads(shown.stdout)["k0"]["p"] == "x\udfffy"
