"""The receipt journal: one sealed record per change of state, folded over the start receipt.

A crash mid-append leaves a torn last record, which readers ignore (the stage it would have
finished counts as not done); any other damage makes the receipt untrusted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
from checks_helpers import Workspace, by_id, check, stage

from ratchet.checks import ReceiptError, Seams, runner
from ratchet.checks._receipts import JOURNAL_NAME, append_record
from ratchet.checks.checkpoints import Checkpoints
from ratchet.checks.common import atomic_json, read_json
from ratchet.store import seal

KEY = "0123456789abcdef0123456789abcdef"


def _chain(count: int) -> list[dict[str, Any]]:
    return [
        stage(f"s{i}", inputs={"repos": ["app"]}, deps=[f"s{i - 1}"] if i else [])
        for i in range(count)
    ]


class _Counting:
    """A whole-receipt writer that counts its writes; journal appends are counted apart."""

    def __init__(self, fail_final: bool = False) -> None:
        self.writes = 0
        self.appends: list[dict[str, Any]] = []
        self.fail_final = fail_final

    def write(self, path: Path, payload: dict[str, Any]) -> None:
        if self.fail_final and payload["phase"] == "done":
            raise OSError("disk gone")
        self.writes += 1
        atomic_json(path, payload)

    def append(self, path: Path, line: bytes) -> None:
        self.appends.append(json.loads(line))
        append_record(path, line)


def _crashed_run(ws: Workspace, stages: list[dict[str, Any]]) -> tuple[str, Path]:
    """A run whose final receipt write failed: receipt.json says running, and the journal
    holds everything that happened."""
    counting = _Counting(fail_final=True)
    seams = Seams(writer=counting.write, journal=counting.append)
    with pytest.raises(ReceiptError, match="recover it before resuming"):
        runner.run_checks(ws.args(), stages, seams=seams)
    (run_dir,) = (ws.state_dir / "runs").iterdir()
    return run_dir.name, run_dir / JOURNAL_NAME


def test_a_run_writes_the_whole_receipt_twice_and_one_record_per_change(
    two_repos: Workspace,
) -> None:
    ws = two_repos
    counting = _Counting()
    seams = Seams(writer=counting.write, journal=counting.append)
    first = runner.run_checks(ws.args(), _chain(30), seams=seams)
    assert first["status"] == "passed"
    assert counting.writes == 2  # the start and the end: never once per stage
    # Each record names only what changed (one stage), never the whole receipt.
    assert max(len(r["stages"]) for r in counting.appends) == 1
    assert [r["seq"] for r in counting.appends] == list(range(1, len(counting.appends) + 1))
    assert not (Path(first["receipt_path"]).parent / JOURNAL_NAME).exists()
    assert read_json(first["receipt_path"]) == first

    counting = _Counting()
    seams = Seams(writer=counting.write, journal=counting.append)
    again = runner.run_checks(ws.args(resume=first["run_id"]), _chain(30), seams=seams)
    assert {s["reused_from"] for s in again["stages"]} == {first["run_id"]}
    assert counting.writes == 2
    # A no-op resume: the 30 reused checkpoints in one record (one fsync), at the end of
    # the schedule, not one record per stage.
    assert [sorted(r["id"] for r in rec["stages"]) for rec in counting.appends] == [
        sorted(f"s{i}" for i in range(30))
    ]
    assert all(r["checkpoint_verified"] for r in counting.appends[0]["stages"])


def test_a_crashed_run_is_its_start_receipt_with_the_journal_folded(
    two_repos: Workspace,
) -> None:
    ws = two_repos
    run_id, journal = _crashed_run(ws, _chain(3))
    raw = read_json(journal.with_name("receipt.json"))
    assert raw["status"] == "running"
    assert {s["status"] for s in raw["stages"]} == {"pending"}
    folded = ws.receipt(run_id)
    assert folded["status"] == "running"
    assert {s["id"]: s["checkpoint_verified"] for s in folded["stages"]} == {
        "s0": True,
        "s1": True,
        "s2": True,
    }
    report = runner.recover(
        ws.root, ws.state_dir, run_id, apply=True, confirm_processes_stopped=True
    )
    assert report["action"] == "recovered"
    resumed = ws.run(_chain(3), resume=run_id)
    assert {s["reused_from"] for s in resumed["stages"]} == {run_id}


def test_a_torn_last_record_is_ignored_and_its_stage_is_not_done(two_repos: Workspace) -> None:
    ws = two_repos
    run_id, journal = _crashed_run(ws, _chain(2))
    lines = journal.read_bytes().splitlines(keepends=True)
    # Keep the records up to s1's checkpoint, and half of that one.
    done_s1 = next(
        i
        for i, line in enumerate(lines)
        if any(r["id"] == "s1" and r["checkpoint_verified"] for r in json.loads(line)["stages"])
    )
    journal.write_bytes(b"".join(lines[:done_s1]) + lines[done_s1][: len(lines[done_s1]) // 2])
    recs = by_id(ws.receipt(run_id))
    assert recs["s0"]["checkpoint_verified"] is True
    assert (recs["s1"]["status"], recs["s1"]["checkpoint_verified"]) == ("running", False)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("edit", "record 1 does not match its seal"),
        ("drop", "record 1 is out of sequence"),
        ("relink", "record 1 does not follow the record before it"),
    ],
)
def test_a_damaged_record_before_the_last_makes_the_receipt_untrusted(
    two_repos: Workspace, damage: str, message: str
) -> None:
    ws = two_repos
    run_id, journal = _crashed_run(ws, _chain(2))
    lines = journal.read_bytes().splitlines(keepends=True)
    if damage == "edit":
        lines[0] = lines[0].replace(b'"status":"running"', b'"status":"passed"', 1)
    elif damage == "drop":
        del lines[0]
    else:  # resealed (no key is configured) but pointing at another predecessor
        record = json.loads(lines[0])
        lines[0] = json.dumps(seal({**record, "prev": "sha256:" + "0" * 64})).encode() + b"\n"
    journal.write_bytes(b"".join(lines))
    with pytest.raises(ReceiptError, match=f"{message}; the journal was altered"):
        ws.receipt(run_id)


def test_with_a_key_an_unsigned_or_forged_record_is_refused(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    monkeypatch.setenv("RATCHET_CHECKS_SIGNING_KEY", KEY)
    run_id, journal = _crashed_run(ws, _chain(2))
    lines = journal.read_bytes().splitlines(keepends=True)
    assert all(json.loads(line)["seal"].startswith("hmac-") for line in lines)
    assert by_id(ws.receipt(run_id))["s1"]["checkpoint_verified"] is True
    # Whoever can write the state folder, but holds no key, cannot add a record that counts.
    forged = json.loads(lines[0])
    forged["stages"][0]["status"] = "passed"
    forged = seal(forged)  # sealed, but without the key
    journal.write_bytes(json.dumps(forged).encode() + b"\n" + b"".join(lines[1:]))
    with pytest.raises(ReceiptError, match="record 1 does not match its signature"):
        ws.receipt(run_id)


@pytest.mark.kill
def test_sigkill_mid_append_leaves_a_torn_record_that_counts_as_not_done(
    two_repos: Workspace,
) -> None:
    ws = two_repos
    ws.project(
        [
            check("a", "print('a')", repos=["app"]),
            check("b", "print('b')", repos=["lib"], deps=["a"]),
            check("c", "print('c')", repos=["lib"], deps=["b"]),
        ]
    )
    # The child writes half of b's checkpoint record for real, says so on stdout, and is
    # killed there: the bytes a crash mid-append leaves behind.
    child = (
        "import argparse, json, os, sys, time\n"
        "from ratchet.checks import Seams, _run\n"
        "from ratchet.checks._receipts import append_record\n"
        "cfg = json.loads(sys.argv[1])\n"
        "def append(path, line):\n"
        "    rec = json.loads(line)\n"
        "    if any(r['id'] == 'b' and r['checkpoint_verified'] for r in rec['stages']):\n"
        "        fd = os.open(path, os.O_WRONLY | os.O_APPEND)\n"
        "        os.write(fd, line[: len(line) // 2])\n"
        "        os.fsync(fd)\n"
        "        print('torn', flush=True)\n"
        "        while True:\n"
        "            time.sleep(1)\n"
        "    append_record(path, line)\n"
        "_run.run_checks(argparse.Namespace(**cfg['args']), cfg['stages'], "
        "Seams(journal=append))\n"
    )
    cfg = {"args": vars(ws.args()), "stages": ws.plan()}
    proc = subprocess.Popen(
        [sys.executable, "-c", child, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline()  # blocks until the torn write is on disk (or EOF)
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    assert said == b"torn\n", err.decode(errors="replace")
    assert proc.returncode == -signal.SIGKILL
    (run_dir,) = (ws.state_dir / "runs").iterdir()
    run_id = run_dir.name
    assert not (run_dir / JOURNAL_NAME).read_bytes().endswith(b"\n")  # torn

    crashed = by_id(ws.receipt(run_id))
    assert crashed["a"]["checkpoint_verified"] is True
    assert (crashed["b"]["status"], crashed["b"]["checkpoint_verified"]) == ("running", False)
    assert crashed["c"]["status"] == "pending"
    assert os.getpid() != read_json(run_dir / "receipt.json")["pid"]
    report = runner.recover(
        ws.root, ws.state_dir, run_id, apply=True, confirm_processes_stopped=True
    )
    assert report["action"] == "recovered"
    recovered = by_id(ws.receipt(run_id))
    assert (recovered["b"]["status"], recovered["c"]["status"]) == ("failed", "skipped")

    resumed = ws.run(resume=run_id)
    recs = by_id(resumed)
    assert resumed["status"] == "passed"
    assert recs["a"]["reused_from"] == run_id
    assert "reused_from" not in recs["b"]
    assert Path(recs["b"]["log_path"]).read_text() == "b\n"


def test_a_reused_checkpoint_is_on_disk_before_a_later_command_starts(
    two_repos: Workspace,
) -> None:
    """Reused checkpoints are appended lazily, but never after a stage command starts: the
    command of `b` (which runs, as `lib` changed) finds `a`'s reuse in the journal."""
    ws = two_repos
    seen = ws.control / "journal-seen-by-b"
    copy = (
        "import shutil, sys; from pathlib import Path\n"
        f"runs = Path({str(ws.state_dir / 'runs')!r})\n"
        "journals = [p / 'receipt.journal' for p in runs.iterdir()]\n"
        "live = [j for j in journals if j.exists()]\n"
        f"shutil.copy(live[0], {str(seen)!r}) if len(live) == 1 else sys.exit(3)\n"
    )
    plan = [
        stage("a", inputs={"repos": ["app"]}),
        stage("b", copy, inputs={"repos": ["lib"]}, deps=["a"]),
    ]
    first = ws.run(plan)
    assert first["status"] == "passed"
    seen.unlink()
    ws.write("lib/lib.py", "Y = 3\n")
    again = ws.run(plan, resume=first["run_id"])
    recs = by_id(again)
    assert recs["a"]["reused_from"] == first["run_id"]
    assert "reused_from" not in recs["b"] and recs["b"]["status"] == "passed"
    records = [json.loads(line) for line in seen.read_bytes().splitlines()]
    on_disk = [r for rec in records for r in rec["stages"] if r["id"] == "a"]
    assert on_disk and on_disk[-1]["checkpoint_verified"] is True
    assert on_disk[-1]["reused_from"] == first["run_id"]


