"""A stand-in for PyFlink's `JobClient` as ratchet's local runs use it (no JVM): the job's
status, and its execution result holding the job's failure."""

from __future__ import annotations

import enum
from typing import Any

import pytest

# PyFlink's JobStatus is an enum: its str is "JobStatus.FAILED", its name "FAILED". Tests with
# PyFlink pass its own.
JobStatus = enum.Enum("JobStatus", "RUNNING FAILED CANCELED FINISHED")


class Done:
    """What a `CompletableFuture`'s `result()` gives: a value, or the failure it raises."""

    def __init__(self, value: Any = None, error: Exception | None = None) -> None:
        self.value, self.error = value, error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class FailedJob:
    """A job client whose job is in `status`; its result holds the job's own failure."""

    def __init__(self, status: Any, cause: str = "the cause") -> None:
        self.status = status
        self.cause = cause

    def get_job_status(self) -> Done:
        return Done(self.status)

    def get_job_execution_result(self) -> Done:
        return Done(error=RuntimeError(f"Caused by: java.lang.IllegalStateException: {self.cause}"))


def check_a_refused_stop_reports_the_jobs_failure(
    monkeypatch: pytest.MonkeyPatch, status: Any
) -> None:
    """`_stop_when_running` on a job whose stop is refused ("not running"): with the job
    FAILED it raises the job's own failure; still RUNNING, the stop's error. `status` is the
    `JobStatus` enum (this module's stand-in, or PyFlink's)."""
    from ratchet.cli import _flink

    def refuse(client: object, target: str, *, drain: bool) -> str:
        raise RuntimeError("java.util.concurrent.CompletionException: job is not running")

    monkeypatch.setattr(_flink, "_stop_with_savepoint", refuse)
    with pytest.raises(RuntimeError, match="the cause"):
        _flink._stop_when_running(FailedJob(status.FAILED), "/sp")
    with pytest.raises(RuntimeError, match="job is not running"):  # still running: the stop's
        _flink._stop_when_running(FailedJob(status.RUNNING), "/sp")
