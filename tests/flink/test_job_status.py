"""The local run's waits read PyFlink's job status by name (no JVM: a stand-in job client
giving PyFlink's own `JobStatus`)."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from pyflink.common.job_status import JobStatus  # noqa: E402

from ratchet.cli import _flink  # noqa: E402
from support.job_client import (  # noqa: E402
    FailedJob,
    check_a_refused_stop_reports_the_jobs_failure,
)

pytestmark = pytest.mark.flink


def test_a_bounded_run_whose_job_failed_stops_waiting(tmp_path: Path) -> None:
    """A job that ended (out of restarts, say) before its inputs were done: the wait returns,
    and the caller reports the job's result, instead of waiting for a signal."""
    (tmp_path / "progress").mkdir()
    args = argparse.Namespace(output=str(tmp_path / "out"), checkpoint_dir=None)
    stop = threading.Event()
    started = time.monotonic()
    got = _flink._run_to_completion(
        FailedJob(JobStatus.FAILED), args, str(tmp_path / "progress"), 5, False, stop
    )
    assert got is None and time.monotonic() - started < 5 and not stop.is_set()


def test_a_refused_stop_of_a_failed_job_reports_the_jobs_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_a_refused_stop_reports_the_jobs_failure(monkeypatch, JobStatus)
