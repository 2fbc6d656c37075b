"""Upgrading an agent across SIGKILL, with real `ratchet` processes (docs/runtime.md,
"Upgrading an agent"):

- v1 is killed with runs in flight (two of them parked after their durable call returned);
  v2 (an action added before another, one removed, a body changed, a memory migration)
  continues on the same state: every input's output exactly once, the returned calls not
  made again, every key migrated exactly once (counted in a file outside the state), v2's
  new action only in runs that started under v2, the removed one in none;
- a change a recorded run cannot replay is refused with the documented error, and
  `ratchet runs restart` resolves it; the same change behind `ctx.patched` needs nothing;
- `ratchet migrate` killed at seeded moments migrates every key exactly once; a migration
  that raises stops with the key and version named and that key untouched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.kill

AGENTS = Path(__file__).with_name("upgrade_agents.py")
RATCHET = [sys.executable, "-m", "ratchet.cli"]


def agent(name: str) -> str:
    return f"{AGENTS}:{name}"


class World:
    """One test's files: the input, output, state, and the logs the agents write."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.input = tmp / "in.jsonl"
        self.output = tmp / "out.jsonl"
        self.state = tmp / "state"
        self.log = tmp / "log.jsonl"
        self.migrations = tmp / "migrations.jsonl"
        self.stuck = tmp / "stuck.txt"
        self.fail = tmp / "fail"

    def env(self, phase: str) -> dict[str, str]:
        return dict(
            os.environ,
            UPGRADE_LOG=str(self.log),
            UPGRADE_MIGRATIONS=str(self.migrations),
            UPGRADE_STUCK=str(self.stuck),
            UPGRADE_FAIL=str(self.fail),
            UPGRADE_PHASE=phase,
        )

    def start(self, name: str, phase: str, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                *RATCHET, "run", agent(name), "--input", str(self.input), "--output",
                str(self.output), "--state", str(self.state), "--checkpoint-interval", "20",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(phase),
        )  # fmt: skip

    def cli(self, *args: str, phase: str = "cli") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*RATCHET, *args], capture_output=True, text=True, env=self.env(phase), timeout=120
        )

    def lines(self, path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]

    def memory(self) -> dict[str, Any]:
        done = self.cli("inspect", "--state", str(self.state), "--json")
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    def status(self) -> dict[str, Any]:
        done = self.cli("status", "--state", str(self.state), "--json")
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    def in_flight(self) -> list[dict[str, Any]]:
        done = self.cli("runs", "list", "--state", str(self.state), "--json")
        assert done.returncode == 0, done.stderr
        return list(json.loads(done.stdout)["in_flight"])


