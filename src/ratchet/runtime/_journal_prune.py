"""Cleaning the external call journal after the checkpoints that hold its records.

PyFlink's Python functions get no checkpoint-complete notification (there is no
`notify_checkpoint_complete` for them in PyFlink 2.3), so the worker cannot tell when a
record is no longer needed. The process that started the job can: it polls the JobManager's
REST API for the latest completed checkpoint and deletes the records of runs that completed
more than `margin_s` before that checkpoint was triggered. Such a checkpoint's operator
snapshot was taken after its trigger time, so after the callback that completed the run: it
holds the run as completed, and no restore from it (or a later one) replays the run. The margin
covers the clock difference between a TaskManager and the JobManager. See docs/flink.md.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

from ratchet.store._call_journal import CallJournalStore

log = logging.getLogger("ratchet.flink")


def latest_checkpoint_trigger(rest: str, job_id: str, timeout: float = 5.0) -> float | None:
    """The trigger time (seconds since the epoch) of the job's latest completed checkpoint,
    from the JobManager's REST API at `rest` (http://host:port); None if there is none yet."""
    with urllib.request.urlopen(f"{rest}/jobs/{job_id}/checkpoints", timeout=timeout) as resp:
        stats: dict[str, Any] = json.load(resp)
    completed = (stats.get("latest") or {}).get("completed") or {}
    ts = completed.get("trigger_timestamp")
    return None if ts is None else float(ts) / 1000.0


class JournalPruner(threading.Thread):
    """Prunes `journal` every `every_s` seconds while the job runs (see the module's docstring)."""

    def __init__(
        self,
        journal: CallJournalStore,
        rest: str,
        job_id: str,
        margin_s: float = 60.0,
        every_s: float = 5.0,
    ) -> None:
        super().__init__(name="ratchet-journal-pruner", daemon=True)
        self.journal = journal
        self.rest = rest.rstrip("/")
        self.job_id = job_id
        self.margin_s = margin_s
        self.every_s = every_s
        self.pruned = 0
        self._halt = threading.Event()

    def step(self) -> int:
        """One pass: how many records it deleted."""
        trigger = latest_checkpoint_trigger(self.rest, self.job_id)
        if trigger is None:
            return 0
        n = self.journal.prune(trigger - self.margin_s)
        self.pruned += n
        return n

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            try:
                self.step()
            except (OSError, urllib.error.URLError, ValueError) as exc:
                log.debug("call journal: checkpoint statistics not read: %s", exc)
            except Exception as exc:  # noqa: BLE001 - a journal fault: the next pass retries
                log.warning("call journal: records not pruned: %s", exc)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)
