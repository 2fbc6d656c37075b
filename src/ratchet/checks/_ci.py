"""What CI systems read: JUnit XML, and on GitHub Actions annotations and a step summary.

Both are views of a finished receipt; neither changes what the receipt says.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any, TextIO

__all__ = ["LOG_TAIL_LINES", "ci_report", "log_tail", "write_junit"]

LOG_TAIL_LINES = 20
_BAD = ("failed", "stale")
# Terminal escape sequences (colours, cursor moves) a tool such as `pytest --color=yes`
# writes: noise in a report, and their ESC is a character XML 1.0 cannot hold.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-_])")
# What XML 1.0 does not allow in a document at all, even escaped.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def log_tail(path: Any, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a stage's log, decoded leniently ('' if unreadable)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            data = handle.read()
    except OSError:
        return ""
    text = _ANSI.sub("", data.decode("utf-8", "replace"))
    return "\n".join(text.splitlines()[-lines:])


def _xml_safe(text: str) -> str:
    """`text` with each character XML 1.0 disallows written as `\\xNN` (or `\\uNNNN`), so
    the report stays well-formed and still shows that the character was there."""
    return _NOT_XML.sub(lambda m: ascii(m.group())[1:-1], text)


def _fence(text: str) -> str:
    """A Markdown code fence longer than any run of backticks in `text`, which would
    otherwise close it early."""
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    return "`" * max(3, longest + 1)


def write_junit(result: Mapping[str, Any], path: Path) -> None:
    """One `testcase` per stage: `failed`/`stale` are failures (with the log's tail),
    `skipped` is skipped; reused stages pass and say where they came from."""
    from xml.etree import ElementTree as ET  # only CI runs that ask for XML pay for it

    stages = list(result.get("stages") or [])
    suite = ET.Element(
        "testsuite",
        name=f"ratchet checks {result.get('run_id')}",
        tests=str(len(stages)),
        failures=str(sum(1 for s in stages if s.get("status") in _BAD)),
        skipped=str(sum(1 for s in stages if s.get("status") == "skipped")),
    )
    for s in stages:
        case = ET.SubElement(
            suite,
            "testcase",
            classname="ratchet.checks",
            name=_xml_safe(str(s.get("id"))),
            time=f"{float(s.get('duration_seconds') or 0.0):.3f}",
        )
        status = s.get("status")
        if status in _BAD:
            message = _xml_safe(str(s.get("error") or status))
            failure = ET.SubElement(case, "failure", message=message)
            failure.text = _xml_safe(log_tail(s.get("log_path")))
        elif status == "skipped":
            ET.SubElement(case, "skipped", message=_xml_safe(str(s.get("error") or "skipped")))
        if s.get("reused_from"):
            out = ET.SubElement(case, "system-out")
            out.text = f"reused from run {s['reused_from']}"
    path.parent.mkdir(parents=True, exist_ok=True)
    root = ET.Element("testsuites", name="ratchet checks")
    root.append(suite)
    tree = ET.ElementTree(root)
    tree.write(path, encoding="utf-8", xml_declaration=True)


def ci_report(
    result: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    stream: TextIO | None = None,
) -> None:
    """On GitHub Actions: an `::error` annotation per failed stage (on stderr) and a
    Markdown table, with the tail of each failed stage's log, in the step summary."""
    env = os.environ if environ is None else environ
    if env.get("GITHUB_ACTIONS") != "true" or "stages" not in result:
        return
    out = stream if stream is not None else sys.stderr
    stages = list(result.get("stages") or [])
    for s in stages:
        if s.get("status") in _BAD:
            message = str(s.get("error") or s.get("status")).replace("\n", " ")
            print(f"::error title=ratchet checks: {s.get('id')}::{message}", file=out)
    summary = env.get("GITHUB_STEP_SUMMARY")
    if not summary:
        return
    lines = [
        f"### ratchet checks `{result.get('run_id')}`: {result.get('status')}",
        "",
        "| stage | status | reused from | error |",
        "|---|---|---|---|",
    ]
    for s in stages:
        error = str(s.get("error") or "").replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {s.get('id')} | {s.get('status')} | {s.get('reused_from') or ''} | {error} |"
        )
    for s in stages:
        if s.get("status") in _BAD and (tail := log_tail(s.get("log_path"))):
            lines += ["", f"<details><summary>{s.get('id')}: last lines of the log</summary>", ""]
            lines += [_fence(tail), tail, _fence(tail), "</details>"]
    with open(summary, "a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
