"""An output file the input also reads is refused before anything runs: otherwise every
output comes back as a new input (each run adds work; with --follow it never ends)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ratchet
from ratchet._errors import EXIT_OK, EXIT_USAGE

RATCHET = [sys.executable, "-m", "ratchet.cli"]
ECHO = (
    "from ratchet import Agent, InputEvent, OutputEvent, action\n"
    "class Echo(Agent):\n"
    "    @action(InputEvent, inline=True)\n"
    "    def echo(self, event, ctx):\n"
    "        ctx.send_event(OutputEvent(output=event.input))\n"
)


def run(tmp_path: Path, inp: str, out: str, *extra: str) -> subprocess.CompletedProcess[str]:
    agent = tmp_path / "echo_agent.py"
    agent.write_text(ECHO)
    argv = [*RATCHET, "run", f"{agent}:Echo", "--input", inp, "--output", out]
    argv += ["--state", str(tmp_path / "state"), *extra]
    # A timeout, not a hang, if the refusal is ever lost (the --follow case ran forever).
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)


def refused(proc: subprocess.CompletedProcess[str], out: str) -> None:
    assert proc.returncode == EXIT_USAGE, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"ratchet: error: --output {out} ")
    assert "read back as a new input" in lines[0]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_output_matched_by_the_input_pattern_is_refused(tmp_path: Path, workers: str) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "a.jsonl").write_text('{"key": "a"}\n')
    # Not there yet (the first run creates it): refused by the pattern itself.
    proc = run(tmp_path, "logs/*.jsonl", "logs/out.jsonl", "--workers", workers)
    refused(proc, "logs/out.jsonl")
    assert not (tmp_path / "state").exists() and not (tmp_path / "logs" / "out.jsonl").exists()


def test_an_existing_output_in_an_input_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "a.jsonl").write_text('{"key": "a"}\n')
    (tmp_path / "logs" / "out.jsonl").write_text("")
    refused(run(tmp_path, "logs", "logs/out.jsonl"), "logs/out.jsonl")
    # Also named through another path to the same file.
    (tmp_path / "alias").symlink_to(tmp_path / "logs")
    refused(run(tmp_path, "logs", "alias/out.jsonl"), "alias/out.jsonl")


def test_an_input_folder_named_through_a_symlink_is_matched_by_what_it_points_at(
    tmp_path: Path,
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.jsonl").write_text('{"key": "a"}\n')
    (tmp_path / "link").symlink_to(tmp_path / "real")
    # The output does not exist yet: matched by the pattern, its folder resolved.
    refused(run(tmp_path, "link", "real/out.jsonl"), "real/out.jsonl")
    refused(run(tmp_path, "link/*.jsonl", "real/../real/out.jsonl"), "real/../real/out.jsonl")


def test_the_input_file_as_the_output_is_refused_also_when_empty_and_followed(
    tmp_path: Path,
) -> None:
    (tmp_path / "e.jsonl").write_text("")
    refused(run(tmp_path, "e.jsonl", "e.jsonl", "--follow"), "e.jsonl")
    refused(run(tmp_path, "e.jsonl", "./e.jsonl"), "./e.jsonl")


def test_an_output_beside_the_inputs_that_the_pattern_does_not_match_runs(
    tmp_path: Path,
) -> None:
    for inp, out in (("p/*.jsonl", "p/out.json"), ("d", "d/.out.jsonl")):  # * skips a dot
        (tmp_path / inp.split("/")[0]).mkdir()
        (tmp_path / inp.split("/")[0] / "a.jsonl").write_text('{"key": "a"}\n')
        proc = run(tmp_path, inp, out)
        assert proc.returncode == EXIT_OK, proc.stderr
        assert len((tmp_path / out).read_text().splitlines()) == 1
        shutil.rmtree(tmp_path / "state")


def test_the_python_api_refuses_it_too(tmp_path: Path) -> None:
    class Echo(ratchet.Agent):
        @ratchet.action(ratchet.InputEvent, inline=True)
        def echo(self, event: ratchet.InputEvent, ctx: ratchet.RunnerContext) -> None:
            ctx.send_event(ratchet.OutputEvent(output=event.input))

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"key": "a"}\n')
    for workers in (1, 2):  # refused before a state, a layout or a shard is made
        with pytest.raises(ratchet.ConfigError, match="read back as a new input"):
            ratchet.run(
                Echo(), inputs=tmp_path / "in", output=tmp_path / "in" / "o.jsonl",
                state_dir=tmp_path / "state", workers=workers,
            )  # fmt: skip
        assert not (tmp_path / "state").exists()
