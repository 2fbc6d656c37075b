"""Input parity with the embedded engine on a local mini-cluster: bad lines follow
`--on-bad-input` with the same exit codes and a message on the command's stderr; the integer
key 1 and the string key "1" stay two keys; `--max-concurrent-runs` is accepted and honoured."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet._errors import EXIT_BAD_INPUT  # noqa: E402
from ratchet.flink import read_output_dir  # noqa: E402

from .support import AGENTS, CLI, flink_env, flink_memory, run_cli  # noqa: E402

pytestmark = pytest.mark.flink

LINES = [
    '{"key": 1, "v": 1}',
    '{"key": "1", "v": 2}',
    "not json",
    '{"key": 1, "v": 3}',
    '{"nokey": 1}',
    '{"key": "a", "v": 4}',
    '{"key": 1, "v": 5}',
]


def test_a_bad_line_in_a_bounded_input_is_refused_before_anything_runs(tmp_path: Path) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n".join(LINES) + "\n")
    proc = subprocess.run(
        [*CLI, f"{AGENTS}:Counter", "--input", str(inputs), "--output", str(tmp_path / "out")],
        env=flink_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    assert f"ratchet flink: bad input: {inputs}:3: invalid JSON" in proc.stderr
    assert "(and 1 more bad line(s)); nothing was submitted" in proc.stderr
    assert "--on-bad-input skip or dead-letter" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""  # no job was submitted
    assert read_output_dir(tmp_path / "out") == []


def test_dead_letters_int_and_str_keys_and_max_concurrent_runs(tmp_path: Path) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n".join(LINES) + "\n")
    proc = run_cli(
        tmp_path,
        [
            f"{AGENTS}:Counter",
            "--input",
            str(inputs),
            "--output",
            str(tmp_path / "out"),
            "--memory-output",
            str(tmp_path / "mem"),
            "--on-bad-input",
            "dead-letter",
            "--max-concurrent-runs",
            "1",
            "--checkpoint-interval",
            "200",
        ],
        timeout=240,
    )
    assert "ratchet flink: 2 bad input line(s) kept in" in proc.stderr
    assert f"the first: {inputs}:3: invalid JSON" in proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["status"] == "FINISHED" and len(summary["bad_inputs"]) == 2

    outputs = read_output_dir(tmp_path / "out")
    by_key: dict[object, list[int]] = {}
    for rec in sorted(outputs, key=lambda r: r["seq"]):
        by_key.setdefault(rec["key"], []).append(rec["output"])
    # 1 and "1" are two keys with their own counters, and keep their JSON types.
    assert by_key == {1: [1, 2, 3], "1": [1], "a": [1]}
    assert len({r["id"] for r in outputs}) == len(outputs) == 5
    memory = flink_memory(tmp_path / "mem")
    assert memory == {1: {"n": 3}, "1": {"n": 1}, "a": {"n": 1}}

    dead = read_output_dir(tmp_path / "out" / "_bad-input")
    assert sorted(d["line"] for d in dead) == ["not json", '{"nokey": 1}']
    # Each names its line, quoted, then why (the quoted line may hold ": " itself).
    errors = {d["line"]: d["error"] for d in dead}
    assert "): invalid JSON" in errors["not json"], errors
    assert errors['{"nokey": 1}'].endswith("): missing key field 'key'"), errors


def test_skip_reports_the_skipped_lines_and_exits_0(tmp_path: Path) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n".join(LINES[:3]) + "\n")
    proc = run_cli(
        tmp_path,
        [f"{AGENTS}:Counter", "--input", str(inputs), "--output", str(tmp_path / "out")]
        + ["--on-bad-input", "skip"],
        timeout=240,
    )
    assert (
        f"ratchet flink: 1 bad input line(s) skipped (--on-bad-input skip); the first: "
        f"{inputs}:3: invalid JSON" in proc.stderr
    )
    assert {(r["key"], r["output"]) for r in read_output_dir(tmp_path / "out")} == {
        (1, 1),
        ("1", 1),
    }
    assert not (tmp_path / "out" / "_bad-input").exists()


def test_a_bad_line_that_arrives_while_the_job_runs_stops_it_with_exit_3(tmp_path: Path) -> None:
    """With --follow nothing is read beforehand: the parse step fails the job."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.jsonl").write_text('{"key": "k", "v": 1}\n{"key": [1], "v": 2}\n')
    cmd = [
        *CLI,
        f"{AGENTS}:Counter",
        "--input",
        str(inputs),
        "--output",
        str(tmp_path / "out"),
        "--follow",
        "200",
        "--restart-strategy",
        "none",
        "--tmp-dir",
        str(tmp_path / "flink-tmp"),
    ]
    proc = subprocess.run(cmd, env=flink_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    assert (
        f'ratchet flink: bad input: a line of {inputs} (\'{{"key": [1], "v": 2}}\'): key '
        "field 'key' is list" in proc.stderr
    )
    assert "--on-bad-input skip or dead-letter" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_line_that_is_not_utf8_is_refused_as_the_embedded_engine_refuses_it(
    tmp_path: Path,
) -> None:
    """It was read with U+FFFD in place of its bytes and run (exit 0); the embedded engine
    refuses it (exit 3). Flink's line reader cannot tell those bytes from text, so neither
    skip nor dead-letter could keep it out of the job: the input is refused, nothing runs."""
    inputs = tmp_path / "in.jsonl"
    inputs.write_bytes(b'{"key": "a", "i": 1}\n{"key": "b", "s": "\xff\xfe"}\n{"key": "a"}\n')
    for mode in ("stop", "skip", "dead-letter"):
        out = tmp_path / f"out-{mode}"
        proc = subprocess.run(
            [*CLI, f"{AGENTS}:Counter", "--input", str(inputs), "--output", str(out),
             "--on-bad-input", mode],
            env=flink_env(tmp_path), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == EXIT_BAD_INPUT, (mode, proc.stderr[-3000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert lines[0].startswith(
            f"ratchet flink: bad input: {inputs}:2: invalid JSON ('utf-8' codec can't decode "
            "byte 0xff"
        ), lines[0]
        assert "nothing was submitted" in lines[0] and "fix its encoding" in lines[0]
        assert proc.stdout == "" and read_output_dir(out) == []