def test_reused_checkpoints_lost_before_their_append_count_as_not_done(
    two_repos: Workspace,
) -> None:
    """A crash between a reuse and its (lazy) append loses the reuse: the stage counts as
    not done, and the next run verifies it again; nothing unverified is trusted."""
    ws = two_repos
    first = ws.run(_chain(3))

    def lost(path: Path, line: bytes) -> None:
        raise OSError("power cut")  # no append ever reaches the disk

    counting = _Counting(fail_final=True)
    seams = Seams(writer=counting.write, journal=lost)
    with pytest.raises(ReceiptError, match="recover it before resuming"):
        runner.run_checks(ws.args(resume=first["run_id"]), _chain(3), seams=seams)
    crashed = next(p.name for p in (ws.state_dir / "runs").iterdir() if p.name != first["run_id"])
    folded = by_id(ws.receipt(crashed))
    assert {sid: (r["status"], r["checkpoint_verified"]) for sid, r in folded.items()} == {
        f"s{i}": ("pending", False) for i in range(3)
    }
    report = runner.recover(
        ws.root, ws.state_dir, crashed, apply=True, confirm_processes_stopped=True
    )
    assert report["action"] == "recovered"
    # Nothing of the crashed run can be reused; resuming from it runs every stage again.
    again = ws.run(_chain(3), resume=crashed)
    assert again["status"] == "passed"
    assert not any(s.get("reused_from") for s in again["stages"])


