"""`make bench`: every benchmark in this folder, one after the other, each printing its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
SCRIPTS = ["runtime_bench.py", "checks_noop_resume.py", "workers_bench.py"]


def main() -> int:
    failed = []
    for name in SCRIPTS:
        print(f"\n=== {name} ===", flush=True)
        if subprocess.run([sys.executable, str(HERE / name), *sys.argv[1:]]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
