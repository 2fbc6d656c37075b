"""The key groups `runtime/_flink_keygroups.py` computes are the JVM's, for the `Row(key)` keys
PyFlink's `key_by` makes: the wake registry of a key must live in that key's own group."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="PyFlink is not installed (make test-flink uses .venv-flink)")

from ratchet.runtime._flink_keygroups import key_group, key_group_range  # noqa: E402

from .support import flink_env  # noqa: E402

pytestmark = [pytest.mark.flink]

# Run in a child process: PyFlink's gateway JVM outlives the test otherwise.
ASK_THE_JVM = """
import json, sys
from pyflink.java_gateway import get_gateway
gw = get_gateway(); jvm = gw.jvm
kga = jvm.org.apache.flink.runtime.state.KeyGroupRangeAssignment
ask = json.load(sys.stdin)
groups = []
for key in ask["keys"]:
    fields = gw.new_array(jvm.Object, 1); fields[0] = key
    row = jvm.org.apache.flink.types.Row.of(fields)
    groups.append([kga.assignToKeyGroup(row, m) for m in (128, 4096)])
ranges = []
for m, p in ask["ranges"]:
    r = [kga.computeKeyGroupRangeForOperatorIndex(m, p, i) for i in range(p)]
    ranges.append([[x.getStartKeyGroup(), x.getEndKeyGroup()] for x in r])
print(json.dumps({"groups": groups, "ranges": ranges}))
"""


def test_key_groups_and_subtask_ranges_match_flinks_own(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    alphabet = "ab09_:-\x00éß日本😀\U0001f680"
    keys = ["", "a", "\x00i:-7"] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 16))) for _ in range(300)
    ]
    ranges = [(128, 1), (128, 3), (128, 7), (4096, 5)]
    proc = subprocess.run(
        [sys.executable, "-c", ASK_THE_JVM],
        input=json.dumps({"keys": keys, "ranges": ranges}),
        capture_output=True,
        text=True,
        timeout=240,
        env=flink_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jvm = json.loads(proc.stdout.strip().splitlines()[-1])
    for key, (g128, g4096) in zip(keys, jvm["groups"], strict=True):
        assert (key_group(key, 128), key_group(key, 4096)) == (g128, g4096), (seed, key)
    for (max_par, par), theirs in zip(ranges, jvm["ranges"], strict=True):
        ours = [key_group_range(max_par, par, i) for i in range(par)]
        assert [[r.start, r.stop - 1] for r in ours] == theirs
