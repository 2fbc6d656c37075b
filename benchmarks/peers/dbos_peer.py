"""DBOS Transact on its SQLite system database. One workflow per input, its id derived from
the input (`w1-i17`), its steps the same steps; per-key memory is a row of the application's
own SQLite database written by a `@ds.transaction()` step (DBOS records the step's result in
the same transaction: exactly once). A key's inputs go one at a time, in order, on a thread;
at most 64 inputs run at once.

Resuming after a kill: `DBOS.launch()` recovers the workflows left PENDING (they continue
from their last recorded step), and the program submits every input again under the same
workflow id: a finished workflow returns its recorded result without running. So the user
re-runs the same command. The output step appends to a JSONL file; a step is at least once,
so a kill after the write and before DBOS records the step writes the line again.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c  # noqa: E402
import sqlalchemy as sa  # noqa: E402
from dbos import DBOS, DBOSConfig, SetWorkflowID, SQLAlchemyDatasource  # noqa: E402

ARGS = c.peer_args()
WD: Path = ARGS.workdir
WD.mkdir(parents=True, exist_ok=True)
config: DBOSConfig = {
    "name": "ratchet-peers",
    "system_database_url": f"sqlite:///{WD / 'dbos_sys.sqlite'}",
    "log_level": "WARNING",
}
DBOS(config=config)
ds = SQLAlchemyDatasource.create(f"sqlite:///{WD / 'app.sqlite'}")
with ds.engine.begin() as conn:
    conn.execute(sa.text("CREATE TABLE IF NOT EXISTS memory (key TEXT PRIMARY KEY, value TEXT)"))

_out_lock = threading.Lock()
_out = open(WD / "out.jsonl", "a")
_http: Any = None


@DBOS.step()
def emit(payload: dict[str, Any]) -> None:
    with _out_lock:
        _out.write(json.dumps(payload) + "\n")
        _out.flush()


@ds.transaction()
def remember(key: str, value: dict[str, Any]) -> None:
    ds.sql_session().execute(
        sa.text("INSERT OR REPLACE INTO memory (key, value) VALUES (:k, :v)"),
        {"k": key, "v": json.dumps(value)},
    )


@ds.transaction()
def recall(key: str) -> dict[str, Any]:
    row = (
        ds.sql_session()
        .execute(sa.text("SELECT value FROM memory WHERE key = :k"), {"k": key})
        .fetchone()
    )
    return json.loads(row[0]) if row else {}


@DBOS.step()
def one(v: int) -> int:
    return v


@DBOS.workflow()
def three_steps(inp: dict[str, Any]) -> None:
    mid = one(inp["v"])
    remember(inp["key"], {"v": mid})
    emit({"id": inp["id"], "v": mid})


@DBOS.step()
def simulated_model(v: int) -> str:
    time.sleep(c.W2_DELAY)
    return f"answer {v}"


@DBOS.workflow()
def slow_call(inp: dict[str, Any]) -> None:
    answer = simulated_model(inp["v"])
    remember(inp["key"], {"last": answer})
    emit({"id": inp["id"], "answer": answer})


@DBOS.step()
def ask_model(iid: str, n: int) -> str:
    return str(_http.call(iid, n))


@DBOS.workflow()
def two_calls(inp: dict[str, Any]) -> None:
    first = ask_model(inp["id"], 1)
    second = ask_model(inp["id"], 2)
    remember(inp["key"], {"last": inp["id"]})
    emit({"id": inp["id"], "answers": [first, second]})


@DBOS.workflow()
def keep(inp: dict[str, Any]) -> None:
    mem = recall(inp["key"])
    remember(inp["key"], {
        "count": mem.get("count", 0) + 1,
        "profile": {"name": f"customer {inp['key']}", "tier": inp["v"] % 3},
    })  # fmt: skip
    emit({"id": inp["id"]})


def drive(workflow: Any, prefix: str, inputs: list[dict[str, Any]]) -> None:
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for inp in inputs:
        by_key[inp["key"]].append(inp)
    slots = threading.BoundedSemaphore(c.CONCURRENCY)

    def one_key(items: list[dict[str, Any]]) -> None:
        for inp in items:
            with slots, SetWorkflowID(f"{prefix}-{inp['id']}"):
                workflow(inp)

    with ThreadPoolExecutor(max_workers=min(len(by_key), 256)) as pool:
        for f in [pool.submit(one_key, v) for v in by_key.values()]:
            f.result()


def main() -> None:
    DBOS.launch()  # recovers workflows a kill left PENDING
    a = ARGS
    if a.workload == "w1":
        n = a.n or c.W1_INPUTS
        t = time.perf_counter()
        drive(three_steps, "w1", c.w1_inputs(n))
        wall = time.perf_counter() - t
        c.emit({"inputs": n, "steps": 3 * n, "wall_s": wall,
                "state_bytes": c.dir_bytes(WD) - (WD / "out.jsonl").stat().st_size})  # fmt: skip
    elif a.workload == "w2":
        n = a.n or c.W2_INPUTS
        t = time.perf_counter()
        drive(slow_call, "w2", c.w2_inputs(n))
        c.emit({"inputs": n, "wall_s": time.perf_counter() - t})
    elif a.workload == "w3":
        global _http
        _http = c.SyncModelClient(a.url)
        drive(two_calls, "w3", c.w3_inputs(a.n or c.W3_INPUTS))
    elif a.workload == "w4-seed":
        drive(keep, "w4", c.w4_inputs(a.n or c.W4_KEYS))
        print("READY", flush=True)
        time.sleep(3600)
    elif a.workload == "w4-resume":
        drive(keep, "w4", c.w4_inputs(a.n or c.W4_KEYS) + [c.w4_new_input()])
    DBOS.destroy()


if __name__ == "__main__":
    main()
