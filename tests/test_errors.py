"""One error tree: `_errors.py`'s docstring draws it, and this test holds the drawing to the
classes (every class in it, each under its parent, each "(also X)" true), the public names
to the tree, and the CLI's exit codes to the constants."""

from __future__ import annotations

import builtins
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ratchet
from ratchet import _errors


def drawn_tree() -> list[tuple[int, str, str]]:
    """(depth, class name, description) for each line of the drawing, in order."""
    doc = _errors.__doc__ or ""
    rows = []
    for raw in doc.splitlines():
        line = raw[4:] if raw.startswith("    ") else None
        if not line or not (line.startswith("RatchetError") or line[:1] in "│├└ "):
            continue
        m = re.match(r"^([ │]*)(?:[├└]── )?([A-Z]\w+)\s*(.*)$", line)
        if m is None:
            continue
        prefix = m.group(1)
        depth = 0 if line.startswith("RatchetError") else len(prefix) // 4 + 1
        rows.append((depth, m.group(2), m.group(3)))
    return rows


def test_the_drawing_is_the_hierarchy() -> None:
    rows = drawn_tree()
    assert rows[0][1] == "RatchetError"
    parents: list[str] = []
    seen = []
    for depth, name, desc in rows:
        cls = getattr(_errors, name)
        del parents[depth:]
        if parents:
            assert issubclass(cls, getattr(_errors, parents[-1])), f"{name} under {parents[-1]}"
        for also in re.findall(r"\(also (\w+)\)", desc):
            other = getattr(_errors, also, None) or getattr(builtins, also)
            assert issubclass(cls, other), f"{name} is drawn as also {also}"
        parents.append(name)
        seen.append(name)
    defined = sorted(
        n
        for n, v in vars(_errors).items()
        if isinstance(v, type) and issubclass(v, _errors.RatchetError)
    )
    assert sorted(seen) == defined, "every error class is drawn once"


def test_every_error_class_is_public_and_the_submodules_reexport_the_same_classes() -> None:
    from ratchet.agents import chat
    from ratchet.checks import _errors as checks_errors
    from ratchet.store import codec

    for name, cls in vars(_errors).items():
        if isinstance(cls, type) and issubclass(cls, _errors.RatchetError):
            assert getattr(ratchet, name) is cls, name
    assert chat.ModelCallError is _errors.ModelCallError
    assert checks_errors.ReceiptError is _errors.ReceiptError
    assert codec.CodecError is _errors.CodecError


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (_errors.ConfigError("x"), _errors.EXIT_USAGE),
        (_errors.StateError("x"), _errors.EXIT_USAGE),
        (_errors.BadInputError("x"), _errors.EXIT_BAD_INPUT),
        (KeyboardInterrupt(), _errors.EXIT_INTERRUPTED),
        # Not a mistake to fix: the sink was down; exit 1 is one a supervisor restarts.
        (_errors.SinkError("x"), _errors.EXIT_FAILED),
    ],
)
def test_exit_codes(exc: BaseException, code: int) -> None:
    assert _errors.exit_code_for(exc) == code
    assert code in (1, 2, 3, 130)
    assert (code in _errors.EXIT_NO_RESTART) == (code in (2, 3))


def test_a_user_mistake_on_the_command_line_is_one_line_and_exit_2(tmp_path: Path) -> None:
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "run", "no_such_module_xyz:Agent"]
        + ["--input", str(inputs), "--output", str(tmp_path / "o"), "--state", str(tmp_path / "s")]
        + ["--checkpoint-interval", "-5"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == _errors.EXIT_USAGE
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("ratchet: error: ")


def test_negative_checkpoint_interval_message_is_pinned(tmp_path: Path) -> None:
    agent = Path(__file__).parent / "kill" / "kill_agent.py"
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "ratchet.cli", "run", f"{agent}:KillAgent"]
        + ["--input", str(inputs), "--output", str(tmp_path / "o"), "--state", str(tmp_path / "s")]
        + ["--checkpoint-interval", "-5"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == _errors.EXIT_USAGE, proc.stderr
    assert proc.stderr.strip() == (
        "ratchet: error: --checkpoint-interval must be >= 0 milliseconds, not -5"
    )
