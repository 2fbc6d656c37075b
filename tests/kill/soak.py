"""Soak the crash-equivalence harness: many generated agents, hundreds of SIGKILLs.

    .venv/bin/python tests/kill/soak.py --cases 150
    .venv/bin/python tests/kill/soak.py --cases 40 --features none,+mutate_events --seed 7
    .venv/bin/python tests/kill/soak.py --cases 60 --stop-on-failure   # shrink the first failure
    .venv/bin/python tests/kill/soak.py --seed 123 --cases 10 --stop-on-failure  # replay a batch

By default every failing case is written to --keep (its report, agent, inputs and the two
runs' directories) and the soak goes on; the summary counts cases, kills and failures, grouped
by what differed. With --stop-on-failure hypothesis shrinks the first failure and prints the
minimal case and its agent source. Exit status: 0 if no case failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from crash_equiv import Case, Features, cases, run_case  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402


def signature(difference: str) -> str:
    """A difference with its ids and numbers taken out, to group failures of one kind."""
    first = re.sub(r"[{\[(].*", "", difference.splitlines()[0])
    first = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", first)
    first = re.sub(r"\b[\w.>:-]*\d[\w.>:-]*\b", "#", first)
    return first[:110]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", type=int, default=100)
    p.add_argument(
        "--features",
        default="all",
        help=f"'all', 'none', or changes like 'none,+mutate_events' / '-handler_raises'; "
        f"names: {', '.join(Features.names())}",
    )
    p.add_argument("--seed", type=int, default=None, help="first batch's seed (default: random)")
    p.add_argument(
        "--batch",
        type=int,
        default=10,
        help="cases per hypothesis run (seed, seed+1, ...): past ~10 examples hypothesis mostly "
        "mutates earlier cases, which costs a full run each for little news",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per ratchet process")
    p.add_argument("--max-inputs", type=int, default=10)
    p.add_argument("--max-kills", type=int, default=5)
    p.add_argument("--keep", type=Path, default=Path(tempfile.gettempdir()) / "crash-equiv-soak")
    p.add_argument("--stop-on-failure", action="store_true")
    args = p.parse_args(argv)

    feats = Features.parse(args.features)
    first_seed = args.seed if args.seed is not None else int(time.time() * 1000) % 2**32
    print(f"soak: {args.cases} cases, {feats!r}, seeds from {first_seed}", flush=True)
    args.keep.mkdir(parents=True, exist_ok=True)
    totals: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    failed: list[str] = []
    started = time.monotonic()
    strategy = cases(feats, max_inputs=args.max_inputs, max_kills=args.max_kills)
    phases = [Phase.generate] + ([Phase.shrink] if args.stop_on_failure else [])

    def one_case(case: Case, batch_seed: int) -> None:
        with tempfile.TemporaryDirectory(prefix="crash-equiv-") as tmp:
            result = run_case(case, Path(tmp), timeout=args.timeout)
            n = totals["cases"] = totals["cases"] + 1
            totals["kills"] += result.kills
            totals["starts"] += result.starts
            totals["unreadable"] += len(result.unreadable)
            status = "ok" if result.ok else f"FAIL ({len(result.differences)})"
            print(
                f"#{n:<4} seed {batch_seed} {status:<9} kills {result.kills} starts "
                f"{result.starts} outputs {result.ref_outputs:<3} {result.seconds:5.1f}s"
                + (f"  unreadable state after {result.unreadable}" if result.unreadable else ""),
                flush=True,
            )
            if result.ok:
                return
            report = result.report() + f"\nreplay: soak.py --seed {batch_seed} --cases {args.batch}"
            if args.stop_on_failure:
                raise AssertionError(report)
            dest = args.keep / f"case-{batch_seed}-{n}"
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(tmp, dest)
            (dest / "report.txt").write_text(report)
            failed.append(str(dest))
            kinds.update({signature(d) for d in result.differences})
            for d in result.differences[:3]:
                print(f"      {d.splitlines()[0][:200]}", flush=True)

    def batch(this_seed: int, todo: int) -> Any:
        @seed(this_seed)
        @settings(
            max_examples=todo,
            deadline=None,
            database=None,
            phases=phases,
            print_blob=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def run_batch(case: Case) -> None:
            one_case(case, this_seed)

        return run_batch

    last_seed = first_seed
    try:
        while totals["cases"] < args.cases:
            todo = min(args.batch, args.cases - totals["cases"])
            before = totals["cases"]
            batch(last_seed, todo)()
            if totals["cases"] == before or totals["cases"] >= args.cases:
                break  # done, or the strategy has nothing new to give
            last_seed += 1
    finally:
        minutes = (time.monotonic() - started) / 60
        print(
            f"\nsoak summary: {totals['cases']} cases, {totals['kills']} SIGKILLs, "
            f"{totals['starts']} process starts, {len(failed)} failing cases, "
            f"{totals['unreadable']} kills left no readable state, "
            f"{minutes:.1f} min, seeds {first_seed}..{last_seed}, {feats!r}"
        )
        for kind, n in kinds.most_common():
            print(f"  {n:4} x {kind}")
        for path in failed:
            print(f"  kept {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
