"""`ratchet run` refuses what it cannot do with exit 2 and one line naming the thing and the
fix, before it creates anything: no traceback, no state directory left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet._errors import EXIT_OK, EXIT_USAGE

RATCHET = [sys.executable, "-m", "ratchet.cli"]
# `python -m ratchet.cli` in a process where the server extra is not installed.
WITHOUT_SERVER = (
    "import runpy, sys\n"
    "sys.modules['uvicorn'] = None  # makes `import uvicorn` raise ModuleNotFoundError\n"
    "sys.argv[0] = 'ratchet'\n"
    "runpy.run_module('ratchet.cli', run_name='__main__', alter_sys=True)\n"
)


def agent_file(tmp_path: Path) -> str:
    path = tmp_path / "echo_agent.py"
    path.write_text(
        "from ratchet import Agent, InputEvent, OutputEvent, action\n"
        "class Echo(Agent):\n"
        "    @action(InputEvent, inline=True)\n"
        "    def echo(self, event, ctx):\n"
        "        ctx.send_event(OutputEvent(output=event.input))\n"
    )
    return f"{path}:Echo"


def ratchet_run(
    tmp_path: Path, output: Path | str, *extra: str, prefix: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    src = tmp_path / "in.jsonl"
    if not src.exists():
        src.write_text('{"key": "a"}\n')
    argv = [*(prefix or RATCHET), "run", agent_file(tmp_path), "--input", str(src)]
    argv += ["--output", str(output), "--state", str(tmp_path / "state"), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def assert_refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ratchet: error: ")
    for word in words:
        assert word in lines[0], lines[0]


def test_an_output_that_is_a_directory(tmp_path: Path) -> None:
    out = tmp_path / "outdir"
    out.mkdir()
    proc = ratchet_run(tmp_path, out)
    assert_refused(proc, f"--output {out} is a directory", f"{out / 'out.jsonl'}")
    assert not (tmp_path / "state").exists()


def test_an_output_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    out = tmp_path / "plain" / "sub" / "o.jsonl"
    proc = ratchet_run(tmp_path, out)
    assert_refused(proc, f"--output {out} cannot be created: {tmp_path / 'plain'} is a file")
    assert not (tmp_path / "state").exists()


def test_an_output_in_a_place_that_cannot_be_written(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        out = Path("/proc/ratchet-test/o.jsonl")  # not even root creates files in /proc
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        out = ro / "o.jsonl"
    proc = ratchet_run(tmp_path, out)
    assert_refused(proc, f"--output {out} cannot be written", "choose a file in a place")
    assert not (tmp_path / "state").exists()


def test_an_output_file_that_cannot_be_written(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes any file; the directory case covers /proc")
    out = tmp_path / "o.jsonl"
    out.write_text("")
    out.chmod(0o400)
    proc = ratchet_run(tmp_path, out)
    assert_refused(proc, f"--output {out} cannot be written (Permission denied)")
    assert not (tmp_path / "state").exists()


def test_a_supervised_run_checks_the_output_before_the_supervisor_starts(tmp_path: Path) -> None:
    out = tmp_path / "outdir"
    out.mkdir()
    proc = ratchet_run(tmp_path, out, "--supervise")
    assert_refused(proc, f"--output {out} is a directory")
    assert not (tmp_path / "state").exists()


def test_rest_port_without_the_server_extra(tmp_path: Path) -> None:
    proc = ratchet_run(
        tmp_path,
        tmp_path / "o.jsonl",
        "--supervise",
        "--rest-port",
        "0",
        prefix=[sys.executable, "-c", WITHOUT_SERVER],
    )
    assert_refused(proc, "--rest-port needs the server extra", "pip install 'ratchet[server]'")
    assert not (tmp_path / "state").exists() and not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(
    "flag",
    [
        ["--rest-port", "8765"],
        ["--rest-token", "t"],
        ["--rest-host", "0.0.0.0"],
        ["--restart-attempts", "3"],
        ["--restart-delay", "2"],
    ],
)
def test_a_supervision_option_without_supervise_is_refused_not_ignored(
    tmp_path: Path, flag: list[str]
) -> None:
    """Only --rest-port was refused; the others were silently ignored."""
    proc = ratchet_run(tmp_path, tmp_path / "o.jsonl", *flag)
    assert_refused(proc, f"{flag[0]} is an option of a supervised job", "add --supervise")
    assert not (tmp_path / "state").exists()


def test_append_output_is_a_documented_flag(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    first = ratchet_run(tmp_path, out)
    assert first.returncode == EXIT_OK, first.stderr
    # A clean state (a new job) on the same output: refused, naming both jobs and the flag.
    os.rename(tmp_path / "state", tmp_path / "old-state")
    again = ratchet_run(tmp_path, out)
    job = json.loads((tmp_path / "old-state" / "job.json").read_text())["job"]
    new = json.loads((tmp_path / "state" / "job.json").read_text())["job"]
    assert_refused(again, f"of job {job}", f"is job {new}", "--append-output")
    appended = ratchet_run(tmp_path, out, "--append-output")
    assert appended.returncode == EXIT_OK, appended.stderr
    assert [json.loads(x)["job"] for x in out.read_text().splitlines()] == [job, new]


@pytest.mark.parametrize("append", [False, True], ids=["new", "append-output"])
def test_an_output_file_holding_one_foreign_line_without_a_newline_is_kept(
    tmp_path: Path, append: bool
) -> None:
    """A file that is not ratchet's, one line long and unterminated (a saved JSON document):
    refused, byte for byte as it was (the unterminated line was cut as if a crash had torn
    it, and the job went on with exit 0)."""
    out = tmp_path / "data.json"
    doc = json.dumps({"users": list(range(5000))}).encode()
    out.write_bytes(doc)
    proc = ratchet_run(tmp_path, out, *(["--append-output"] if append else []))
    assert_refused(proc, "not a ratchet output", str(out))
    assert out.read_bytes() == doc


@pytest.mark.parametrize("kind", ["fifo", "stdin-pipe"])
def test_an_input_that_is_a_pipe_is_refused_before_anything_is_made(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO with no writer made `ratchet run` block in open() (deaf to SIGTERM); a pipe
    raised a traceback when it was read at an offset."""
    argv = [*RATCHET, "run", agent_file(tmp_path), "--output", str(tmp_path / "o.jsonl")]
    argv += ["--state", str(tmp_path / "state"), "--input"]
    if kind == "fifo":
        os.mkfifo(tmp_path / "ff")
        proc = subprocess.run(
            [*argv, str(tmp_path / "ff")], capture_output=True, text=True, timeout=60
        )
    else:
        proc = subprocess.run(
            [*argv, "/dev/stdin"],
            input='{"key": "a"}\n',
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert_refused(proc, "is not a regular file (a pipe, a device or a socket)")
    assert not (tmp_path / "state").exists()


def test_the_api_refuses_a_pipe_as_input(tmp_path: Path) -> None:
    from ratchet import ConfigError, run
    from ratchet.agents._run import load_agent

    os.mkfifo(tmp_path / "ff")
    with pytest.raises(ConfigError, match="is not a regular file"):
        run(
            load_agent(agent_file(tmp_path)),
            inputs=tmp_path / "ff",
            output=tmp_path / "o.jsonl",
            state_dir=tmp_path / "s",
        )


@pytest.mark.parametrize("command", [["status"], ["runs", "list"], ["dead-letters"]])
def test_reading_a_damaged_state_database_is_an_error_not_a_traceback(
    tmp_path: Path, command: list[str]
) -> None:
    """A page SQLite finds malformed only when a command reads it (opening passed)."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"key": f"k{i}", "v": "x" * 200}) + "\n" for i in range(300)))
    assert ratchet_run(tmp_path, tmp_path / "o.jsonl").returncode == EXIT_OK
    db = tmp_path / "state" / "ratchet.db"
    with open(db, "r+b") as fh:
        fh.seek(8192)
        fh.write(b"\xff" * 4096)
    damaged = db.read_bytes()
    proc = subprocess.run(
        [*RATCHET, *command, "--state", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_refused(proc, "could not be read (database disk image is malformed)", "is damaged")
    assert db.read_bytes() == damaged


@pytest.mark.parametrize("url", ["notaurl", "http://[bad"])
def test_status_with_a_malformed_url_is_an_error(tmp_path: Path, url: str) -> None:
    proc = subprocess.run(
        [*RATCHET, "status", "--url", url], capture_output=True, text=True, timeout=60
    )
    assert_refused(proc, "is not a URL a job's API answers at", "http://HOST:PORT")


@pytest.mark.parametrize("scheme", ["s3", "gs", "git+ssh", "x-y.z"])
def test_an_output_uri_of_an_unknown_scheme_is_refused_not_written_as_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """`s3://bucket/out.jsonl` was taken for a local path (its scheme holds a digit), so the
    job wrote ./s3:/bucket/out.jsonl and exited 0."""
    from ratchet.connectors import is_uri

    assert is_uri(f"{scheme}://bucket/out.jsonl")
    assert not is_uri("C://out.jsonl") and not is_uri("3d://x") and not is_uri("a b://x")
    monkeypatch.chdir(tmp_path)
    proc = ratchet_run(tmp_path, f"{scheme}://bucket/out.jsonl")
    assert_refused(proc, f"unknown connector {scheme!r}")
    assert not (tmp_path / f"{scheme}:").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["inspect"],
        ["runs", "list"],
        ["dead-letters"],
        ["run"],
        ["run", "--workers", "2"],
        ["run", "--supervise"],
    ],
)
def test_a_state_that_is_a_file_is_named_as_one(tmp_path: Path, command: list[str]) -> None:
    """They said `shards/layout.json cannot be read ...; restore it from a backup`, or
    `[Errno 17] File exists` (with --workers 2, a traceback)."""
    (tmp_path / "statefile").write_text("x\n")
    if command[0] == "run":
        (tmp_path / "in.jsonl").write_text('{"key": "a"}\n')
        command = ["run", agent_file(tmp_path), "--input", str(tmp_path / "in.jsonl"), *command[1:]]
        command += ["--output", str(tmp_path / "o.jsonl")]
    proc = subprocess.run(
        [*RATCHET, *command, "--state", str(tmp_path / "statefile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_refused(proc, f"--state {tmp_path / 'statefile'}", "is a file, not a")


@pytest.mark.parametrize("supervise", [[], ["--supervise"]], ids=["plain", "supervised"])
def test_more_workers_than_the_machine_can_use_is_refused(
    tmp_path: Path, supervise: list[str]
) -> None:
    """`--workers 1000` forked a thousand processes for one input (still running 20 s on)."""
    from ratchet.runtime._auto_workers import usable_cores

    most = max(16, 4 * usable_cores())
    proc = ratchet_run(tmp_path, tmp_path / "o.jsonl", "--workers", str(most + 1), *supervise)
    assert_refused(proc, f"--workers {most + 1} is more than {most}", "--workers auto")
    assert not (tmp_path / "state").exists()


def test_a_savepoint_that_cannot_be_made_says_why(tmp_path: Path) -> None:
    """Both said `fix the cause (disk space, permissions)`."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"key": f"k{i}", "v": "x" * 200}) + "\n" for i in range(300)))
    assert ratchet_run(tmp_path, tmp_path / "o.jsonl").returncode == EXIT_OK
    (tmp_path / "afile").write_text("x\n")
    state = str(tmp_path / "state")
    proc = subprocess.run(
        [*RATCHET, "savepoint", "--state", state, str(tmp_path / "afile" / "sp.db")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert_refused(proc, "a part of the path is a file, not a folder")
    with open(tmp_path / "state" / "ratchet.db", "r+b") as fh:
        fh.seek(8192)
        fh.write(b"\xff" * 4096)
    proc = subprocess.run(
        [*RATCHET, "savepoint", "--state", state, str(tmp_path / "sp.db")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert_refused(proc, "the state's database is damaged", "nothing was written")
    assert not (tmp_path / "sp.db").exists()


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_rest_port_that_is_not_a_port_is_refused_before_anything_is_made(
    tmp_path: Path, port: str
) -> None:
    """70000 printed uvicorn's thread tracebacks, then left a supervisor.lock behind."""
    proc = ratchet_run(tmp_path, tmp_path / "o.jsonl", "--supervise", "--rest-port", port)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "argument --rest-port" in proc.stderr
    assert not (tmp_path / "state").exists()


def test_the_json_summary_of_a_job_stopped_by_a_bad_line_says_what_it_did(tmp_path: Path) -> None:
    """It said `"stopped_by": "end of input"`, 0 tasks executed and no checkpoints."""
    src = tmp_path / "in.jsonl"
    good = "".join(json.dumps({"key": f"k{i % 3}"}) + "\n" for i in range(30))
    src.write_text(good + "{bad\n" + json.dumps({"key": "z"}) + "\n")
    proc = ratchet_run(tmp_path, tmp_path / "o.jsonl", "--json")
    assert proc.returncode == 3, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["stopped_by"] == "a bad input" and "invalid JSON" in summary["error"]
    assert summary["inputs"] == 30 and summary["tasks_executed"] == 30
    assert summary["checkpoints"]["counts"]["completed"] >= 1


def test_a_signal_value_nested_past_the_interpreters_limit_is_bad_input(tmp_path: Path) -> None:
    """It raised a RecursionError traceback; a bad --value exits 3."""
    deep = "[" * 2000 + "]" * 2000
    proc = subprocess.run(
        [*RATCHET, "signal", "--state", str(tmp_path / "s"), "--key", "a", "go", "--value", deep],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "nests too deeply to be stored" in proc.stderr


@pytest.mark.parametrize("url", ["not a url", "ftp://x", "http://", "127.0.0.1:4318"])
@pytest.mark.parametrize("supervise", [[], ["--supervise"]])
def test_an_otel_endpoint_that_is_not_an_http_url_is_refused_before_anything_is_made(
    tmp_path: Path, url: str, supervise: list[str]
) -> None:
    """The exporter took any string, then dropped every span: exit 0, nothing exported."""
    proc = ratchet_run(tmp_path, tmp_path / "o.jsonl", "--otel-endpoint", url, *supervise)
    assert_refused(
        proc,
        f"--otel-endpoint {url!r} is not an http:// or https:// URL with a host",
        "give --otel-endpoint an OTLP/HTTP URL such as http://127.0.0.1:4318/v1/traces",
    )
    assert not (tmp_path / "state").exists()
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
)
def test_an_otlp_endpoint_variable_that_is_not_an_http_url_is_refused(
    tmp_path: Path, variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --otel-endpoint, the exporter reads the variable: checked the same way."""
    monkeypatch.setenv(variable, "collector:4318")
    proc = ratchet_run(tmp_path, tmp_path / "o.jsonl")
    assert_refused(
        proc, f"{variable} 'collector:4318' is not an http:// or https:// URL", "(or unset it)"
    )
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("flag", ["--url", "--jobmanager", "--state"])
def test_status_with_an_empty_place_is_one_line_naming_the_flag(flag: str) -> None:
    """`status --url ""` (or --jobmanager) fell through to read a state of None: a TypeError
    traceback."""
    proc = subprocess.run(
        [*RATCHET, "status", flag, ""], capture_output=True, text=True, timeout=60
    )
    assert_refused(proc, f"{flag} is empty: give {flag} ")
