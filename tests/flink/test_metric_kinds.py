"""What kind of Flink metric each of the agent operator's metrics is, read by a real reporter.

`runs_in_flight` and `queued_inputs` are levels (they go up and down): Flink must hold them as
gauges in both execution modes, so a reporter that takes a counter to only grow (a rate, a
reset detection) never sees one go down. In thread mode they are gauges whose value lives in
the JVM (`ratchet.flink._function._Published`: no Flink thread enters Python to read them);
in process mode Beam's gauges. `inputs` and `outputs` only grow: counters in thread mode.

The TaskManager's SLF4J reporter (the pip package's plugins) writes every metric, grouped by
kind, to its log every 200 ms; the `Slow` agent (150 ms per run) keeps runs in flight and
inputs queued behind them for a while.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet.flink import read_output_dir  # noqa: E402

from .cluster import Cluster, reporting_cluster, wait_for  # noqa: E402
from .support import THREAD_MODE, submit_detached, write_inputs  # noqa: E402

pytestmark = pytest.mark.flink

KEYS, PER_KEY = 8, 8
SECTION = re.compile(r"^-- (\w+) -+$")


@pytest.fixture
def logged_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with reporting_cluster(tmp_path_factory.mktemp("logged-metrics-cluster"), "200 ms", True) as c:
        yield c


def reports(log_dir: Path) -> list[dict[str, tuple[str, float]]]:
    """Every SLF4J report in the TaskManagers' logs, in order: metric name (from `ratchet.` on)
    -> (its section: Counters, Gauges, ..., its value)."""
    found: list[dict[str, tuple[str, float]]] = []
    for log in sorted(log_dir.glob("flink-*taskexecutor*.log")):
        current: dict[str, tuple[str, float]] | None = None
        section = ""
        for line in log.read_text(errors="replace").splitlines():
            if "Starting metrics report" in line:
                current, section = {}, ""
                found.append(current)
            elif "Finished metrics report" in line:
                current = None
            elif current is not None:
                m = SECTION.match(line.strip())
                if m:
                    section = m.group(1)
                elif ".ratchet." in line and ": " in line:
                    name, _, value = line.strip().rpartition(": ")
                    try:
                        current[name[name.index("ratchet.") :]] = (section, float(value))
                    except ValueError:
                        pass
    return found


def test_levels_are_gauges_that_go_up_and_down(logged_cluster: Cluster, tmp_path: Path) -> None:
    c = logged_cluster
    c.ready()
    (tmp_path / "in").mkdir()
    rows = [{"key": f"k{i % KEYS}", "v": i} for i in range(KEYS * PER_KEY)]
    write_inputs(tmp_path / "in" / "a.jsonl", rows)
    job = submit_detached(c, tmp_path, tmp_path / "in", tmp_path / "out", agent="Slow")
    wait_for(
        f"{len(rows)} outputs",
        lambda: len(read_output_dir(tmp_path / "out")) >= len(rows),
        180,
        explain=lambda: c.explain(job),
    )

    def settled() -> bool:  # a report after the last run: both levels back at 0
        last = [r for r in reports(c.log) if "ratchet.runs_in_flight" in r]
        return bool(last) and all(
            last[-1][name][1] == 0 for name in ("ratchet.runs_in_flight", "ratchet.queued_inputs")
        )

    wait_for("a report with no run in flight", settled, 30, explain=lambda: c.explain(job))
    seen = [r for r in reports(c.log) if "ratchet.runs_in_flight" in r]
    c.cancel(job)
    for name in ("ratchet.runs_in_flight", "ratchet.queued_inputs"):
        kinds = {r[name][0] for r in seen}
        assert kinds == {"Gauges"}, f"{name} reported as {kinds}"
        peak = max(r[name][1] for r in seen)
        assert peak > 0, f"{name} never above 0 in {len(seen)} reports"
    if THREAD_MODE:
        for name in ("ratchet.inputs", "ratchet.outputs"):
            assert {r[name][0] for r in seen} == {"Counters"}, name
    assert seen[-1]["ratchet.inputs"][1] == len(rows)
    time.sleep(0.5)
    c.check_crashes()
