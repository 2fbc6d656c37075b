"""Logs: `-v` and `--log-format json` work before or after the command; the engine logs its
life (start or restore with counts, stop with counts) and a supervised worker inherits both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ratchet.cli import _global_flags

RATCHET = [sys.executable, "-m", "ratchet.cli"]
AGENT = f"{Path(__file__).parent / 'kill' / 'io_agent.py'}:Relay"


def test_global_flags_move_in_front_of_the_command() -> None:
    assert _global_flags(["run", "x", "-v", "--log-format", "json", "--key", "k"]) == [
        "-v", "--log-format", "json", "run", "x", "--key", "k",
    ]  # fmt: skip
    assert _global_flags(["run", "--log-format=json", "--", "-v"]) == [
        "--log-format=json", "run", "--", "-v",
    ]  # fmt: skip


def test_json_logs_after_the_command_tell_the_engine_s_life(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"key": "a", "i": 1}\n{"key": "b", "i": 2}\n')
    cmd = [
        *RATCHET, "run", AGENT, "--input", str(tmp_path / "in.jsonl"), "--output",
        str(tmp_path / "o.jsonl"), "--state", str(tmp_path / "s"), "-v", "--log-format", "json",
    ]  # fmt: skip
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    lines = [json.loads(x) for x in first.stderr.splitlines()]
    messages = [x["message"] for x in lines if x["logger"] == "ratchet.engine"]
    assert messages[0].startswith("started ") and "on a new state" in messages[0]
    assert messages[-1] == (
        "stopped (end of input): 2 input(s), 2 run(s) completed (0 ended in error), 2 output(s)"
    )
    assert {x["level"] for x in lines} <= {"info", "warning", "debug"}
    again = subprocess.run(cmd[:-3], capture_output=True, text=True, timeout=60)  # text, no -v
    assert again.returncode == 0 and again.stderr == ""
    verbose = subprocess.run([*cmd[:-3], "-v"], capture_output=True, text=True, timeout=60)
    assert "INFO ratchet.engine: restored checkpoint" in verbose.stderr


def test_a_supervised_worker_logs_as_its_supervisor_was_told() -> None:
    from ratchet.cli import _agents, build_parser

    argv = _global_flags(
        ["run", "a.py:A", "--input", "i", "--output", "o", "--state", "s", "--supervise",
         "-v", "--log-format", "json"]
    )  # fmt: skip
    worker = _agents._worker_argv(build_parser("run").parse_args(argv))
    assert worker[3:6] == ["-v", "--log-format", "json"] and worker[6] == "run"


def test_a_reader_that_goes_away_is_not_an_error(tmp_path: Path) -> None:
    import ratchet
    from ratchet import Agent, InputEvent, action

    class Keep(Agent):
        @action(InputEvent)
        def keep(self, event: InputEvent, ctx: object) -> None:
            ctx.short_term_memory.set("text", "x" * 100)  # type: ignore[attr-defined]

    rows = [{"key": f"k{i}"} for i in range(3000)]
    ratchet.run(Keep(), inputs=rows, output=tmp_path / "o.jsonl", state_dir=tmp_path / "s")
    proc = subprocess.Popen(
        [*RATCHET, "inspect", "--state", str(tmp_path / "s"), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdout.read(10)
    # Like `| head -c 10`: the output (one 300 KB line) outlives its reader. (`readline`
    # read all of it, so the pipe never closed under the writer.)
    proc.stdout.close()
    assert proc.stderr is not None
    with proc.stderr:
        err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and b"Traceback" not in err, err


def test_json_logs_hold_the_commands_own_lines_too(tmp_path: Path) -> None:
    # "--workers auto: ..." and "restored savepoint ..." were plain lines among the JSON ones.
    (tmp_path / "in.jsonl").write_text('{"key": "a", "i": 1}\n')
    cmd = [*RATCHET, "--log-format", "json", "run", AGENT, "--input", str(tmp_path / "in.jsonl"),
           "--output", str(tmp_path / "o.jsonl"), "--state", str(tmp_path / "s"),
           "--workers", "auto"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in done.stderr.splitlines()]  # every line is JSON
    said = [x["message"] for x in lines if x["logger"] == "ratchet.cli.course"]
    assert len(said) == 1 and said[0].startswith("--workers auto: 1 ("), lines
