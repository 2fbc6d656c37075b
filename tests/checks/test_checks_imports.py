"""`ratchet checks` never loads the agent side: `import ratchet` is lazy, and the command
line registers only the checks group for a checks command."""

from __future__ import annotations

import json
import subprocess
import sys

from checks_helpers import Workspace, check

# What `ratchet checks` must never import: the agents, the engines, and their libraries.
AGENT_SIDE = ("ratchet.agents", "ratchet.runtime", "ratchet.flink", "pydantic", "msgpack")
# Standard library modules a no-op `ratchet checks run` has no use for, each a measurable
# part of the command line's start-up (issue 17: under 2x the in-process time): what
# `dataclasses` (-> `inspect`, `ast`, `dis`), `platform`, `socket`, `ctypes` (the
# parent-death signal, loaded before the first stage command), `tempfile`, `datetime` and
# `asyncio` were imported for; `concurrent.futures` (-> `logging`, `traceback`,
# `linecache`, `tokenize`, `textwrap`), which the scheduler's pool and the start-of-run
# probe used before they had threads of their own (`ratchet.checks._threads`); and
# `subprocess` (-> `selectors`, `select`, `locale`): `git ls-files` is spawned with
# `os.posix_spawnp` (`ratchet.checks._spawn`), stage commands import it when one starts;
# `shutil` (-> `bz2`, `lzma`, `zlib`), which argparse imported for the terminal's width
# (`ratchet._argparse` asks `os`); `typing` (-> `_typing`), which the modules on that path
# import only for the type checker (`TYPE_CHECKING = False`), their Protocols kept in
# `ratchet.checks._protocols` and `ratchet._clock_protocol`, their NamedTuples built by
# `ratchet._records`; and OpenSSL's `_hashlib` (with `hashlib`, `hmac`): the small inputs a
# no-op hashes go to CPython's builtin SHA-256 (`ratchet.store._digest`); and `argparse`
# (-> `gettext`, and `locale` when a parser is built): a plain `checks run` command line is
# read by `ratchet.checks._cli.read_plain_run`.
STARTUP_HEAVY = (
    "_hashlib",
    "argparse",
    "asyncio",
    "bz2",
    "concurrent.futures",
    "ctypes",
    "dataclasses",
    "datetime",
    "gettext",
    "hashlib",
    "hmac",
    "inspect",
    "linecache",
    "locale",
    "logging",
    "lzma",
    "platform",
    "selectors",
    "shutil",
    "socket",
    "subprocess",
    "tempfile",
    "textwrap",
    "tokenize",
    "traceback",
    "typing",
    "_typing",
)


def _agent_side(modules: list[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in AGENT_SIDE or m.startswith(AGENT_SIDE))


def _python(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_checks_help_imports_no_agent_side_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ratchet.cli", "checks", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ratchet checks" in proc.stdout
    imported = [
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    ]
    assert "ratchet.checks._cli" in imported
    assert _agent_side(imported) == []


def test_a_checks_run_through_the_command_line_imports_no_agent_side_module(
    two_repos: Workspace,
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("b", repos=["lib"], deps=["a"])])
    code = (
        "import json, sys\n"
        "from ratchet.cli import main\n"
        f"argv = ['checks', '--workspace-root', {str(ws.root)!r}, '--state-dir', "
        f"{str(ws.state_dir)!r}, 'run', '--json']\n"
        "code = main(argv)\n"
        "print(json.dumps({'code': code, 'modules': sorted(sys.modules)}))\n"
    )
    out = _python(code).strip().splitlines()[-1]
    report = json.loads(out)
    assert report["code"] == 0
    assert "ratchet.checks._run" in report["modules"]
    assert _agent_side(report["modules"]) == []


def test_a_no_op_resume_through_the_command_line_imports_nothing_it_does_not_use(
    two_repos: Workspace,
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("b", repos=["lib"], deps=["a"])])
    first = ws.run()
    code = (
        "import contextlib, io, json, sys\n"
        "from ratchet.cli import main\n"
        f"argv = ['checks', '--workspace-root', {str(ws.root)!r}, '--state-dir', "
        f"{str(ws.state_dir)!r}, 'run', '--resume', {first['run_id']!r}, '--json']\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    code = main(argv)\n"
        "reused = [s['reused_from'] for s in json.loads(out.getvalue())['stages']]\n"
        "print(json.dumps({'code': code, 'reused': reused, 'modules': sorted(sys.modules)}))\n"
    )
    report = json.loads(_python(code).strip().splitlines()[-1])
    assert report["code"] == 0
    assert report["reused"] == [first["run_id"]] * 2  # a no-op: no stage command ran
    assert sorted(set(STARTUP_HEAVY) & set(report["modules"])) == []


def test_import_ratchet_is_lazy_and_every_public_name_still_resolves() -> None:
    code = (
        "import json, sys\n"
        "import ratchet\n"
        "before = sorted(m for m in sys.modules if m.startswith(('ratchet.', 'pydantic')))\n"
        "from ratchet import Agent, tool\n"
        "import ratchet.agents, ratchet.agents.chat\n"
        "same = [Agent is ratchet.agents.Agent, tool is ratchet.agents.chat.tool,\n"
        "        ratchet.Agent is Agent]\n"
        "missing = [n for n in ratchet.__all__ if getattr(ratchet, n, None) is None]\n"
        "listed = set(ratchet.__all__) <= set(dir(ratchet))\n"
        "try:\n"
        "    ratchet.NoSuchName\n"
        "    error = None\n"
        "except AttributeError as exc:\n"
        "    error = str(exc)\n"
        "print(json.dumps({'before': before, 'same': same, 'missing': missing,\n"
        "                  'listed': listed, 'error': error}))\n"
    )
    report = json.loads(_python(code).strip().splitlines()[-1])
    assert report["before"] == ["ratchet._errors"]  # the error classes only
    assert report["same"] == [True, True, True]
    assert report["missing"] == []
    assert report["listed"] is True
    assert report["error"] == "module 'ratchet' has no attribute 'NoSuchName'"


def test_the_command_line_flushes_its_output_and_runs_atexit_handlers_before_it_leaves(
    two_repos: Workspace,
) -> None:
    """Run as the program, `ratchet checks` ends with `os._exit` (no interpreter teardown):
    what it printed and what atexit handlers do must still happen, and the exit code is
    the run's."""
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("b", repos=["lib"], deps=["a"])])
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('atexit handler ran'))\n"
        f"sys.argv = ['ratchet', 'checks', '--workspace-root', {str(ws.root)!r}, "
        f"'--state-dir', {str(ws.state_dir)!r}, 'run', '--json']\n"
        "from ratchet.cli import main\n"
        "main()\n"
        "print('not reached')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    receipt, _, rest = proc.stdout.rpartition("}")
    assert json.loads(receipt + "}")["status"] == "passed"
    assert rest.strip() == "atexit handler ran"
    ws.project([check("b", "raise SystemExit(3)", repos=["lib"])])
    failed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert failed.returncode == 1, failed.stderr
    assert failed.stdout.rstrip().endswith("atexit handler ran")
