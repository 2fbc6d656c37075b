"""ratchet on the five workloads. `mode`: `default` (checkpoint every 200 ms, SQLite
synchronous=NORMAL) or `strict` (a checkpoint before every output is released, i.e.
checkpoint_interval=0, and synchronous=FULL: the closest to the peers' per-step commits).

Workloads 3 and 4 run the `ratchet run` CLI, the way a user would; resuming is re-running it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c  # noqa: E402

MODES = {
    "default": {"checkpoint_interval": 0.2, "synchronous": "NORMAL"},
    "strict": {"checkpoint_interval": 0.0, "synchronous": "FULL"},
    "workers2": {"checkpoint_interval": 0.2, "synchronous": "NORMAL"},  # default, 2 processes
}
WORKERS = {"workers2": 2}  # `ratchet.run(..., workers=N)` / `ratchet run --workers N`


def cli_cmd(agent: str, wd: Path, mode: str, follow: bool = False) -> list[str]:
    m = MODES[mode]
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", f"{Path(__file__).parent / 'ratchet_agents.py'}:{agent}",
        "--input", str(wd / "in.jsonl"), "--output", str(wd / "out.jsonl"), "--state", str(wd / "state"),
        "--checkpoint-interval", str(m["checkpoint_interval"] * 1000), "--synchronous", m["synchronous"].lower(),
    ]  # fmt: skip
    return cmd + (["--follow"] if follow else [])


def main() -> None:
    a = c.peer_args()
    wd: Path = a.workdir
    wd.mkdir(parents=True, exist_ok=True)
    cfg = MODES[a.mode]
    workers = WORKERS.get(a.mode, 1)
    if a.workload in ("w1", "w2"):  # in this process; w3 and w4 exec the CLI, importing nothing
        if workers == 1:  # with workers, ratchet loads the agent's file itself (below)
            import ratchet_agents as agents

        from ratchet import EngineConfig, run

    if a.workload == "w1":
        n = a.n or c.W1_INPUTS
        inputs = c.w1_inputs(n)
        # With workers, the agent goes by its spec: ratchet loads it (a few ms, timed) and forks
        # the workers from this process, as `ratchet run --workers N` does.
        spec = f"{Path(__file__).resolve().parent / 'ratchet_agents.py'}:ThreeSteps"
        agent = agents.ThreeSteps() if workers == 1 else spec
        t = time.perf_counter()
        res = run(
            agent, inputs=inputs, output=wd / "out.jsonl", state_dir=wd / "state",
            config=EngineConfig(**cfg), workers=workers,
        )  # fmt: skip
        wall = time.perf_counter() - t
        assert res.runs_completed == n, res
        c.emit({"inputs": n, "steps": 3 * n, "wall_s": wall, "state_bytes": c.dir_bytes(wd / "state"),
                "outputs": len(c.output_ids(wd / "out.jsonl"))})  # fmt: skip
    elif a.workload == "w2":
        n = a.n or c.W2_INPUTS
        t = time.perf_counter()
        run(
            agents.SlowCall(), inputs=c.w2_inputs(n), output=wd / "out.jsonl", state_dir=wd / "state",
            config=EngineConfig(max_concurrent_runs=c.CONCURRENCY, **cfg),
        )  # fmt: skip
        c.emit({"inputs": n, "wall_s": time.perf_counter() - t})
    elif a.workload == "w3":
        if not (wd / "in.jsonl").exists():
            c.write_jsonl(wd / "in.jsonl", c.w3_inputs(a.n or c.W3_INPUTS))
        os.environ["PEER_MODEL_URL"] = a.url
        cmd = cli_cmd("TwoCalls", wd, a.mode)
        os.execv(cmd[0], cmd)  # the same command, first run and resume alike
    elif a.workload == "w4-seed":
        c.write_jsonl(wd / "in.jsonl", c.w4_inputs(a.n or c.W4_KEYS))
        cmd = cli_cmd("Keyed", wd, a.mode, follow=True)
        os.execv(cmd[0], cmd)
    elif a.workload == "w4-resume":
        c.write_jsonl(wd / "in.jsonl", [c.w4_new_input()], mode="a")
        cmd = cli_cmd("Keyed", wd, a.mode, follow=True)
        os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
