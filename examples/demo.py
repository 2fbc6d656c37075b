"""`make demo`: a real agent run on the embedded default, killed with SIGKILL part-way, resumed.

It shows what ratchet promises: every order decided exactly once, every customer's memory
intact (bytes included), and how much of the work the restart skipped because it was
already committed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from orders_agent import expected_memory  # noqa: E402

from ratchet.store import codec  # noqa: E402
from ratchet.store._sqlite import SqliteStore  # noqa: E402

console = Console()
HERE = Path(__file__).resolve().parent
WORK = HERE.parent / "demo-out"
N_ORDERS = 3000
N_CUSTOMERS = 50


def make_orders(path: Path) -> list[dict]:
    rng = random.Random(42)
    orders = [
        {
            "id": i,
            "customer": f"cust-{rng.randrange(N_CUSTOMERS):02d}",
            "amount": rng.randint(5, 500),
        }
        for i in range(N_ORDERS)
    ]
    path.write_text("".join(json.dumps(o) + "\n" for o in orders))
    return orders


def ratchet_run(*extra: str) -> list[str]:
    return [
        sys.executable, "-m", "ratchet.cli", "run", f"{HERE / 'orders_agent.py'}:OrderAgent",
        "--input", str(WORK / "orders.jsonl"), "--output", str(WORK / "decisions.jsonl"),
        "--state", str(WORK / "state"), "--key", "customer", *extra,
    ]  # fmt: skip


def count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open("rb") as fh:
        return sum(1 for _ in fh)


def main() -> int:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir()
    orders = make_orders(WORK / "orders.jsonl")
    console.rule("[bold]ratchet demo")
    console.print(
        f"{N_ORDERS} orders from {N_CUSTOMERS} customers -> OrderAgent "
        f"(per-customer memory, a durable scoring call per order)\nstate: {WORK / 'state'}"
    )

    kill_at = N_ORDERS * 2 // 5
    console.print(
        f"\n[bold]1.[/] start [cyan]ratchet run[/] and SIGKILL it once ~{kill_at} decisions are out"
    )
    env = dict(os.environ, ORDERS_CALL_LOG=str(WORK / "paid-calls.log"))
    proc = subprocess.Popen(
        ratchet_run(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
    while proc.poll() is None and count_lines(WORK / "decisions.jsonl") < kill_at:
        time.sleep(0.005)
    if proc.poll() is not None:
        console.print(f"[red]the run ended before the kill:[/] {proc.stderr.read().decode()}")
        return 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    before = count_lines(WORK / "decisions.jsonl")
    store = SqliteStore.open_readonly(WORK / "state")
    s = store.summary()
    in_flight_calls = sum(1 for c in store.load().calls if c.status == "intent")
    store.close()
    console.print(
        f"   killed pid {proc.pid} (exit {proc.returncode}): {before} decisions written, "
        f"checkpoint #{s['checkpoints']['latest_completed']['id']} holds {s['in_flight_runs']} "
        f"in-flight runs and {s['queued_inputs']} queued inputs"
    )

    console.print("\n[bold]2.[/] restart with the same --state")
    done = subprocess.run(ratchet_run("--json"), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        console.print(f"[red]restart failed:[/] {done.stderr}")
        return 1
    summary = json.loads(done.stdout)
    console.print(
        f"   restored checkpoint #{summary['restored_from_checkpoint']}: "
        f"{summary['restored_runs']} in-flight runs resumed from their journals, "
        f"{summary['runs_completed']} runs finished in this process"
    )

    console.print("\n[bold]3.[/] check the promises")
    decisions = [json.loads(line) for line in (WORK / "decisions.jsonl").read_text().splitlines()]
    ids = [d["id"] for d in decisions]
    decided = sorted(d["output"]["order"] for d in decisions)
    store = SqliteStore.open_readonly(WORK / "state")
    memory = {
        codec.decode(k): {p: v for p, v in codec.decode(m)["v"].items()}
        for k, m in store.memories()
    }
    store.close()
    expected = expected_memory(orders)
    blob_ok = all(type(m["last_order_digest"]) is bytes for m in memory.values())
    table = Table(show_header=True, header_style="bold")
    table.add_column("promise")
    table.add_column("result")
    table.add_row(
        "every order decided exactly once",
        ok(
            decided == list(range(N_ORDERS)) and len(set(ids)) == len(ids),
            f"{len(decisions)} decisions, {len(set(ids))} distinct ids",
        ),
    )
    table.add_row(
        "memory equals a crash-free computation",
        ok(memory == expected, f"{len(memory)} customers compared"),
    )
    table.add_row("bytes in memory came back as bytes", ok(blob_ok, "last_order_digest"))
    table.add_row("tasks replayed from the journal (not run again)", str(summary["tasks_replayed"]))
    table.add_row(
        "durable calls answered from their records after the restart (not made again)",
        str(int(summary["metrics"].get("durable_calls.replayed", 0))),
    )
    table.add_row("tasks executed after the restart", str(summary["tasks_executed"]))
    table.add_row(
        "orders already done before the kill (not touched)",
        str(N_ORDERS - summary["runs_completed"]),
    )
    paid = count_lines(WORK / "paid-calls.log")
    repeated = paid - N_ORDERS
    table.add_row(
        "scoring calls paid for",
        ok(
            repeated <= in_flight_calls,
            f"{paid} for {N_ORDERS} orders: {repeated} repeated, {in_flight_calls} were in "
            f"flight (started, result not yet recorded) at the kill",
        ),
    )
    console.print(table)  # fmt: skip
    good = decided == list(range(N_ORDERS)) and len(set(ids)) == len(ids) and memory == expected
    good = good and blob_ok and repeated <= in_flight_calls
    console.print(
        "\nTry: [cyan].venv/bin/ratchet status --state demo-out/state[/]  and  "
        "[cyan].venv/bin/ratchet inspect --state demo-out/state --key cust-07[/]"
    )
    return 0 if good else 1


def ok(flag: bool, detail: str) -> str:
    return f"[green]yes[/] ({detail})" if flag else f"[red]NO[/] ({detail})"


if __name__ == "__main__":
    sys.exit(main())
