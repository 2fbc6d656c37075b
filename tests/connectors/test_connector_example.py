"""The support-triage example's deployed variant: tickets by webhook, results in PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from connector_servers import Postgres, free_port

SCRIPT = Path(__file__).parents[2] / "examples" / "support_triage" / "webhook_to_postgres.py"


def test_the_webhook_to_postgres_variant_triages_every_ticket_once(
    postgres: Postgres, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--postgres", postgres.dsn, "--port", str(free_port()),
         "--state", str(tmp_path / "state"), "--table", "triage_example"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["customer"], r["category"]) for r in results] == [
        ("ann", "shipping"),
        ("bob", "refund"),
        ("ann", "refund"),
        ("cho", "other"),
    ]
    rows = postgres.execute("SELECT count(*), count(DISTINCT id) FROM triage_example")
    assert rows == [(4, 4)]
