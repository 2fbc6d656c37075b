"""The per-step path (issue 19), as ratios measured in one run. Two figures:

(1) workload 1 of benchmarks/peers (20,000 inputs over 1,000 keys; an event, a memory write,
    an output per input), ratchet's default configuration beside the plain-asyncio peer. Both
    run as the peers' own subprocesses (`ratchet_peer.py w1`, `asyncio_peer.py w1`), one
    after the other, pinned to the same core: per-step time, and ratchet's ratio to asyncio
    (asyncio's per-step time over ratchet's; the issue asks for >= 0.1x);
(2) `ratchet run` through the CLI, a one-action agent with one memory write and one output
    per input (the agent of connectors_bench.py: 20,000 JSONL inputs over 7 keys, JSONL
    out, default checkpoint interval), pinned to one core: inputs/s from spawning the
    process to its exit, and with the same command's start-up on a one-line input taken
    off (the issue asks for >= 15k inputs/s on one worker).

Every child is waited on (`wait()`), never polled, so the driver takes no CPU while a
figure is measured.

    .venv/bin/python benchmarks/perstep_bench.py [--repeat 3] [--n 20000] [--cpu 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
sys.path.insert(0, str(HERE / "peers"))

import _common as c  # noqa: E402

KEYS = 7
AGENT_SRC = textwrap.dedent(
    """
    from ratchet import Agent, InputEvent, OutputEvent, action

    class OneStep(Agent):
        @action(InputEvent, inline=True)
        def one(self, event, ctx):
            n = ctx.short_term_memory.get("n", 0) + 1
            ctx.short_term_memory.set("n", n)
            ctx.send_event(OutputEvent(output={"i": event.input["i"], "n": n}))
    """
)


def pinned(cmd: list[str], cpu: int | None) -> list[str]:
    return ["taskset", "-c", str(cpu), *cmd] if cpu is not None else cmd


def peer_w1(module: str, n: int, wd: Path, cpu: int | None) -> float:
    """Seconds per step of one peer's workload 1, as the peer itself reports it."""
    cmd = [sys.executable, str(PEERS / module), "w1", "--workdir", str(wd), "--n", str(n)]
    out = subprocess.run(pinned(cmd, cpu), capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return float(result["wall_s"]) / float(result["steps"])
    raise RuntimeError(f"{module} printed no result: {out[-500:]}")


def cli_seconds(agent: str, inputs: Path, wd: Path, cpu: int | None) -> float:
    """Seconds from spawning `ratchet run` over `inputs` to its exit (all outputs written)."""
    cmd = [sys.executable, "-m", "ratchet.cli", "run", agent, "--input", str(inputs),
           "--output", str(wd / "out.jsonl"), "--state", str(wd / "state")]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.Popen(pinned(cmd, cpu), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = proc.communicate()  # waits on the child: no polling
    took = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"ratchet run exited {proc.returncode}: {err.decode()[-2000:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--cpu", type=int, default=0, help="the core to pin children to (-1: none)")
    a = ap.parse_args()
    c.compile_ratchet(sys.executable)  # children start as from a user's install
    cpu = None if a.cpu < 0 else a.cpu
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-perstep-"))
    steps: dict[str, list[float]] = {"ratchet": [], "asyncio": []}
    cli: list[float] = []
    startup: list[float] = []
    (tmp / "agent.py").write_text(AGENT_SRC)
    agent = f"{tmp / 'agent.py'}:OneStep"
    with open(tmp / "in.jsonl", "w") as fh:
        for i in range(a.n):
            fh.write(json.dumps({"key": f"k{i % KEYS}", "i": i}) + "\n")
    (tmp / "one.jsonl").write_text(json.dumps({"key": "k0", "i": 0}) + "\n")
    for r in range(a.repeat):
        steps["ratchet"].append(peer_w1("ratchet_peer.py", a.n, tmp / f"r{r}", cpu))
        steps["asyncio"].append(peer_w1("asyncio_peer.py", a.n, tmp / f"a{r}", cpu))
        cli.append(cli_seconds(agent, tmp / "in.jsonl", tmp / f"c{r}", cpu))
        startup.append(cli_seconds(agent, tmp / "one.jsonl", tmp / f"s{r}", cpu))
    ours, base = statistics.median(steps["ratchet"]), statistics.median(steps["asyncio"])
    took, start = statistics.median(cli), statistics.median(startup)
    print(f"{os.cpu_count()} cores, children pinned to cpu {cpu}; median of {a.repeat}")
    print(f"(1) workload 1, {a.n} inputs: ratchet {ours * 1e6:.1f} us/step, plain asyncio "
          f"{base * 1e6:.2f} us/step: ratchet at {base / ours:.3f}x of plain asyncio")  # fmt: skip
    print(f"(2) ratchet run, {a.n} inputs, one action: {took:.2f} s, {a.n / took:,.0f} inputs/s "
          f"from spawn to exit; start-up (one input) {start:.2f} s; without it "
          f"{a.n / max(took - start, 1e-9):,.0f} inputs/s")  # fmt: skip


if __name__ == "__main__":
    main()