class _CountingCheckpoints(Checkpoints):
    """The real prober, counting how often each repository's files are listed and hashed."""

    computed: ClassVar[list[str]] = []

    def _compute(self, name: str) -> tuple[str, dict[str, str]]:
        type(self).computed.append(name)
        return super()._compute(name)


def test_a_no_op_resume_takes_one_input_snapshot(two_repos: Workspace) -> None:
    ws = two_repos
    plan = _chain(4) + [stage("other", inputs={"repos": ["lib"]})]
    seams = Seams(prober=_CountingCheckpoints)
    _CountingCheckpoints.computed = []
    first = runner.run_checks(ws.args(), plan, seams=seams)
    # Commands ran: the end-of-run snapshot reads every input again.
    assert sorted(_CountingCheckpoints.computed).count("app") >= 2
    _CountingCheckpoints.computed = []
    again = runner.run_checks(ws.args(resume=first["run_id"]), plan, seams=seams)
    assert {s["reused_from"] for s in again["stages"]} == {first["run_id"]}
    assert again["snapshot_verified"] is True
    # Once each, at the start: both repositories and the workspace root's own files.
    assert sorted(_CountingCheckpoints.computed) == ["<workspace-root>", "app", "lib"]


@pytest.mark.parametrize(
    "payload",
    [
        {"run_id": "r", "stages": [{"id": "a", "n": 1}, {"id": "b", "é": [1, {"x": None}]}]},
        {"empty": [], "nested": {"k": [1, 2]}, "text": "naïve"},
        {},
        [1, 2],
    ],
)
def test_a_whole_receipt_is_written_one_stage_per_line_and_reads_back_the_same(
    tmp_path: Path, payload: Any
) -> None:
    # The C encoder writes it (`indent` would fall back to pure Python); still one line
    # per top-level key and per stage, for people and diffs.
    path = tmp_path / "receipt.json"
    atomic_json(path, payload)
    assert read_json(path) == payload
    if isinstance(payload, dict) and "stages" in payload:
        lines = path.read_text(encoding="utf-8").splitlines()
        assert len(lines) == 2 + len(payload) + 1 + len(payload["stages"])
        assert sum(line.startswith('    {"id": ') for line in lines) == len(payload["stages"])
