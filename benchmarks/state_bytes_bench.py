"""State bytes on disk per step, workload 5 of benchmarks/peers (issue 19), beside PyFlink.

Workload 5 is what is on disk after workload 1 (20,000 inputs over 1,000 keys; an event, a
memory write and an output per input: 60,000 steps). ratchet runs it in this process with
the peers' agent at its default settings, once with run traces kept (the default, the last
20 runs per key) and once with `trace_retention="off"`; its bytes are the state directory
after the run (the SQLite file: `run()` checkpoints the WAL into it as it closes). PyFlink
runs `benchmarks/peers/pyflink_peer.py w1` in its own venv; its bytes are its retained
checkpoints (`_flink.py`), as in the peers' table. Also printed: where ratchet's bytes are,
by table and index (SQLite's `dbstat`).

    .venv/bin/python benchmarks/state_bytes_bench.py [--n 20000] [--pyflink .venv-flink/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

import _common as c  # noqa: E402


def ratchet_bytes(wd: Path, n: int, retention: str) -> tuple[int, list[tuple[str, int]]]:
    import ratchet_agents

    from ratchet import EngineConfig, run

    run(
        ratchet_agents.ThreeSteps(), inputs=c.w1_inputs(n), output=wd / "out.jsonl",
        state_dir=wd / "state", config=EngineConfig(trace_retention=retention),
    )  # fmt: skip
    total = c.dir_bytes(wd / "state")  # before opening it here adds a -shm file
    db = sqlite3.connect(f"file:{wd / 'state' / 'ratchet.db'}?mode=ro", uri=True)
    try:
        by = db.execute(
            "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC"
        ).fetchall()
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        page = db.execute("PRAGMA page_size").fetchone()[0]
    finally:
        db.close()
    return total, [*by, ("(free pages)", free * page)]


def pyflink_bytes(python: str, wd: Path, n: int) -> int | None:
    cmd = [
        python,
        str(HERE / "peers" / "pyflink_peer.py"),
        "w1",
        "--workdir",
        str(wd),
        "--n",
        str(n),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, start_new_session=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return int(result["state_bytes"]) if "state_bytes" in result else None
    print(f"PyFlink printed no result (exit {out.returncode}): {out.stderr[-1500:]}")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=c.W1_INPUTS)
    default_flink = Path(__file__).resolve().parents[1] / ".venv-flink" / "bin" / "python"
    ap.add_argument("--pyflink", default=str(default_flink), help="PyFlink's python ('' to skip)")
    a = ap.parse_args()
    steps = 3 * a.n
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-w5-"))
    rows: list[tuple[str, int | None]] = []
    for label, retention in (
        ("ratchet, traces kept (default)", "20"),
        ("ratchet, traces off", "off"),
    ):
        total, by = ratchet_bytes(tmp / retention, a.n, retention)
        rows.append((label, total))
        print(f"{label}: {total:,} bytes; by table: "
              + ", ".join(f"{name} {size:,}" for name, size in [*by[:6], by[-1]]))  # fmt: skip
    flink = None
    if a.pyflink and os.path.exists(a.pyflink):
        flink = pyflink_bytes(a.pyflink, tmp / "pyflink", a.n)
        rows.append(("PyFlink (2 retained checkpoints)", flink))
    print(f"\nworkload 5 after {a.n} inputs ({steps} steps); load {os.getloadavg()[0]:.2f}")
    print("| state | bytes | bytes/step | vs PyFlink |")
    print("|---|---|---|---|")
    for label, b in rows:
        if b is None:
            continue
        ratio = f"{b / flink:.2f}x" if flink else "-"
        print(f"| {label} | {b:,} | {b / steps:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
