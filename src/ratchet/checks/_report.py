"""What people see: live progress on a TTY and the summary table at the end (rich).

rich is imported only when something is shown, so `--json` runs do not pay for it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from ratchet.checks.common import printable

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any, TextIO

    from rich.progress import Progress
    from rich.table import Table

_STYLE = {
    "passed": "green",
    "failed": "red",
    "stale": "yellow",
    "skipped": "dim",
    "running": "cyan",
    "pending": "dim",
    "interrupted": "magenta",
    "reuse": "green",
    "run": "cyan",
    "fail": "red",
}
_FINAL = {"passed", "failed", "stale", "skipped"}


class LiveProgress:
    """A progress bar with the running stages, shown only when stderr is a terminal."""

    def __init__(
        self, total: int, stream: TextIO | None = None, enabled: bool | None = None
    ) -> None:
        stream = stream if stream is not None else sys.stderr
        self.enabled = stream.isatty() if enabled is None else enabled
        self._progress: Progress | None = None
        self._task: Any = None
        self._total = total
        self._stream = stream

    @property
    def active(self) -> bool:
        """Whether anything is shown (the scheduler gathers records only then)."""
        return self._progress is not None

    def __enter__(self) -> LiveProgress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]checks[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=Console(file=self._stream),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task("", total=self._total)
        return self

    def update(self, records: Sequence[Mapping[str, Any]]) -> None:
        if self._progress is None:
            return
        done = sum(1 for r in records if r["status"] in _FINAL)
        from rich.markup import escape

        running = [r["id"] for r in records if r["status"] == "running"]
        shown = escape(printable(", ".join(running[:4])))  # ids are text, never markup
        self._progress.update(self._task, completed=done, description=shown)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def summary_table(result: Mapping[str, Any]) -> Table:
    """One row per stage: status, exit code, reuse, time, error."""
    from rich.table import Table
    from rich.text import Text

    def text(value: Any) -> Text:
        """A cell of what a user or a command wrote (an id, an error): shown as it is
        (never read as markup), control characters escaped."""
        return Text(printable(str(value)))

    status = str(result.get("status"))
    if result.get("dry_run"):
        title, caption = "plan (dry run)", "nothing was run"
    else:
        title = f"run {result.get('run_id')}: [{_STYLE.get(status, 'bold')}]{status}[/]"
        caption = f"receipt {result.get('receipt_path')}" + (
            "" if result.get("snapshot_verified") else "  (snapshot not verified)"
        )
    table = Table(title=title, caption=caption)
    for col in ("stage", "status", "exit", "reused from", "seconds", "error"):
        table.add_column(col, overflow="fold")
    for s in result.get("stages", []):
        st = str(s.get("prediction") or s.get("status"))
        secs = s.get("duration_seconds")
        table.add_row(
            text(s.get("id")),
            f"[{_STYLE.get(st, 'bold')}]{st}[/]",
            "" if s.get("exit_code") is None else str(s.get("exit_code")),
            text(s.get("reused_from") or ""),
            "" if secs is None else f"{secs:.2f}",
            text(s.get("error") or s.get("snapshot_error") or "; ".join(s.get("reasons") or [])),
        )
    return table


def render(result: Mapping[str, Any], stream: TextIO | None = None) -> None:
    """Print a handler's result for people (a run gets the summary table)."""
    from rich.console import Console

    console = Console(file=stream if stream is not None else sys.stdout)
    if "stages" in result and "run_id" in result:
        console.print(summary_table(result))
        return
    if "text" in result:
        console.print(result["text"], markup=False, highlight=False)
        return
    if result.get("ok") is False and result.get("error"):
        return  # a refusal: the dispatcher prints its error on stderr; JSON needs --json
    console.print_json(data=dict(result))
