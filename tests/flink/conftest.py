from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HAVE_PYFLINK = importlib.util.find_spec("pyflink") is not None

# The suite runs in one execution mode throughout: `make test-flink` sets process and
# `make test-flink-thread` thread; run directly, process (the CLI's own default would differ
# between local runs, thread, and cluster runs, process).
os.environ.setdefault("RATCHET_FLINK_EXECUTION_MODE", "process")


@pytest.fixture
def cluster(standalone_cluster: Any) -> Iterator[Any]:
    """The suite's standalone cluster, idle: a live TaskManager, every slot free. A test that
    would otherwise wait for outputs on a cluster an earlier test left unusable fails here,
    saying what the cluster was doing."""
    standalone_cluster.ready()
    yield standalone_cluster
    # A JVM that crashed while this test ran (a kill test's SIGKILL writes no crash report).
    standalone_cluster.check_crashes()


@pytest.fixture(scope="session")
def standalone_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One standalone cluster (JobManager + TaskManager, 2 slots) for the whole Flink suite."""
    if not HAVE_PYFLINK:
        pytest.skip("PyFlink is not installed")
    from .cluster import Cluster

    c = Cluster(Path(tmp_path_factory.mktemp("flink-cluster")))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """A real PostgreSQL server (the connector tests' helper) for the call journal's tests."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "connectors"))
    from connector_servers import postgres_or_skip

    yield from postgres_or_skip()
