"""A savepoint taken at parallelism 1 restores at parallelism 2 with every key's memory."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet.flink import read_output_dir  # noqa: E402

from .cluster import wait_for  # noqa: E402
from .support import write_inputs  # noqa: E402
from .test_kill import submit  # noqa: E402

pytestmark = pytest.mark.flink

KEYS = [f"r{i}" for i in range(8)]


def test_savepoint_at_parallelism_1_restores_at_parallelism_2(cluster, tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_inputs(inputs / "a.jsonl", [{"key": k, "v": i} for i in range(2) for k in KEYS])
    out = tmp_path / "out"
    job = submit(cluster, tmp_path, "BlobAgent", inputs, out, "--parallelism", "1")
    try:
        wait_for(
            "16 outputs at parallelism 1",
            lambda: len(read_output_dir(out)) >= 16,
            120,
            explain=lambda: cluster.explain(job),
        )
        savepoint = cluster.stop_with_savepoint(job, tmp_path / "savepoints")
    except BaseException:
        cluster.cancel(job)
        raise
    write_inputs(inputs / "b.jsonl", [{"key": k, "v": 2} for k in KEYS])
    job2 = submit(
        cluster,
        tmp_path,
        "BlobAgent",
        inputs,
        out,
        "--parallelism",
        "2",
        "--from-savepoint",
        savepoint,
    )
    try:
        assert cluster.rest(f"/jobs/{job2}")["vertices"][-1]["parallelism"] == 2
        wait_for(
            "8 more outputs at parallelism 2",
            lambda: len(read_output_dir(out)) >= 24,
            120,
            explain=lambda: cluster.explain(job2),
        )
    finally:
        cluster.cancel(job2)
    by_key = defaultdict(list)
    for rec in read_output_dir(out):
        by_key[rec["key"]].append(rec["output"])
    for key in KEYS:
        outs = sorted(by_key[key], key=lambda o: o["count"])
        # Memory written at parallelism 1 (count, the bytes blob) is there at parallelism 2.
        assert [o["count"] for o in outs] == [1, 2, 3], (key, outs)
        assert [o["v"] for o in outs] == [0, 1, 2]
        assert outs[-1]["blob_type"] == "bytes"
        assert outs[-1]["blob"] == bytes([0, 255, 1, 255, 2, 255]).hex()
