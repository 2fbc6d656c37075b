"""`--workers auto`: how many worker processes a job gets when its user lets ratchet choose.

The rules, from the measurements in docs/benchmarks.md ("How many workers `auto` picks"):

- a state that exists keeps the number it was written with (auto never moves keys on its
  own: a re-sharding is the user's call, and a sharded state refuses `savepoint`, `fork` and
  `checkpoints`);
- a new job whose input is a bounded file set smaller than `SMALL_INPUT_BYTES` gets one
  process: below it, a second worker's start costs more than it saves;
- otherwise one worker per usable core (the process's CPU affinity, and a cgroup's CPU quota
  where one is set, cgroup v2 or v1), at most `MAX_AUTO_WORKERS`: the one coordinator reads,
  parses and routes every input, which bounds what more workers can add.
"""

from __future__ import annotations

import glob
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path

# A bounded input smaller than this runs in one process: workload 1's break-even between one
# process and two workers was between 1,000 and 3,000 inputs (45-135 KB) here
# (docs/benchmarks.md).
SMALL_INPUT_BYTES = 64 << 10
SMALL_INPUT_COUNT = 1_000  # its low end in inputs, for an in-memory list of them
# The coordinator costs about 13 us of CPU per input and a worker running workload 1 about
# 68: past about five workers the coordinator is the bound; 4 leaves it room for the outputs.
MAX_AUTO_WORKERS = 4
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_SELF_CGROUP = Path("/proc/self/cgroup")
_MOUNTINFO = Path("/proc/self/mountinfo")


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, lowered by a CPU quota on its own
    cgroup or any above it (cgroup v2's `cpu.max`, or v1's `cpu.cfs_quota_us`: a host or a
    container runtime on cgroup v1 sets the quota there)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        lines = _SELF_CGROUP.read_text().splitlines()
    except OSError:
        lines = []
    for quota in (_cgroup_cores(lines), _cgroup_v1_cores(lines)):
        if quota is not None:
            cores = min(cores, quota)
    return max(1, cores)


def _cgroup_cores(lines: list[str]) -> int | None:
    """The tightest CPU quota (`cpu.max`) from this process's cgroup up to the root, in whole
    cores rounded up; None without one (or without cgroup v2). `lines`: /proc/self/cgroup."""
    own = next((line[3:] for line in lines if line.startswith("0::")), "/")
    return _tightest(_CGROUP_ROOT / own.strip("/"), _CGROUP_ROOT, _v2_quota)


def _v2_quota(group: Path) -> tuple[int, int] | None:
    quota, period = (group / "cpu.max").read_text().split()[:2]
    return None if quota == "max" else (int(quota), int(period))


def _v1_quota(group: Path) -> tuple[int, int] | None:
    quota = int((group / "cpu.cfs_quota_us").read_text())
    return None if quota < 0 else (quota, int((group / "cpu.cfs_period_us").read_text()))


def _tightest(
    here: Path, top: Path, quota_of: Callable[[Path], tuple[int, int] | None]
) -> int | None:
    """The tightest CPU quota of the cgroup `here` and those above it up to `top`, in whole
    cores rounded up; None without one. `quota_of`: a cgroup's (quota, period), None for no
    quota; an unreadable or malformed one counts as none."""
    best: int | None = None
    while True:
        try:
            found = quota_of(here)
            if found is not None and found[0] > 0 and found[1] > 0:
                cores = max(1, math.ceil(found[0] / found[1]))
                best = cores if best is None else min(best, cores)
        except (OSError, ValueError):
            pass
        if here == top or top not in here.parents:
            return best
        here = here.parent


def _cgroup_v1_cores(lines: list[str]) -> int | None:
    """The tightest cgroup v1 CPU quota (`cpu.cfs_quota_us` over `cpu.cfs_period_us`, -1 for
    none) from this process's cgroup of the `cpu` controller up to its mount, in whole cores
    rounded up; None without one. `lines`: /proc/self/cgroup, whose `N:cpu,cpuacct:/path`
    names the cgroup; /proc/self/mountinfo says where that hierarchy is mounted and which of
    its cgroups the mount shows as its root (a container sees its own cgroup there)."""
    own = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and "cpu" in parts[1].split(","):
            own = parts[2]
            break
    if own is None:
        return None
    try:
        mounts = _MOUNTINFO.read_text().splitlines()
    except OSError:
        return None
    for mount in mounts:
        fields, sep, rest = mount.partition(" - ")
        head, tail = fields.split(), rest.split()
        if not sep or len(head) < 5 or len(tail) < 3 or tail[0] != "cgroup":
            continue
        if "cpu" not in tail[2].split(","):
            continue
        root, point = _unescape(head[3]), Path(_unescape(head[4]))
        if own != root and not own.startswith(root.rstrip("/") + "/"):
            continue  # the mount shows another part of the hierarchy
        return _tightest(point / own[len(root) :].strip("/"), point, _v1_quota)
    return None


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def input_bytes(spec: str) -> int | None:
    """The size of the files an `--input` names (a file, a directory, a glob pattern); None
    when it is not files (a connector's URI) or names none."""
    from ratchet.connectors import is_uri
    from ratchet.runtime._io import files_pattern

    if is_uri(spec):
        return None
    names = [spec] if Path(spec).is_file() else glob.glob(files_pattern(spec))
    total, found = 0, False
    for name in names:
        try:
            st = os.stat(name)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
            found = True
    return total if found else None


def existing_workers(state_dir: str | os.PathLike[str]) -> tuple[int, str] | None:
    """(workers, why) of a state that exists: the number it was written with; None if new."""
    from ratchet.runtime._shards import is_sharded, read_layout
    from ratchet.store._sqlite import DB_NAME

    state = Path(state_dir)
    if is_sharded(state):
        n = read_layout(state).workers
        return n, f"the state was written with {n} workers"
    if (state / DB_NAME).exists():
        return 1, "the state was written by one process"
    return None


def auto_workers(
    state_dir: str | os.PathLike[str], inputs: str | None, follow: bool
) -> tuple[int, str]:
    """(workers, why) for `--workers auto`."""
    from ratchet.connectors import replays_in_order

    if inputs is not None and not replays_in_order(inputs):  # also for a sharded state
        return 1, "a source that gives unacknowledged inputs back in another order (NATS)"
    kept = existing_workers(state_dir)
    return kept if kept is not None else new_job_workers(inputs, follow)


def new_job_workers(inputs: str | None, follow: bool) -> tuple[int, str]:
    """(workers, why) for a job without state yet, from the cores and the input's size."""
    cores = usable_cores()
    if cores == 1:
        return 1, "one usable core"
    size = input_bytes(inputs) if inputs is not None and not follow else None
    if size is not None and size < SMALL_INPUT_BYTES:
        return 1, f"a small bounded input ({size:,} bytes < {SMALL_INPUT_BYTES:,})"
    n = min(cores, MAX_AUTO_WORKERS)
    capped = f", at most {MAX_AUTO_WORKERS}" if cores > MAX_AUTO_WORKERS else ""
    return n, f"{cores} usable cores{capped}"