def wait_for(proc: subprocess.Popen[str], until: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert proc.poll() is None, f"exited before {what}: {proc.communicate()[1]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)  # reaps it and closes its pipes


def test_v2_continues_v1s_killed_stream_exactly_once(tmp_path: Path) -> None:
    w = World(tmp_path)
    keys = [f"k{i}" for i in range(12)]
    rows = [{"key": keys[i % 12], "n": i} for i in range(96)]
    w.input.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w.stuck.write_text("k0 k1")
    v1 = w.start("V1", "v1")
    paid = lambda k: any(e["what"] == "pay" and e["key"] == k for e in w.lines(w.log))  # noqa: E731
    wait_for(v1, lambda: paid("k0") and paid("k1") and len(w.lines(w.output)) >= 40, "v1")
    time.sleep(0.2)  # a few checkpoints with the parked runs in flight
    kill(v1)
    w.stuck.unlink()
    # A savepoint of v1's state, to start v2 from in a new directory too (below).
    savepoint = tmp_path / "v1.savepoint"
    done = w.cli("savepoint", "--state", str(w.state), str(savepoint))
    assert done.returncode == 0, done.stderr
    shutil.copy(w.output, tmp_path / "out-at-kill.jsonl")

    flying = w.in_flight()
    flying_n = {r["seq"] for r in flying}  # seq == n: one input per line, in order
    assert {str(r["key"]) for r in flying} >= {"k0", "k1"}, flying
    parked = {r["seq"]: r for r in flying if str(r["key"]) in ("k0", "k1")}
    assert all(r["calls_returned"] >= 1 for r in parked.values()), parked

    v2 = w.start("V2", "v2")
    out, err = v2.communicate(timeout=120)
    assert v2.returncode == 0, err

    outputs = w.lines(w.output)
    assert Counter(o["output"]["n"] for o in outputs) == Counter(range(96)), "each output once"
    by = {o["output"]["n"]: o["output"]["by"] for o in outputs}
    log = w.lines(w.log)
    # The parked runs finished under v2's code, on v1's recorded payment: not paid again.
    for n in parked:
        assert by[n] == 2
        pays = [e for e in log if e["what"] == "pay" and e["n"] == n]
        assert [e["phase"] for e in pays] == ["v1"], pays
    # v2's new action ran in exactly the runs that started under v2; the removed one in none.
    tagged = [e["n"] for e in log if e["what"] == "tag"]
    assert len(tagged) == len(set(tagged)), "tag ran once per run"
    started_under_v2 = {n for n, v in by.items() if v == 2} - flying_n
    assert set(tagged) == started_under_v2 and started_under_v2, (tagged, flying_n)
    assert not [e for e in log if e["what"] == "audit" and e["phase"] == "v2"]
    # Keys v2 touched were migrated once each; `ratchet migrate` does the rest, once.
    touched = len(w.lines(w.migrations))
    done = w.cli("migrate", "--state", str(w.state), "--agent", agent("V2"), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["migrated"] == 12 - touched
    assert len(w.lines(w.migrations)) == 12
    memory = w.memory()
    assert memory == {k: {"stats": {"total": 8}} for k in keys}, memory

    # v2 started from the savepoint goes through the same adoption, pins and migrations.
    restored = World(tmp_path / "restored")
    restored.tmp.mkdir()
    restored.input = w.input
    shutil.copy(tmp_path / "out-at-kill.jsonl", restored.output)
    proc = restored.start("V2", "v2-restored", "--from-savepoint", str(savepoint))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    outputs = restored.lines(restored.output)
    assert Counter(o["output"]["n"] for o in outputs) == Counter(range(96))
    done = restored.cli("migrate", "--state", str(restored.state), "--agent", agent("V2"))
    assert done.returncode == 0, done.stderr
    assert restored.memory() == memory


def killed_v1_with_a_parked_call(w: World) -> int:
    """Run V1 until k0's run parks after its payment returned; kill it; the parked n."""
    rows = [{"key": f"k{i % 4}", "n": i} for i in range(12)]
    w.input.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w.stuck.write_text("k0")
    v1 = w.start("V1", "v1")
    wait_for(
        v1,
        lambda: (
            any(e["what"] == "pay" and e["key"] == "k0" for e in w.lines(w.log))
            and len(w.lines(w.output)) >= 9
        ),
        "v1",
    )
    time.sleep(0.2)
    kill(v1)
    w.stuck.unlink()
    (parked,) = [r for r in w.in_flight() if str(r["key"]) == "k0"]
    return int(parked["seq"])


def test_an_unreplayable_change_is_refused_and_runs_restart_resolves_it(tmp_path: Path) -> None:
    w = World(tmp_path)
    parked = killed_v1_with_a_parked_call(w)
    patched = World(tmp_path / "patched")
    patched.tmp.mkdir()
    for name in ("in.jsonl", "out.jsonl", "log.jsonl"):
        shutil.copy(tmp_path / name, patched.tmp / name)
    shutil.copytree(w.state, patched.state)  # the job is dead: its files are at rest

    # Removing an action whose task had made a call: refused before anything runs.
    before = w.in_flight()
    proc = w.start("V2NoSlow", "v2")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert "IncompatibleChange" not in err and "Traceback" not in err
    assert f"key 'k0', run of input {parked}" in err and "'slow' was removed" in err, err
    assert "ratchet runs restart" in err
    assert w.in_flight() == before

    # Paying in another currency: the recorded USD call is not made again; refused.
    proc = w.start("V2Euro", "v2")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert f"key 'k0' input {parked}, task r>ingest.0>slow" in err, err
    assert "pay (argument digest" in err and "ratchet runs restart" in err, err

    done = w.cli("runs", "restart", "--state", str(w.state), "--key", "k0")
    assert done.returncode == 0, done.stderr
    assert f"key k0 input {parked}" in done.stdout and "may be made again" in done.stdout
    proc = w.start("V2Euro", "v2-after-restart")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    outputs = w.lines(w.output)
    assert Counter(o["output"]["n"] for o in outputs) == Counter(range(12))
    (restarted,) = [o["output"] for o in outputs if o["output"]["n"] == parked]
    assert restarted["paid"]["currency"] == "EUR"

    # The same change behind ctx.patched: the recorded run keeps its USD payment, new runs
    # pay in EUR, nothing is paid twice, nothing needs an operator.
    proc = patched.start("V2EuroPatched", "v2-patched")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    outputs = patched.lines(patched.output)
    assert Counter(o["output"]["n"] for o in outputs) == Counter(range(12))
    currency = {o["output"]["n"]: o["output"]["paid"]["currency"] for o in outputs}
    assert currency[parked] == "USD"
    later = [
        o["output"]["n"] for o in outputs if o["output"]["by"] == 2 and o["output"]["n"] != parked
    ]
    assert later and all(currency[n] == "EUR" for n in later)
    pays = [e for e in patched.lines(patched.log) if e["what"] == "pay" and e["n"] == parked]
    assert [e["phase"] for e in pays] == ["v1"], pays


def call_rows(state: Path) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(state / "ratchet.db")
    try:
        return con.execute("SELECT * FROM calls ORDER BY seq, task_id, idx").fetchall()
    finally:
        con.close()


def is_pay(e: dict[str, Any], n: int, currency: str | None = None) -> bool:
    return e["what"] == "pay" and e["n"] == n and currency in (None, e["currency"])


def test_a_refused_replay_leaves_the_call_records_so_the_documented_fixes_still_work(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    parked = killed_v1_with_a_parked_call(w)
    killed = World(tmp_path / "killed")
    killed.tmp.mkdir()
    for name in ("in.jsonl", "out.jsonl", "log.jsonl"):
        shutil.copy(tmp_path / name, killed.tmp / name)
    shutil.copytree(w.state, killed.state)
    before = call_rows(w.state)

    # Refused at the task's end: its new (EUR) call was made, but its record went again.
    proc = w.start("V2Euro", "v2")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert f"key 'k0' input {parked}" in err, err
    assert call_rows(w.state) == before
    # So the previous version (a fix the message offers) finishes the run on its records.
    proc = w.start("V1", "v1-again")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    outputs = w.lines(w.output)
    assert Counter(o["output"]["n"] for o in outputs) == Counter(range(12))
    (done,) = [o["output"] for o in outputs if o["output"]["n"] == parked]
    assert done["paid"]["currency"] == "USD"
    pays = [(e["phase"], e["currency"]) for e in w.lines(w.log) if is_pay(e, parked)]
    assert [p for p in pays if p[0] != "v1-again"] == [("v1", "USD"), ("v2", "EUR")], pays
    assert ("v1-again", "USD") not in pays  # answered from its record

    # Killed in the middle of an attempt that would be refused (after its new call): the
    # records it left are not required by the next replay, so ctx.patched finishes the run.
    killed.stuck.write_text("k0")
    proc = killed.start("V2EuroParks", "v2-killed")
    wait_for(
        proc,
        lambda: any(is_pay(e, parked, "EUR") for e in killed.lines(killed.log)),
        "the EUR call",
    )
    time.sleep(0.2)
    kill(proc)
    killed.stuck.unlink()
    assert len(call_rows(killed.state)) > len(before)
    # The attempt's replay marker (fn ratchet.replay, a negative index) is not a call: `runs
    # list` counts the calls only.
    rows = [r for r in call_rows(killed.state) if r[0] == parked]
    assert any(r[3] == "ratchet.replay" and r[2] < 0 for r in rows), rows
    (listed,) = [r for r in killed.in_flight() if r["seq"] == parked]
    assert listed["call_records"] == sum(1 for r in rows if r[2] >= 0), (listed, rows)
    proc = killed.start("V2EuroPatched", "v2-patched")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    outputs = killed.lines(killed.output)
    assert Counter(o["output"]["n"] for o in outputs) == Counter(range(12))
    (done,) = [o["output"] for o in outputs if o["output"]["n"] == parked]
    assert done["paid"]["currency"] == "USD"
    usd = [e for e in killed.lines(killed.log) if is_pay(e, parked, "USD")]
    assert [e["phase"] for e in usd] == ["v1"], usd


def gate_parked(w: World) -> None:
    """Gate parks the run of input 0 (key k0) on "go" after paying; then an approval is sent,
    for the version that waits for one."""
    w.input.write_text(json.dumps({"key": "k0", "n": 0}) + "\n")
    proc = w.start("Gate", "v1")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "1 run(s) waiting for signals" in err, err
    send(w, "approve", '{"by": "alice"}')


def send(w: World, name: str, value: str) -> None:
    done = w.cli("signal", "--state", str(w.state), "--key", "k0", name, "--value", value)
    assert done.returncode == 0, done.stderr


def pending(w: World) -> list[str]:
    return [p["name"] for p in w.status()["pending_signals"]]


def approvals_held(w: World) -> int:
    """The approval, where it is at rest: pending, or taken by a call record."""
    taken = [r for r in call_rows(w.state) if r[3:6] == ("ratchet.signal", "approve", "ok")]
    return len(taken) + pending(w).count("approve")


def finish_with_the_patched_version(w: World, why: str) -> None:
    """Run 0 finishes on Gate's path; input 1 (the patched path) gets the approval, exactly
    once: input 2, which waits for one too, is left waiting."""
    send(w, "go", "1")
    with w.input.open("a") as fh:
        fh.write("".join(json.dumps({"key": "k0", "n": n}) + "\n" for n in (1, 2)))
    proc = w.start("GatePatched", "v2-patched")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"{why}: {err}"
    assert "1 run(s) waiting for signals" in err, f"{why}: {err}"
    outs = {o["output"]["n"]: o["output"] for o in w.lines(w.output)}
    assert sorted(outs) == [0, 1], f"{why}: {outs}"
    assert outs[0]["by"] == 1 and outs[0]["go"] == 1, why
    assert outs[0]["paid"]["currency"] == "USD", why
    assert outs[1]["approval"] == {"by": "alice"}, f"{why}: {outs}"
    assert pending(w) == [], why
    usd = [e["phase"] for e in w.lines(w.log) if is_pay(e, 0, "USD")]
    assert usd == ["v1"], f"{why}: {usd}"


def test_a_refused_replay_puts_back_the_signal_its_new_wait_took(tmp_path: Path) -> None:
    w = World(tmp_path)
    gate_parked(w)
    before = call_rows(w.state)
    # The new version waits for "approve" first: it takes the signal, then is refused (its
    # records cannot replay the USD payment).
    proc = w.start("GateApproveFirst", "v2")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert "key 'k0' input 0" in err, err
    took = [e["approval"] for e in w.lines(w.log) if e["what"] == "approved"]
    assert took == [{"by": "alice"}], took
    # Its records are gone, and the approval it took is back, for whoever waits for it next.
    assert call_rows(w.state) == before
    assert pending(w) == ["approve"]
    finish_with_the_patched_version(w, "after a refusal")


@pytest.mark.slow
def test_a_refused_replay_killed_at_seeded_moments_delivers_the_signal_once(
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("RATCHET_TEST_SEED") or 5407)
    rng = random.Random(seed)
    w = World(tmp_path)
    gate_parked(w)
    moments: list[str] = []
    for attempt in range(5):
        # Killed parked right after the signal arrived; or soon after it arrived (paying, at
        # the refusal, while its records are dropped, or too late: refused); or at a moment
        # from the start (often before the wait).
        how = rng.choice(["parked", "after the signal", "from the start"])
        if how == "parked":
            w.stuck.write_text("k0")
        phase = f"v2-{attempt}"
        proc = w.start("GateApproveFirst", phase)
        took = lambda phase=phase: any(  # noqa: E731
            e["phase"] == phase for e in w.lines(w.log) if e["what"] == "approved"
        )
        if how == "from the start":
            moment = rng.uniform(0.1, 0.7)
        else:
            while not took() and proc.poll() is None:
                time.sleep(0.002)
            moment = rng.uniform(0, 0.3 if how == "parked" else 0.08)
        time.sleep(moment)
        if proc.poll() is None:
            kill(proc)
            moments.append(f"killed {moment:.3f}s {how}")
        else:
            _, err = proc.communicate()
            assert proc.returncode == 2, f"seed {seed}: {err}"
            moments.append(f"refused ({how})")
        w.stuck.unlink(missing_ok=True)
        held = approvals_held(w)
        assert held == 1, f"seed {seed}, {moments}: the approval is held {held} times"
    print(f"seed {seed} (RATCHET_TEST_SEED): {moments}")
    finish_with_the_patched_version(w, f"seed {seed}, {moments}")


def test_a_changed_event_a_run_in_flight_holds_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = World(tmp_path)
    w.input.write_text(json.dumps({"key": "k0", "n": 7, "delay": 4}) + "\n")
    v1 = w.start("Delays", "v1")
    wait_for(v1, lambda: any(e["what"] == "pay" for e in w.lines(w.log)), "the payment")
    time.sleep(0.5)  # checkpoints with the run waiting for its delayed Later
    kill(v1)
    before, flying = call_rows(w.state), w.in_flight()
    assert [r["seq"] for r in flying] == [0]

    # A new required field: the stored Later would fail its listener after the upgrade.
    monkeypatch.setenv("UPGRADE_LATER", "m")
    proc = w.start("Delays", "v2")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert "key 'k0', run of input 0: the delayed event Later" in line, line
    assert "m: Field required" in line and "ratchet runs restart" in line, line
    assert call_rows(w.state) == before and w.in_flight() == flying
    assert not w.lines(w.output)

    # A validator that raises TypeError (pydantic passes it on): refused the same way, one
    # line (it was a traceback at start).
    monkeypatch.setenv("UPGRADE_LATER", "typeerror")
    proc = w.start("Delays", "v2-validator")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert "key 'k0', run of input 0" in line and "n may not be 7 any more" in line, line
    assert call_rows(w.state) == before and w.in_flight() == flying

    # The field with a default: the run continues, its payment not made again.
    monkeypatch.setenv("UPGRADE_LATER", "m=0")
    proc = w.start("Delays", "v2-default")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert [o["output"] for o in w.lines(w.output)] == [{"n": 7, "m": 0}]
    assert [e["phase"] for e in w.lines(w.log) if e["what"] == "pay"] == ["v1"]


@pytest.mark.slow
def test_ratchet_migrate_killed_at_seeded_moments_migrates_each_key_once(tmp_path: Path) -> None:
    seed = 1201
    rng = random.Random(seed)
    w = World(tmp_path)
    n_keys = 700
    w.input.write_text("".join(json.dumps({"key": f"k{i}"}) + "\n" for i in range(n_keys)))
    proc = w.start("Counter", "v1")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    kills = 0
    for _ in range(3):
        mig = subprocess.Popen(
            [*RATCHET, "migrate", "--state", str(w.state), "--agent", agent("CounterV2")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=w.env("migrate"),
        )
        time.sleep(rng.uniform(0.3, 1.2))
        if mig.poll() is None:
            kill(mig)
            kills += 1
        else:
            _, err = mig.communicate()
            assert mig.returncode == 0, err
    done = w.cli("migrate", "--state", str(w.state), "--agent", agent("CounterV2"), "--json")
    assert done.returncode == 0, done.stderr
    memory = w.memory()
    assert len(memory) == n_keys
    wrong = {k: v for k, v in memory.items() if v != {"total": 1, "migrations": 1}}
    assert not wrong, f"seed {seed}: {list(wrong.items())[:5]}"
    ran = len(w.lines(w.migrations))
    # A killed batch runs again from the old memory: the function may repeat, its effect not.
    assert n_keys <= ran <= n_keys + kills * 256, f"seed {seed}: {ran} runs, {kills} kills"
    again = w.cli("migrate", "--state", str(w.state), "--agent", agent("CounterV2"), "--json")
    assert json.loads(again.stdout)["migrated"] == 0


def test_a_migration_that_raises_names_the_key_and_leaves_it_untouched(tmp_path: Path) -> None:
    w = World(tmp_path)
    rows = [{"key": "a"}, {"key": "b"}, {"key": "b"}, {"key": "b"}, {"key": "c"}]
    w.input.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = w.start("Counter", "v1")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    done = w.cli("migrate", "--state", str(w.state), "--agent", agent("CounterV2Broken"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "key 'b' from memory version 1" in done.stderr, done.stderr
    assert "cannot migrate a count of 3" in done.stderr
    assert w.memory()["b"] == {"count": 3}  # its batch was not written
    # Lazily, in `ratchet run`, the same: the job stops naming the key, nothing of it written.
    with w.input.open("a") as fh:
        fh.write(json.dumps({"key": "b"}) + "\n")
    proc = w.start("CounterV2Broken", "v2", "--json")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err
    assert "key 'b' from memory version 1" in err, err
    assert "key 'b'" in json.loads(out)["error"]  # --json: a summary on stdout also on failure
    assert w.memory()["b"] == {"count": 3}


def test_a_migrate_that_cannot_proceed_does_not_adopt_the_new_agent(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.input.write_text("".join(json.dumps({"key": k}) + "\n" for k in "ab"))
    proc = w.start("Counter", "v1")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err

    before = w.status()
    done = w.cli("migrate", "--state", str(w.state), "--agent", agent("CounterV3Gap"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "no @ratchet.migration(2)" in done.stderr, done.stderr
    after = w.status()
    for field in ("agent", "actions", "memory_version", "upgrades"):
        assert after.get(field) == before.get(field), field
    assert w.memory() == {"a": {"count": 1}, "b": {"count": 1}}
    # The previous agent still runs on it (a new input of key a counts on).
    with w.input.open("a") as fh:
        fh.write(json.dumps({"key": "a"}) + "\n")
    proc = w.start("Counter", "v1-again")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert w.memory()["a"] == {"count": 2}


def test_a_pinned_run_whose_events_lose_every_listener_is_named_at_start(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.input.write_text(json.dumps({"key": "k0"}) + "\n")
    proc = w.start("Approves", "v1")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "waiting for signals" in err, err
    done = w.cli("signal", "--state", str(w.state), "--key", "k0", "go", "--value", "1")
    assert done.returncode == 0, done.stderr
    proc = w.start("ApprovesRenamed", "v2")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (
        err
    )  # compatible, as documented: the removed action's task is left out
    (line,) = [x for x in err.splitlines() if "reach no action" in x]
    assert "key 'k0' input 0" in line and "Approved (heard only by after;" in line, line
    assert "after_renamed hears it" in line, line
    assert not w.lines(w.output)


def test_status_counts_only_pinned_runs_still_in_flight(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.input.write_text(json.dumps({"key": "k0"}) + "\n")
    proc = w.start("Approves", "v1")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err

    w.cli("signal", "--state", str(w.state), "--key", "k0", "go", "--value", "1")
    proc = w.start("ApprovesRenamed", "v2")  # pins the run, which then completes
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    now = w.status()
    assert now["in_flight_runs"] == 0 and now["runs_on_earlier_versions"] == 0, now


def killed_in_the_second_retry_backoff(w: World) -> None:
    """Run Asks on one input until `ask`'s second attempt failed (the model answers 503),
    SIGKILL it in the backoff before the third, and make the model answer again."""
    w.input.write_text(json.dumps({"key": "a", "n": 0}) + "\n")
    w.fail.touch()
    v1 = w.start("Asks", "v1")
    asks = lambda: [e["phase"] for e in w.lines(w.log) if e["what"] == "ask"]  # noqa: E731
    wait_for(v1, lambda: len(asks()) == 2, "the 2nd attempt's call")  # the state exists by then
    retries = lambda: [r for r in call_rows(w.state) if r[3] == "ratchet.retry"]  # noqa: E731
    wait_for(v1, lambda: len(retries()) == 2, "the 2nd failure recorded")
    kill(v1)  # in the 1 s backoff before the third attempt
    assert asks() == ["v1", "v1"]
    assert any(str(r[1]).endswith(">ask#2") for r in call_rows(w.state)), call_rows(w.state)
    w.fail.unlink()


@pytest.mark.parametrize("version", ["AsksAudited", "AsksMid"])
def test_a_compatible_change_continues_a_run_killed_in_its_second_retry_backoff(
    tmp_path: Path, version: str
) -> None:
    """The run's second attempt recorded its call under the task id `r>ask#2`. A version
    that adds an action, or changes only ask's listener, continues the run: one output, and
    no failed call made again. Before the fix the start refused it: "its action 'ask#2' was
    removed" (the attempt suffix was read as part of the action's name)."""
    w = World(tmp_path)
    killed_in_the_second_retry_backoff(w)
    v2 = w.start(version, "v2")
    _, err = v2.communicate(timeout=120)
    assert v2.returncode == 0 and "was removed" not in err, err
    assert [o["output"] for o in w.lines(w.output)] == [{"n": 0, "answer": "answer 0"}]
    asks = [e["phase"] for e in w.lines(w.log) if e["what"] == "ask"]
    assert asks == ["v1", "v1", "v2"], asks  # the third attempt only
    assert not [e for e in w.lines(w.log) if e["what"] == "audit"]  # not in the pinned run


def test_removing_an_action_in_its_second_retry_backoff_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    """The other side of the fix: a removed action is still refused, named as it is."""
    w = World(tmp_path)
    killed_in_the_second_retry_backoff(w)
    v2 = w.start("AsksGone", "v2")
    _, err = v2.communicate(timeout=120)
    assert v2.returncode == 2 and "Traceback" not in err, err
    assert "key 'a', run of input 0: task r>ask" in err and "action 'ask' was removed" in err
