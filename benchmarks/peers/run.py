"""ratchet beside its peers on the five workloads of issue 7, in one run, one table.

    bash benchmarks/peers/setup.sh                  # once: one venv per peer under .bench/
    python3 benchmarks/peers/run.py [--repeat 3] [--quick] [--peers ratchet-default,dbos,...]

Every workload of every peer runs in a subprocess of that peer's own venv (.bench/<venv>);
a peer whose venv is missing is shown as "not installed". Figures are medians over
`--repeat` repetitions. The driver itself needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BENCH = ROOT / ".bench"
sys.path.insert(0, str(HERE))

import _common as c  # noqa: E402


@dataclass
class Peer:
    name: str
    venv: str
    module: str
    mode: str
    durability: str
    packages: list[str]
    workloads: set[str]
    w1_inputs: int = c.W1_INPUTS  # slow peers run fewer; the table says how many
    w4_copy: bool = True  # restart each repetition from a copy of the seeded state
    w4_settle: float = 0.5  # after the seed's last output, let its state reach disk
    timeout: float = 600
    env: dict[str, str] = field(default_factory=dict)

    @property
    def python(self) -> Path:
        return BENCH / self.venv / "bin" / "python"

    def installed(self) -> bool:
        return self.python.exists() and (BENCH / self.venv / ".installed").exists()


ALL = {"w1", "w2", "w3", "w4"}
PEERS = [
    Peer("ratchet", "ratchet", "ratchet_peer.py", "default",
         "checkpoint every 200 ms, SQLite WAL synchronous=NORMAL; outputs released after their checkpoint",
         ["ratchet"], ALL),
    Peer("ratchet strict", "ratchet", "ratchet_peer.py", "strict",
         "checkpoint_interval=0 (a checkpoint before each output is released), synchronous=FULL",
         ["ratchet"], ALL),
    Peer("ratchet 2 workers", "ratchet", "ratchet_peer.py", "workers2",
         "as ratchet, keys sharded over 2 worker processes (`--workers 2`), one SQLite file each",
         ["ratchet"], {"w1"}),
    Peer("asyncio", "asyncio", "asyncio_peer.py", "default", "none (the floor)",
         [], {"w1", "w2", "w3"}),
    Peer("LangGraph", "langgraph", "langgraph_peer.py", "default",
         "durability='sync': a checkpoint per super-step; SqliteSaver (1), AsyncSqliteSaver (2-4); SQLite WAL, synchronous=FULL (sqlite's default)",
         ["langgraph", "langgraph-checkpoint-sqlite"], ALL, w1_inputs=2_000, w4_settle=0.2),
    Peer("DBOS", "dbos", "dbos_peer.py", "default",
         "SQLite system database (sqlite's defaults: synchronous=FULL): each step's result recorded when it returns; memory by @ds.transaction (exactly once)",
         ["dbos"], ALL, w1_inputs=1_000, w4_settle=0.2),
    Peer("Flink Agents", "flink-agents", "flink_agents_peer.py", "default",
         "Flink checkpoints every 1 s (hashmap state, filesystem storage); outputs by FileSink, committed on checkpoint",
         ["flink-agents", "apache-flink"], ALL, w4_copy=False, w4_settle=3.0, timeout=900),
    Peer("PyFlink", "pyflink", "pyflink_peer.py", "default",
         "Flink checkpoints every 1 s (hashmap state, filesystem storage); outputs by FileSink, committed on checkpoint",
         ["apache-flink"], {"w1", "w4"}, w4_copy=False, w4_settle=3.0, timeout=900),
    Peer("ratchet on Flink", "ratchet-flink", "ratchet_flink_peer.py", "default",
         "Flink checkpoints every 1 s (hashmap state, filesystem storage); outputs by FileSink, committed on checkpoint; durable-call records in keyed state",
         ["ratchet", "apache-flink"], ALL, w4_copy=False, w4_settle=3.0, timeout=900),
    Peer("ratchet on Flink thread", "ratchet-flink", "ratchet_flink_peer.py", "thread",
         "as ratchet on Flink, its Python functions in thread mode (Pemja, inside the JVM: `--execution-mode thread`)",
         ["ratchet", "apache-flink"], ALL, w4_copy=False, w4_settle=3.0, timeout=900),
]  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def session_pids(sid: int) -> list[int]:
    """Processes still alive in a session we started (Flink's orphaned Python workers)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            pids.append(int(d))
    return pids


def end_session(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group we started, then every straggler of its session, by PID."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for _ in range(3):
        left = [p for p in session_pids(proc.pid) if p != os.getpid()]
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def start(peer: Peer, workload: str, wd: Path, extra: list[str] | None = None,
          env: dict[str, str] | None = None, capture: bool = True) -> subprocess.Popen[Any]:  # fmt: skip
    cmd = [str(peer.python), str(HERE / peer.module), workload, "--workdir", str(wd),
           "--mode", peer.mode, *(extra or [])]  # fmt: skip
    e = c.installed_env({**os.environ, **peer.env, **(env or {}), "PYTHONUNBUFFERED": "1"})
    wd.mkdir(parents=True, exist_ok=True)
    log_fh = open(wd.parent / f"{wd.name}.log", "ab")
    return subprocess.Popen(
        cmd, env=e, start_new_session=True, stdout=subprocess.PIPE if capture else log_fh,
        stderr=log_fh, text=capture,
    )  # fmt: skip


def run_once(peer: Peer, workload: str, wd: Path, extra: list[str]) -> dict[str, Any]:
    proc = start(peer, workload, wd, extra)
    try:
        out, _ = proc.communicate(timeout=peer.timeout)
    except subprocess.TimeoutExpired:
        end_session(proc)
        return {"error": f"timed out after {peer.timeout:.0f} s"}
    finally:
        end_session(proc)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (wd.parent / f"{wd.name}.log").read_text(errors="replace")[-600:]
    return {"error": f"exit {proc.returncode}: {tail}"}


def w3_once(peer: Peer, wd: Path, url: str) -> dict[str, Any]:
    """Kill the peer when the 250th input makes its first model call; re-run the same command."""
    c.control(url, "/reset")
    proc = start(peer, "w3", wd, ["--url", url], env={"PEER_MODEL_URL": url}, capture=False)
    c.control(url, "/arm", {"pgid": proc.pid, "after": c.W3_KILL_AFTER})
    try:
        proc.wait(timeout=peer.timeout)
    except subprocess.TimeoutExpired:
        pass
    end_session(proc)
    first = c.control(url, "/stats")
    if not first["killed"]:
        return {"error": "the kill point was not reached"}
    before = len(c.output_ids(out_path(peer, wd)))
    c.control(url, "/arm", {"pgid": 0, "after": 0})
    t = time.perf_counter()
    proc = start(peer, "w3", wd, ["--url", url], env={"PEER_MODEL_URL": url}, capture=False)
    try:
        proc.wait(timeout=peer.timeout)
    except subprocess.TimeoutExpired:
        pass
    end_session(proc)
    resume_s = time.perf_counter() - t
    stats = c.control(url, "/stats")
    ids = c.output_ids(out_path(peer, wd))
    expected = {f"i{i}" for i in range(c.W3_INPUTS)}
    return {
        "repeated": stats["repeated_after_answer"],
        "inflight_at_kill": stats["inflight_at_kill"],
        "answered_before_kill": stats["answered_before_kill"],
        "requests": stats["requests"],
        "lost": len(expected - set(ids)),
        "duplicated": len(ids) - len(set(ids)),
        "outputs_before_kill": before,
        "resume_s": resume_s,
    }


def out_path(peer: Peer, wd: Path) -> Path:
    return wd / (
        "out" if peer.venv in ("flink-agents", "pyflink", "ratchet-flink") else "out.jsonl"
    )


def wait_ids(
    path: Path, want: int | str, timeout: float, proc: subprocess.Popen[Any]
) -> float | None:
    """Wait until the sink holds `want` outputs (a count, or one id); the time it did. None
    if `proc` (the peer writing them) exits first, or at the timeout.

    A sleep-based wait: every 5 ms it reads only the lines appended since it last looked, so
    the driver takes next to no CPU from the peer it measures."""
    tail = c.OutputTail(path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tail.has(want):
            return time.perf_counter()
        if proc.poll() is not None:
            return time.perf_counter() if tail.has(want) else None
        time.sleep(0.005)
    return None


def w4(peer: Peer, base: Path, repeat: int) -> dict[str, Any]:
    """Seed 10,000 keys, SIGKILL, then time restart -> first new output, `repeat` times."""
    seed = base / "w4-seed"
    proc = start(peer, "w4-seed", seed, capture=False)
    got = wait_ids(out_path(peer, seed), c.W4_KEYS, peer.timeout, proc)
    time.sleep(peer.w4_settle)
    end_session(proc)
    if got is None:
        return {"error": "seeding did not finish"}
    times = []
    for r in range(repeat):
        wd = base / f"w4-rep{r}"
        if peer.w4_copy:
            shutil.copytree(seed, wd)
        else:
            wd = seed
        new_id = f"new{r}"
        t = time.perf_counter()
        proc = start(peer, "w4-resume", wd, env={"PEER_NEW_ID": new_id}, capture=False)
        got = wait_ids(out_path(peer, wd), new_id, peer.timeout, proc)
        end_session(proc)
        if got is None:
            return {"error": f"no new output after restart (rep {r})"}
        times.append(got - t)
        log(f"  {peer.name} w4 rep {r}: {got - t:.2f} s")
    return {"restart_to_output_s": statistics.median(times), "all": times}


def versions(peer: Peer) -> str:
    if not peer.packages:
        return "standard library only"
    code = ("import importlib.metadata as m, json, sys; print(json.dumps({p: m.version(p) for p in "
            + repr(peer.packages) + "}))")  # fmt: skip
    try:
        out = subprocess.run([str(peer.python), "-c", code], capture_output=True, text=True,
                             timeout=60, check=True).stdout  # fmt: skip
        return " ".join(f"{k} {v}" for k, v in json.loads(out).items())
    except (subprocess.SubprocessError, ValueError, OSError):
        return "?"


def med(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else None


def measure(peer: Peer, repeat: int, quick: bool, root: Path, url: str,
            workloads: set[str]) -> dict[str, Any]:  # fmt: skip
    res: dict[str, Any] = {"installed": peer.installed()}
    if not res["installed"]:
        return res
    res["versions"] = versions(peer)
    if "ratchet" in peer.packages:  # the other peers are pip-installed, so compiled already
        c.compile_ratchet(peer.python, {**os.environ, **peer.env})
    tag = peer.name.replace(" ", "-").lower()
    if "w1" in workloads and "w1" in peer.workloads:
        n = peer.w1_inputs // (10 if quick else 1)
        runs = []
        for r in range(repeat):
            out = run_once(peer, "w1", root / f"{tag}-w1-{r}", ["--n", str(n)])
            log(f"  {peer.name} w1 rep {r}: {out}")
            runs.append(out)
        res["w1"] = {"inputs": n, "wall_s": med(runs, "wall_s"), "steps": 3 * n,
                     "first_to_last_s": med(runs, "first_to_last_s"),
                     "state_bytes": med(runs, "state_bytes"),
                     "errors": [r["error"] for r in runs if "error" in r]}  # fmt: skip
    if "w2" in workloads and "w2" in peer.workloads:
        n = c.W2_INPUTS // (10 if quick else 1)
        runs = []
        for r in range(repeat):
            out = run_once(peer, "w2", root / f"{tag}-w2-{r}", ["--n", str(n)])
            log(f"  {peer.name} w2 rep {r}: {out}")
            runs.append(out)
        per_key = -(-n // c.W2_KEYS)
        ideal = max(-(-n // c.CONCURRENCY), per_key) * c.W2_DELAY
        res["w2"] = {"inputs": n, "wall_s": med(runs, "wall_s"), "ideal_s": ideal,
                     "errors": [r["error"] for r in runs if "error" in r]}  # fmt: skip
    if "w3" in workloads and "w3" in peer.workloads:
        runs = []
        for r in range(repeat):
            out = w3_once(peer, root / f"{tag}-w3-{r}", url)
            log(f"  {peer.name} w3 rep {r}: {out}")
            runs.append(out)
        keys = ["repeated", "inflight_at_kill", "answered_before_kill", "lost", "duplicated",
                "resume_s", "outputs_before_kill"]  # fmt: skip
        res["w3"] = {k: med(runs, k) for k in keys}
        res["w3"]["all"] = runs
        res["w3"]["errors"] = [r["error"] for r in runs if "error" in r]
    if "w4" in workloads and "w4" in peer.workloads:
        res["w4"] = w4(peer, root / f"{tag}-w4", repeat)
        log(f"  {peer.name} w4: {res['w4']}")
    return res


# ----------------------------------------------------------------------------- the table


def fmt_num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def figures(r: dict[str, Any]) -> dict[str, float | None]:
    f: dict[str, float | None] = {}
    w1, w2, w3, w4_ = r.get("w1"), r.get("w2"), r.get("w3"), r.get("w4")
    if w1 and w1.get("wall_s"):
        f["steps_s"] = w1["steps"] / w1["wall_s"]
        f["us_step"] = w1["wall_s"] / w1["steps"] * 1e6
        if w1.get("state_bytes") is not None:
            f["bytes_step"] = w1["state_bytes"] / w1["steps"]
    if w1 and w1.get("first_to_last_s"):
        f["steady_steps_s"] = w1["steps"] / w1["first_to_last_s"]
    if w2 and w2.get("wall_s"):
        f["w2_wall"] = w2["wall_s"]
        f["w2_ratio"] = w2["wall_s"] / w2["ideal_s"]
    if w3 and w3.get("repeated") is not None:
        for k in ("repeated", "inflight_at_kill", "lost", "duplicated"):
            f[k] = w3[k]
    if w4_ and w4_.get("restart_to_output_s") is not None:
        f["restart_s"] = w4_["restart_to_output_s"]
    return f


ROWS = [
    # key, label, format, higher is better
    ("steps_s", "1. trivial 3-step runs: steps/s", ",.0f", True),
    ("us_step", "1. per-step time, µs", ",.1f", False),
    ("steady_steps_s", "1. ... first to last output (no JVM start-up), steps/s", ",.0f", None),
    ("w2_wall", "2. 2,000 x 50 ms calls, 200 keys: wall s", ".2f", False),
    ("w2_ratio", "2. ... ratio to ideal (1.60 s at 64)", ".2f", False),
    ("repeated", "3. calls repeated that had returned before the kill", ".0f", False),
    ("inflight_at_kill", "3. ... calls in flight at the kill", ".0f", None),
    ("lost", "3. outputs lost", ".0f", False),
    ("duplicated", "3. outputs duplicated", ".0f", False),
    ("restart_s", "4. restart -> first new output, 10k keys: s", ".2f", False),
    ("bytes_step", "5. state on disk per step, bytes", ",.1f", False),
]


def ratio(ours: float | None, theirs: float | None, higher: bool | None) -> str:
    if ours is None or theirs is None or higher is None:
        return ""
    if higher:
        return f" ({ours / theirs:.2f}x)" if theirs else ""
    if ours == theirs:
        return " (=)"
    if theirs == 0:
        return " (behind)"
    if ours == 0:
        return " (ahead)"
    return f" ({theirs / ours:.2f}x)"


def table(results: dict[str, dict[str, Any]], header: str) -> str:
    names = [p.name for p in PEERS if p.name in results]
    figs = {n: figures(results[n]) for n in names}
    cols = ["figure", *names]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for key, label, spec, higher in ROWS:
        row = [label]
        for n in names:
            r = results[n]
            if not r.get("installed"):
                row.append("not installed")
                continue
            v = figs[n].get(key)
            cell = fmt_num(v, spec) if v is not None else "n/a"
            if (
                n not in ("ratchet", "ratchet strict")
                and v is not None
                and not (n == "asyncio" and key == "bytes_step")
            ):
                base = "ratchet" if n == "asyncio" else "ratchet strict"
                cell += ratio(figs.get(base, {}).get(key), v, higher)
            row.append(cell)
        lines.append("| " + " | ".join(row) + " |")
    lines.append("| inputs in workload 1 | " + " | ".join(
        str(results[n].get("w1", {}).get("inputs", "-")) for n in names) + " |")  # fmt: skip
    lines.append("| durability | " + " | ".join(
        next(p.durability for p in PEERS if p.name == n) for n in names) + " |")  # fmt: skip
    lines.append("| versions | " + " | ".join(
        results[n].get("versions", "not installed") for n in names) + " |")  # fmt: skip
    errors = [f"- {n} {w}: {e}" for n in names for w in ("w1", "w2", "w3", "w4")
              for e in (results[n].get(w) or {}).get("errors", [])
              + ([results[n][w]["error"]] if "error" in (results[n].get(w) or {}) else [])]  # fmt: skip
    if errors:
        lines += ["", "errors:", *errors]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tenth of workloads 1-2, one repetition")
    ap.add_argument("--peers", default="", help="comma-separated names (default: all)")
    ap.add_argument("--workloads", default="w1,w2,w3,w4")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    ap.add_argument("--keep", action="store_true", help="keep the work folders")
    ap.add_argument("--render", type=Path, default=None, help="print the table of a --json file")
    a = ap.parse_args()
    if a.render:
        saved = json.loads(a.render.read_text())
        print(table(saved["results"], saved["header"]))
        return 0
    repeat = 1 if a.quick else a.repeat
    wanted = {s.strip().lower() for s in a.peers.split(",") if s.strip()}
    workloads = {w.strip() for w in a.workloads.split(",")}
    tmp_root = BENCH / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="peers-", dir=tmp_root))
    server = subprocess.Popen(
        [sys.executable, str(HERE / "_common.py"), "--delay", str(c.W3_DELAY)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert server.stdout is not None
    port = int(server.stdout.readline().split()[1])
    url = f"http://127.0.0.1:{port}"
    results: dict[str, dict[str, Any]] = {}
    started = time.time()
    try:
        for peer in PEERS:
            if wanted and peer.name.lower() not in wanted and peer.venv not in wanted:
                continue
            log(f"{peer.name}: {'running' if peer.installed() else 'not installed'}")
            results[peer.name] = measure(peer, repeat, a.quick, root, url, workloads)
    finally:
        end_session(server)
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    header = (
        f"ratchet beside its peers (issue 7): {os.cpu_count()} cores, shared and noisy; "
        f"median of {repeat} repetition(s); {time.time() - started:.0f} s in all; "
        f"python {sys.version.split()[0]}.\n"
        "Peer cells: value (ratchet strict's advantage over the peer, >1 = ratchet ahead; "
        "asyncio is compared with ratchet at its default)."
    )
    print(table(results, header))
    if a.json:
        a.json.write_text(json.dumps({"header": header, "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
