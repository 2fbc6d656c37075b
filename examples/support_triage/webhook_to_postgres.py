"""The triage agent as it would be deployed: tickets arrive as webhooks, triage results land in
PostgreSQL.

    python examples/support_triage/webhook_to_postgres.py \\
        --postgres postgresql://app@127.0.0.1:5432/support [--port 8090] [--state DIR]

It starts `ratchet run ... --input http://127.0.0.1:PORT --output postgresql://...?table=...`
(the command a service manager would run), POSTs the tickets of tickets.jsonl to it the way a
helpdesk's webhook would (each with its ticket id as Idempotency-Key, retried until 202),
waits until every result is in the table, prints them, and stops the job with SIGTERM.
Needs `pip install 'ratchet[postgres]'`; the scripted model needs no network.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = "triage_outputs"


def post_ticket(url: str, ticket_id: str, ticket: dict[str, object]) -> None:
    """POST one ticket until the job answers 202 (it may still be starting)."""
    body = json.dumps(ticket).encode()
    while True:
        req = urllib.request.Request(
            f"{url}/v1/events",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Idempotency-Key": ticket_id},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                if resp.status == 202:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code != 429:
                raise SystemExit(
                    f"ticket {ticket_id} refused: {exc.code} {exc.read().decode()}"
                ) from None
            time.sleep(float(exc.headers.get("Retry-After", "1")))
        except OSError:
            time.sleep(0.1)  # not listening yet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--postgres", required=True, help="libpq URI of the database")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--state", help="state directory (default: a new temporary one)")
    parser.add_argument("--table", default=TABLE)
    args = parser.parse_args(argv)
    import psycopg  # the postgres extra

    state = args.state or tempfile.mkdtemp(prefix="triage-webhook-")
    url = f"http://127.0.0.1:{args.port}"
    job = subprocess.Popen(
        [sys.executable, "-m", "ratchet.cli", "run", f"{HERE / 'agent.py'}:TriageAgent",
         "--input", url, "--output", f"{args.postgres}?table={args.table}", "--state", state],
        env={**os.environ, "TRIAGE_PROVIDER": os.environ.get("TRIAGE_PROVIDER", "scripted")},
    )  # fmt: skip
    try:
        tickets = [json.loads(x) for x in (HERE / "tickets.jsonl").read_text().splitlines()]
        for n, ticket in enumerate(tickets, 1):
            post_ticket(url, f"ticket-{n}", ticket)
        deadline = time.monotonic() + 120
        with psycopg.connect(args.postgres, autocommit=True) as conn:
            while True:
                if job.poll() is not None:
                    raise SystemExit(f"the job exited with {job.returncode}")
                try:
                    rows = conn.execute(
                        f"SELECT key, record FROM {args.table} ORDER BY seq, id"  # noqa: S608
                    ).fetchall()
                except psycopg.errors.UndefinedTable:
                    rows = []
                if len(rows) >= len(tickets) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        for key, record in rows:
            print(json.dumps({"customer": key, **(record["output"] or {"error": record["error"]})}))
    finally:
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=60)
    print(f"{len(rows)} results in table {args.table}; state in {state}", file=sys.stderr)
    return 0 if len(rows) == len(tickets) else 1


if __name__ == "__main__":
    raise SystemExit(main())
