"""Regenerate `schema_v1/` (ratchet.db and in.jsonl) with code whose SQLite schema is version 1.

    mkdir /tmp/v1 && git archive 2990895 src | tar -x -C /tmp/v1   # a commit with schema 1
    PYTHONPATH=/tmp/v1/src .venv/bin/python tests/store/data/make_schema_v1.py

It runs `ratchet run` on `schema_v1_agent.py:SchemaV1Agent` in a subprocess over five inputs;
the last one (`"hold": true`) parks in `quote` after its durable call returned. Once a
checkpoint holds the other four runs completed, that run in flight with `tally` journaled,
its call record written and no output left in the outbox, the process is SIGKILLed. The
WAL is then checkpointed into the database file (so `ratchet.db` alone is the whole state)
and `ratchet.db` and `in.jsonl` are copied out.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ratchet.store import codec
from ratchet.store._sqlite import SCHEMA_VERSION

AGENT = Path(__file__).resolve().with_name("schema_v1_agent.py")
INPUTS = [
    {"key": "alice", "value": 3},
    {"key": "bob", "value": 5},
    {"key": "alice", "value": 4},
    {"key": "carol", "value": 1},
    {"key": "bob", "value": 2, "hold": True},
]
HELD_SEQ = len(INPUTS) - 1


def ready(db: Path) -> bool:
    """The held run is in a completed checkpoint, every other run is done and released."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        runs = conn.execute("SELECT seq, journal FROM runs").fetchall()
        inputs = [r[0] for r in conn.execute("SELECT seq FROM inputs")]
        calls = conn.execute("SELECT seq, status FROM calls").fetchall()
        keys = conn.execute("SELECT COUNT(*) FROM keys").fetchone()[0]
        outbox = conn.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]
    except sqlite3.OperationalError:
        return False  # not created yet
    finally:
        conn.close()
    return (
        len(runs) == 1
        and runs[0][0] == HELD_SEQ
        and len(codec.decode(runs[0][1])) == 1  # tally journaled, quote in flight
        and inputs == [HELD_SEQ]
        and calls == [(HELD_SEQ, "ok")]
        and keys == 3
        and outbox == 0
    )


def main(dest: Path) -> None:
    if SCHEMA_VERSION != 1:
        sys.exit(f"this code writes schema {SCHEMA_VERSION}; run me at a commit with schema 1")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "in.jsonl").write_text("".join(json.dumps(i) + "\n" for i in INPUTS))
        marker = tmp / "held"
        cmd = [sys.executable, "-m", "ratchet.cli", "run", f"{AGENT}:SchemaV1Agent"]
        cmd += ["--input", "in.jsonl", "--output", "out.jsonl", "--state", "state"]
        cmd += ["--checkpoint-interval", "20"]
        proc = subprocess.Popen(cmd, cwd=tmp, env=dict(os.environ, SCHEMA_V1_HOLD=str(marker)))
        db = tmp / "state" / "ratchet.db"
        deadline = time.monotonic() + 60
        while not (marker.exists() and ready(db)):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                sys.exit(f"the job ended or stalled before the state was ready (rc {proc.poll()})")
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        conn = sqlite3.connect(db)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(db, dest / "ratchet.db")
        shutil.copyfile(tmp / "in.jsonl", dest / "in.jsonl")
        print(f"wrote {dest / 'ratchet.db'} ({(dest / 'ratchet.db').stat().st_size} bytes)")
        print("outputs before the kill:", (tmp / "out.jsonl").read_text(), sep="\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("schema_v1"))
