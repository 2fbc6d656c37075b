"""A job cancelled while a metric reporter reads its metrics leaves the TaskManager running.

In thread mode a Python gauge is read on the reporter's thread by entering the embedded
interpreter with the task's thread state (Pemja). With ratchet's metrics as such gauges, this
test's TaskManager crashed at its first cancel (SIGSEGV in `take_gil`; the JVM's report names
`MetricGauge.getValue` on "Flink-Metric-Reporter-thread-1"), and our CI lost a TaskManager the
same way once with only the JobManager's fetches reading. ratchet's metrics are Flink counters
and JVM-held gauges in thread mode now (`ratchet.flink._function._Published`).

Thread mode only: process mode's gauges are Beam's, set from values the Python worker reports,
and no Flink thread enters Python to read them. (Run in process mode once in CI, the fourth
cancel made the TaskManager shut itself down on an error of Beam's in the task's cleanup,
"Reference count must not be negative" in `DefaultJobBundleFactory`: PyFlink's, not this
test's subject; docs/flink.md, *Running on a standalone cluster*.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet.flink import read_output_dir  # noqa: E402

from .cluster import Cluster, reporting_cluster, wait_for  # noqa: E402
from .support import THREAD_MODE, submit_detached, write_inputs  # noqa: E402

pytestmark = [
    pytest.mark.flink,
    pytest.mark.skipif(
        not THREAD_MODE,
        reason="a thread-mode crash (make test-flink-thread); process mode's gauges are Beam's",
    ),
]

ROUNDS = 4


@pytest.fixture
def reported_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster of its own whose TaskManager reads every metric every 5 ms (its log lines
    switched off: the reporter reads them all the same)."""
    with reporting_cluster(tmp_path_factory.mktemp("reported-cluster"), "5 ms", False) as c:
        yield c


def test_cancelling_jobs_whose_metrics_are_being_read(
    reported_cluster: Cluster, tmp_path: Path
) -> None:
    c = reported_cluster
    tm = c.taskmanager_pids()
    for r in range(ROUNDS):
        c.ready()
        tmp = tmp_path / f"round{r}"
        (tmp / "in").mkdir(parents=True)
        write_inputs(tmp / "in" / "a.jsonl", [{"key": f"k{i % 5}", "v": i} for i in range(30)])
        job = submit_detached(c, tmp, tmp / "in", tmp / "out")
        wait_for(
            "30 outputs",
            lambda: len(read_output_dir(tmp / "out")) >= 30,  # noqa: B023 - called in the loop
            120,
            explain=lambda: c.explain(job),  # noqa: B023
        )
        c.cancel(job)
        time.sleep(1.0)  # a crash comes within milliseconds of the task's end
        c.check_crashes()
        assert c.taskmanager_pids() == tm, f"round {r}: the TaskManager {tm} is gone\n{c.explain()}"
