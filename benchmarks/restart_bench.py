"""Restart to the first new output with 10,000 keys of state (issue 19), beside a baseline.

A real run of workload 4's agent (`benchmarks/peers/ratchet_agents.py:Keyed`: a counter and
a profile per key) over 10,000 keys builds the state. Each repetition copies it, appends one
new input, and times the restart until that input's output is readable in the output file:

- through the CLI: from spawning `ratchet run` (a new interpreter: imports included);
- in process: from calling `ratchet.run(...)` (imports already done).

The baseline is the same command on a new, empty state directory with the same one input,
measured in the same run: the ratio says what the 10,000 keys cost on top of starting at all.
Both checkpoint settings are measured: the default (a checkpoint every 200 ms; an output is
released after the checkpoint that holds it) and `--checkpoint-interval 0` (a checkpoint as
soon as there is something to release).

The driver waits on inotify events of the output file's folder and on the child's pidfd,
never polling, so it takes no CPU while a figure is measured.

    .venv/bin/python benchmarks/restart_bench.py [--keys 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

import _common as c  # noqa: E402

AGENT = f"{HERE / 'peers' / 'ratchet_agents.py'}:Keyed"
_IN_MODIFY, _IN_CREATE, _IN_MOVED_TO, _IN_CLOEXEC = 0x2, 0x100, 0x80, 0o2000000


class OutputWatch:
    """Block until a line holding `want` appears in `path` (inotify on its folder)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(_IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        mask = _IN_MODIFY | _IN_CREATE | _IN_MOVED_TO
        if libc.inotify_add_watch(self.fd, str(path.parent).encode(), mask) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path.parent}")
        self.offset = path.stat().st_size if path.exists() else 0

    def _seen(self, want: str) -> bool:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return False
        return f'"{want}"'.encode() in data[: data.rfind(b"\n") + 1]

    def wait(self, want: str, timeout: float, pidfd: int | None = None) -> float | None:
        """perf_counter() when `want` was seen; None if the child exited or time ran out first."""
        deadline = time.perf_counter() + timeout
        watched = [self.fd] + ([pidfd] if pidfd is not None else [])
        while True:
            if self._seen(want):
                return time.perf_counter()
            left = deadline - time.perf_counter()
            if left <= 0:
                return None
            ready, _, _ = select.select(watched, [], [], left)
            if self.fd in ready:
                os.read(self.fd, 65536)
            elif pidfd is not None and pidfd in ready:
                return time.perf_counter() if self._seen(want) else None

    def close(self) -> None:
        os.close(self.fd)


def write_inputs(path: Path, rows: list[dict[str, Any]], mode: str = "w") -> None:
    with open(path, mode) as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def cli(wd: Path, interval_ms: float) -> list[str]:
    return [
        sys.executable, "-m", "ratchet.cli", "run", AGENT, "--input", str(wd / "in.jsonl"),
        "--output", str(wd / "out.jsonl"), "--state", str(wd / "state"),
        "--checkpoint-interval", str(interval_ms),
    ]  # fmt: skip


def seed(base: Path, keys: int) -> Path:
    wd = base / "seed"
    wd.mkdir()
    write_inputs(wd / "in.jsonl", [{"key": f"k{i}", "id": f"i{i}", "v": i} for i in range(keys)])
    subprocess.run(cli(wd, 200), check=True, stdout=subprocess.DEVNULL)
    return wd


def prepare(src: Path | None, wd: Path, new_id: str) -> None:
    """A copy of the seeded job (or an empty one) with one new input appended."""
    if src is not None:
        shutil.copytree(src, wd)
    else:
        wd.mkdir()
    write_inputs(wd / "in.jsonl", [{"key": "k1", "id": new_id, "v": 1}], mode="a")


def time_cli(wd: Path, new_id: str, interval_ms: float) -> float:
    watch = OutputWatch(wd / "out.jsonl")
    t = time.perf_counter()
    proc = subprocess.Popen(cli(wd, interval_ms), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pidfd = os.pidfd_open(proc.pid)
    try:
        got = watch.wait(new_id, 120, pidfd)
        _, err = proc.communicate()
    finally:
        os.close(pidfd)
        watch.close()
    if got is None or proc.returncode != 0:
        raise RuntimeError(f"no output {new_id} (exit {proc.returncode}): {err.decode()[-2000:]}")
    return got - t


def time_in_process(wd: Path, new_id: str, interval_ms: float) -> tuple[float, float]:
    """(seconds to the first output, the engine's own restore_seconds)."""
    import ratchet_agents

    from ratchet import EngineConfig, run

    watch = OutputWatch(wd / "out.jsonl")
    seen: list[float | None] = []
    waiter = threading.Thread(target=lambda: seen.append(watch.wait(new_id, 120)))
    waiter.start()
    t = time.perf_counter()
    res = run(
        ratchet_agents.Keyed(), inputs=wd / "in.jsonl", output=wd / "out.jsonl",
        state_dir=wd / "state", config=EngineConfig(checkpoint_interval=interval_ms / 1000),
    )  # fmt: skip
    waiter.join()
    watch.close()
    if not seen or seen[0] is None:
        raise RuntimeError(f"no output {new_id} in process")
    return seen[0] - t, res.restore_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    c.compile_ratchet(sys.executable)  # children start as from a user's install
    import ratchet

    tmp = Path(tempfile.mkdtemp(prefix="ratchet-restart-"))
    print(f"ratchet from {Path(ratchet.__file__).parent}; {os.cpu_count()} cores; "
          f"load {os.getloadavg()[0]:.2f} at start")  # fmt: skip
    t = time.perf_counter()
    src = seed(tmp, a.keys)
    state = src / "state"
    size = sum(f.stat().st_size for f in state.iterdir() if f.is_file())
    print(f"seeded {a.keys} keys in {time.perf_counter() - t:.1f} s; state {size:,} bytes")
    figs: dict[str, list[float]] = {}
    n = 0
    for _ in range(a.repeat):
        for interval in (200.0, 0.0):
            for label, origin in (("10k", src), ("empty", None)):
                for how in ("cli", "inproc"):
                    n += 1
                    wd, new_id = tmp / f"r{n}", f"new{n}"
                    prepare(origin, wd, new_id)
                    if how == "cli":
                        took = time_cli(wd, new_id, interval)
                    else:
                        took, restore = time_in_process(wd, new_id, interval)
                        figs.setdefault(f"restore {label} {interval:g}", []).append(restore)
                    figs.setdefault(f"{how} {label} {interval:g}", []).append(took)
                    shutil.rmtree(wd)
    med = {k: statistics.median(v) for k, v in figs.items()}
    print(f"median of {a.repeat}; load {os.getloadavg()[0]:.2f} at end")
    print("| restart to first new output | interval | 10k keys s | empty state s | 10k / empty |")
    print("|---|---|---|---|---|")
    for how, name in (("cli", "`ratchet run` (spawn)"), ("inproc", "`ratchet.run` in process"),
                      ("restore", "... of which the engine's restore")):  # fmt: skip
        for interval in (200.0, 0.0):
            k, e = med[f"{how} 10k {interval:g}"], med[f"{how} empty {interval:g}"]
            print(f"| {name} | {interval:g} ms | {k:.3f} | {e:.3f} | {k / max(e, 1e-9):.2f}x |")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
