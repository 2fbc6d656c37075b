"""The runner through its seams, with no monkeypatching: the pure reuse decision table-tested,
a fake executor and a FakeClock giving exact receipts, and seeded faulty receipt writes."""

from __future__ import annotations

import ast
import hashlib
import json
import random
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from checks_helpers import Workspace, by_id, stage

import ratchet.checks
from ratchet._errors import ConfigError, StageTimeoutError
from ratchet.checks import ReceiptError, Seams, _explain, _recover, runner
from ratchet.checks._decide import (
    CHECKPOINT_VERSION,
    Facts,
    LogEvidence,
    cache_components,
    decide,
    digest,
    outcome,
    run_status,
)
from ratchet.checks._receipts import append_record
from ratchet.checks.common import atomic_json
from ratchet.store import seal
from ratchet.testing import FakeClock

T0 = "2027-01-15T08:00:00.000Z"  # FakeClock's default start


# --- fakes --------------------------------------------------------------------------------


class FakeProber:
    """Input digests are whatever the test sets; logs are hashed for real (they are files)."""

    def __init__(self, inputs: Mapping[str, str] | None = None) -> None:
        self.inputs = dict(inputs or {})

    def __call__(self, *args: Any, **kwargs: Any) -> FakeProber:  # the ProberFactory
        return self

    def scope(self, st: Mapping[str, Any]) -> list[str]:
        return sorted((st.get("inputs") or {}).get("repos") or self.inputs)

    def identity(self, st: Mapping[str, Any]) -> dict[str, str]:
        return {r: self.inputs.get(r) or digest(r) for r in self.scope(st)}

    def snapshot_identity(self, st: Mapping[str, Any]) -> dict[str, str]:
        return self.identity(st)

    def source_identity(self) -> dict[str, str]:
        return dict(self.inputs)

    def log_digest(self, path: Any) -> str:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()

    def stored_manifest(self, digest: str) -> dict[str, str] | None:
        return None

    def command_started(self) -> None:
        pass

    def command_finished(self) -> None:
        pass

    def forget(self) -> None:
        pass


class FakeExecutor:
    """Writes a one-line log, moves the clock by the stage's duration, returns its exit code."""

    def __init__(
        self,
        clock: FakeClock | None = None,
        *,
        durations: Mapping[str, float] | None = None,
        exit_codes: Mapping[str, int] | None = None,
        timeouts: frozenset[str] = frozenset(),
        on_run: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> None:
        self.clock = clock
        self.durations = dict(durations or {})
        self.exit_codes = dict(exit_codes or {})
        self.timeouts = timeouts
        self.on_run = on_run
        self.ran: list[str] = []
        self.envs: list[Mapping[str, str] | None] = []

    def run(
        self,
        st: Mapping[str, Any],
        *,
        cwd: Path,
        log_path: Path,
        timeout: float | None,
        env: Mapping[str, str] | None,
    ) -> int:
        sid = st["id"]
        self.ran.append(sid)
        self.envs.append(env)
        if self.on_run is not None:
            self.on_run(st)
        log_path.write_bytes(f"{sid} ran\n".encode())
        if self.clock is not None:
            self.clock.advance(self.durations.get(sid, 0.0))
        if sid in self.timeouts:
            raise StageTimeoutError(f"stage {sid!r} timed out after {timeout:g} s")
        return self.exit_codes.get(sid, 0)

    def kill_all(self) -> None:
        pass


class FaultyWriter:
    """Writes receipts (`__call__`) and appends journal records (`append`) for real, except
    the writes `fail(index, payload)` chooses, which raise before touching the disk;
    `payload` is the receipt as a reader would see it after the write (for an append, the
    journal folded). Remembers every outcome, and every receipt that reached the disk."""

    def __init__(self, fail: Callable[[int, dict[str, Any]], bool]) -> None:
        self.fail = fail
        self.outcomes: list[bool] = []
        self.written: list[dict[str, Any]] = []  # the payloads that reached the disk
        self._lock = threading.Lock()

    def __call__(self, path: Path, payload: dict[str, Any]) -> None:
        with self._lock:
            index = len(self.outcomes)
            if self.fail(index, payload):
                self.outcomes.append(False)
                raise OSError(f"injected fault at write {index}")
            atomic_json(path, payload)
            self.outcomes.append(True)
            self.written.append(payload)

    def append(self, path: Path, line: bytes) -> None:
        with self._lock:
            index = len(self.outcomes)
            record = json.loads(line)
            last = self.written[-1]  # the whole receipt written when the run started
            header = {k: v for k, v in last.items() if k not in ("stages", "seal")}
            header.update(record.get("header") or {})
            new = {r["id"]: r for r in record["stages"]}
            stages = [new.get(r["id"], r) for r in last["stages"]]
            folded = seal({**header, "stages": stages})
            if self.fail(index, folded):
                self.outcomes.append(False)
                raise OSError(f"injected fault at write {index}")
            append_record(path, line)
            self.outcomes.append(True)
            self.written.append(folded)

    def seams(self, mode: str, **fields: Any) -> Seams:
        """Seams writing through this writer: whole receipts only, or with the journal."""
        journal = self.append if mode == "journal" else None
        return Seams(writer=self, journal=journal, **fields)

    def durable(self) -> dict[str, str]:
        """Stage id -> checkpoint id of every verified checkpoint a write put on disk."""
        with self._lock:
            return {sid: ck for payload in self.written for sid, ck in _verified(payload).items()}


def _verified(receipt: Mapping[str, Any]) -> dict[str, str]:
    return {r["id"]: r["checkpoint_id"] for r in receipt["stages"] if r["checkpoint_verified"]}


# --- the pure decision --------------------------------------------------------------------

KEY = digest({"stage": "s", "v": 1})
LOG = "/state/runs/R1/logs/s.log"
LOG_SHA = "a" * 64
OLD: dict[str, Any] = {
    "id": "s",
    "status": "passed",
    "checkpoint_verified": True,
    "checkpoint_version": CHECKPOINT_VERSION,
    "checkpoint_id": "ck-s",
    "cache_key": KEY,
    "log_path": LOG,
    "log_sha256": LOG_SHA,
    "error": None,
}


def _facts(previous: Mapping[str, Any] | None = OLD, **fields: Any) -> Facts:
    values: dict[str, Any] = {
        "stage_id": "s",
        "reuse": "auto",
        "cache_key": KEY,
        "resumed_from": "R1",
        "previous": previous,
        "log": LogEvidence(sha256=LOG_SHA),
    }
    values.update(fields)
    return Facts(**values)


def _legacy() -> dict[str, Any]:
    legacy = dict(OLD)
    legacy.pop("cache_key")
    return legacy


DECISIONS: dict[str, tuple[Facts, str, str]] = {
    "fresh run": (_facts(resumed_from=None), "run", "fresh run (no --resume)"),
    "new stage": (_facts(previous=None), "run", "new stage: not in run R1"),
    "reuse never": (_facts(reuse="never"), "run", "reuse is 'never'"),
    "legacy record (no cache key)": (_facts(_legacy()), "run", "(legacy record)"),
    "legacy record (old version)": (
        _facts({**OLD, "checkpoint_version": 0}),
        "run",
        "(legacy record)",
    ),
    "previous run failed": (
        _facts({**OLD, "status": "failed", "error": "boom"}),
        "run",
        "left no verified checkpoint for it (status 'failed': boom)",
    ),
    "previous checkpoint not verified": (
        _facts({**OLD, "checkpoint_verified": False}),
        "run",
        "left no verified checkpoint",
    ),
    "changed input (cache key differs)": (_facts(cache_key=digest("other")), "run", ""),
    "digests match": (_facts(), "reuse", ""),
    "log not hashed yet": (_facts(log=None), "hash-log", ""),
    "log missing": (_facts(log=LogEvidence(missing=True)), "refuse", f"{LOG} is missing"),
    "log altered": (
        _facts(log=LogEvidence(sha256="b" * 64)),
        "refuse",
        f"{LOG} was altered (sha256 {'b' * 64}, sealed {LOG_SHA})",
    ),
    "log unreadable": (
        _facts(log=LogEvidence(error="Permission denied")),
        "refuse",
        f"{LOG} cannot be read (Permission denied)",
    ),
    "no log evidence recorded": (
        _facts({**OLD, "log_sha256": None}),
        "refuse",
        "has no log evidence",
    ),
}


@pytest.mark.parametrize("case", list(DECISIONS))
def test_decide_reuses_only_a_verified_matching_checkpoint_with_intact_evidence(case: str) -> None:
    facts, action, reason = DECISIONS[case]
    decision = decide(facts)
    assert decision.action == action, decision
    if reason:
        assert any(reason in r for r in decision.reasons), decision.reasons
    if action == "refuse":
        assert "not re-running it silently" in decision.reasons[0]
    assert decision.key_changed == (case == "changed input (cache key differs)")


def test_decide_asks_for_the_log_only_once_the_key_matched_then_decides() -> None:
    asked = decide(_facts(log=None))
    assert (asked.action, asked.log_path) == ("hash-log", LOG)
    assert decide(_facts(log=None, cache_key=digest("other"))).action == "run"  # no hashing
    assert decide(_facts(log=LogEvidence(sha256=LOG_SHA))).action == "reuse"
    assert decide(_facts()).explanation("R1") == {
        "resumed_from": "R1",
        "decision": "reused",
        "reasons": [],
    }


class _Manifests:
    def __init__(self, manifests: Mapping[str, dict[str, str]]) -> None:
        self.manifests = manifests

    def stored_manifest(self, digest: str) -> dict[str, str] | None:
        return self.manifests.get(digest)


def test_a_dependency_rerun_or_a_changed_input_changes_the_key_and_names_why() -> None:
    st = stage("s", inputs={"repos": ["app"]}, deps=["a"])
    before = cache_components(st, {"app": "d1"}, {"a": "ck-old"}, "env")
    rerun = cache_components(st, {"app": "d1"}, {"a": "ck-new"}, "env")
    edited = cache_components(st, {"app": "d2"}, {"a": "ck-old"}, "env")
    assert digest(before) == digest(cache_components(st, {"app": "d1"}, {"a": "ck-old"}, "env"))
    manifests = _Manifests({"d1": {"main.py": "x"}, "d2": {"main.py": "y"}})
    for components, why in (
        (rerun, "dependency 'a' has a new checkpoint (it re-ran)"),
        (edited, "input file app/main.py modified"),
    ):
        old = {**OLD, "cache_key": digest(before), "cache_components": before}
        decision = decide(_facts(old, cache_key=digest(components)))
        assert (decision.action, decision.key_changed) == ("run", True)
        changes = _explain.diff_components(
            before, components, old_env="env", new_env="env", checkpoints=manifests
        )
        assert [_explain.describe(c) for c in changes] == [why]


@pytest.mark.parametrize(
    ("command_ok", "inputs_unchanged", "expected"),
    [
        (True, True, "passed"),
        (True, False, "stale"),
        (True, None, "stale"),  # the post-run probe failed: not provably unchanged
        (False, True, "failed"),
        (False, False, "failed"),
        (False, None, "failed"),
    ],
)
def test_outcome_only_a_pass_with_unchanged_inputs_passes(
    command_ok: bool, inputs_unchanged: bool | None, expected: str
) -> None:
    assert outcome(command_ok=command_ok, inputs_unchanged=inputs_unchanged) == expected


def test_run_status_fails_closed() -> None:
    def recs(*statuses: str) -> list[dict[str, str]]:
        return [{"status": s} for s in statuses]

    assert run_status(recs("passed", "passed"), True) == "passed"
    assert run_status(recs("passed", "passed"), False) == "stale"
    assert run_status(recs("passed", "stale"), True) == "stale"
    assert run_status(recs("stale", "failed"), True) == "failed"
    assert run_status(recs("passed", "skipped"), True) == "failed"
    assert run_status(recs("passed", "running"), True) == "failed"


# --- a run with a fake executor and a fake clock ------------------------------------------


def test_fake_executor_and_clock_give_exact_timestamps_durations_and_run_id(
    ws: Workspace,
) -> None:
    clock = FakeClock()
    executor = FakeExecutor(clock, durations={"a": 2.5, "b": 0.25})
    seams = Seams(
        clock=clock,
        rng=random.Random(7),
        prober=FakeProber(),
        executor=executor,
        environment=lambda: "fixed-environment",
    )
    plan = [stage("a", inputs={"repos": ["app"]}), stage("b", inputs={"repos": []}, deps=["a"])]
    result = runner.run_checks(ws.args(), plan, seams=seams)

    assert result["run_id"] == "20270115T080000-52e6b438"
    assert result["status"] == "passed"
    assert (result["started_at"], result["finished_at"]) == (T0, "2027-01-15T08:00:02.750Z")
    assert result["environment_fingerprint"] == "fixed-environment"
    recs = by_id(result)
    assert (recs["a"]["started_at"], recs["a"]["finished_at"]) == (T0, "2027-01-15T08:00:02.500Z")
    assert recs["a"]["duration_seconds"] == 2.5
    assert recs["b"]["started_at"] == "2027-01-15T08:00:02.500Z"
    assert recs["b"]["duration_seconds"] == 0.25
    assert executor.ran == ["a", "b"]
    assert executor.envs[0] is not None and executor.envs[0]["RATCHET_STAGE_ID"] == "a"
    assert Path(recs["a"]["log_path"]).read_text() == "a ran\n"
    assert runner.read_receipt(ws.root, ws.state_dir, result["run_id"]) == result

    clock.advance(60)
    again = FakeExecutor(clock)
    resumed = runner.run_checks(
        ws.args(resume=result["run_id"]),
        plan,
        seams=Seams(
            clock=clock,
            rng=random.Random(8),
            prober=FakeProber(),
            executor=again,
            environment=lambda: "fixed-environment",
        ),
    )
    assert again.ran == []
    assert [r["reused_from"] for r in resumed["stages"]] == [result["run_id"]] * 2
    assert [r["duration_seconds"] for r in resumed["stages"]] == [0.0, 0.0]
    assert resumed["started_at"] == "2027-01-15T08:01:02.750Z"


def test_a_timeout_from_the_executor_fails_the_stage_and_skips_its_consumers(
    ws: Workspace,
) -> None:
    clock = FakeClock()
    executor = FakeExecutor(clock, durations={"slow": 5.0}, timeouts=frozenset({"slow"}))
    plan = [
        stage("slow", inputs={"repos": ["app"]}, timeout_seconds=5),
        stage("next", inputs={"repos": ["app"]}, deps=["slow"]),
    ]
    seams = Seams(clock=clock, prober=FakeProber(), executor=executor)
    result = runner.run_checks(ws.args(), plan, seams=seams)
    recs = by_id(result)
    assert result["status"] == "failed"
    assert (recs["slow"]["status"], recs["slow"]["exit_code"]) == ("failed", None)
    assert recs["slow"]["error"] == "stage 'slow' timed out after 5 s"
    assert recs["slow"]["duration_seconds"] == 5.0
    assert recs["next"]["status"] == "skipped"
    assert executor.ran == ["slow"]


def test_a_changed_input_between_runs_reruns_only_its_stage(ws: Workspace) -> None:
    prober = FakeProber({"app": digest("app v1"), "lib": digest("lib v1")})
    plan = [stage("a", inputs={"repos": ["app"]}), stage("b", inputs={"repos": ["lib"]})]
    first = runner.run_checks(ws.args(), plan, seams=Seams(prober=prober, executor=FakeExecutor()))
    prober.inputs["app"] = digest("app v2")
    executor = FakeExecutor()
    second = runner.run_checks(
        ws.args(resume=first["run_id"]), plan, seams=Seams(prober=prober, executor=executor)
    )
    assert executor.ran == ["a"]
    assert by_id(second)["b"]["reused_from"] == first["run_id"]
    assert by_id(second)["a"]["explain"]["reasons"] == [
        "inputs of repository 'app' changed (modified)"
    ]


class _UnreadableWorkspace(FakeProber):
    def source_identity(self) -> dict[str, str]:
        raise PermissionError(13, "Permission denied", "app/secret.txt")


def test_lower_errors_are_translated_at_the_boundary(ws: Workspace) -> None:
    plan = [stage("a", inputs={"repos": ["app"]})]
    seams = Seams(prober=_UnreadableWorkspace(), executor=FakeExecutor())
    with pytest.raises(ConfigError, match=r"its inputs cannot be read \(\[Errno 13\]") as info:
        runner.run_checks(ws.args(), plan, seams=seams)
    assert isinstance(info.value.__cause__, PermissionError)
    assert not list(ws.state_dir.glob("runs/*"))

    writer = FaultyWriter(lambda _, payload: payload["phase"] == "done")
    seams = writer.seams("journal", prober=FakeProber(), executor=FakeExecutor())
    with pytest.raises(ReceiptError, match="recover it before resuming"):
        runner.run_checks(ws.args(), plan, seams=seams)
    run_id = writer.written[-1]["run_id"]
    with pytest.raises(ReceiptError, match="recovered receipt .* unchanged") as failed:
        _recover.recover(
            ws.root,
            ws.state_dir,
            run_id,
            apply=True,
            confirm_processes_stopped=True,
            writer=FaultyWriter(lambda *_: True),
        )
    assert isinstance(failed.value.__cause__, OSError)
    assert runner.read_receipt(ws.root, ws.state_dir, run_id)["status"] == "running"


# --- seeded faults in the receipt writer --------------------------------------------------

SEEDS = range(40)


def _faulty_plan() -> list[dict[str, Any]]:
    return [
        stage("producer", inputs={"repos": ["app"]}),
        stage("consumer", inputs={"repos": ["lib"]}, deps=["producer"]),
        stage("last", inputs={"repos": ["lib"]}, deps=["consumer"]),
        stage("side", inputs={"repos": ["app"]}, after=["producer"]),
    ]


@pytest.mark.parametrize("mode", ["journal", "whole"])
@pytest.mark.parametrize("seed", SEEDS)
def test_a_failed_receipt_write_never_yields_a_trusted_checkpoint(
    ws: Workspace, seed: int, mode: str
) -> None:
    rng = random.Random(seed)
    fail_at = set(rng.sample(range(14), rng.randint(1, 3)))
    writer = FaultyWriter(lambda index, _: index in fail_at)
    clock = FakeClock()
    plan = _faulty_plan()
    preds = {s["id"]: [*s["deps"], *s["after"]] for s in plan}
    starts: list[tuple[str, dict[str, str]]] = []
    executor = FakeExecutor(clock, on_run=lambda st: starts.append((st["id"], writer.durable())))
    seams = writer.seams(
        mode, clock=clock, rng=random.Random(seed), prober=FakeProber(), executor=executor
    )
    result: dict[str, Any] | None = None
    failure: Exception | None = None
    try:
        result = runner.run_checks(ws.args(), plan, seams=seams)
    except (OSError, ReceiptError) as exc:
        failure = exc
    where = f"mode={mode} seed={seed} fail_at={sorted(fail_at)} writes={writer.outcomes}"

    # No stage starts before the checkpoints of its deps and `after` predecessors are on disk.
    for sid, durable in starts:
        for pred in preds[sid]:
            assert pred in durable, f"{where}: {sid!r} started before {pred!r} was durable"
    # Every checkpoint the run reports verified reached the disk in a successful write.
    if result is not None:
        durable = writer.durable()
        for sid, ck in _verified(result).items():
            assert durable.get(sid) == ck, f"{where}: {sid!r} verified but never durable"
        for sid, rec in by_id(result).items():
            if sid not in durable:
                assert rec["status"] != "passed", f"{where}: {sid!r} passed without a receipt"
    if not writer.written:  # the first write failed: the run never started
        assert isinstance(failure, OSError), f"{where}: {failure!r}"
        assert not list(ws.state_dir.glob("runs/*/receipt.json")), where
        return
    assert result is not None or isinstance(failure, ReceiptError), f"{where}: {failure!r}"

    # What is on disk is the last successful write; a resume trusts only its checkpoints.
    run_id = writer.written[-1]["run_id"]
    on_disk = runner.read_receipt(ws.root, ws.state_dir, run_id)
    assert on_disk == writer.written[-1], where
    if on_disk["status"] == "running":
        report = _recover.recover(
            ws.root, ws.state_dir, run_id, apply=True, confirm_processes_stopped=True, clock=clock
        )
        assert report["action"] == "recovered", f"{where}: {report}"
    resumed = runner.run_checks(
        ws.args(resume=run_id),
        plan,
        seams=Seams(clock=clock, prober=FakeProber(), executor=FakeExecutor(clock)),
    )
    assert resumed["status"] == "passed", where
    durable_on_disk = _verified(on_disk)
    for sid, rec in by_id(resumed).items():
        if rec.get("reused_from"):
            assert durable_on_disk.get(sid) == rec["checkpoint_id"], f"{where}: reused {sid!r}"


@pytest.mark.parametrize("mode", ["journal", "whole"])
def test_a_failed_checkpoint_write_fails_the_stage_with_the_writers_error(
    ws: Workspace, mode: str
) -> None:
    writer = FaultyWriter(lambda _, payload: by_id(payload)["only"]["checkpoint_verified"])
    seams = writer.seams(mode, prober=FakeProber(), executor=FakeExecutor())
    result = runner.run_checks(ws.args(), [stage("only", inputs={"repos": []})], seams=seams)
    assert writer.outcomes.count(False) == 1
    rec = by_id(result)["only"]
    assert (rec["status"], rec["checkpoint_verified"], rec["checkpoint_id"]) == (
        "failed",
        False,
        None,
    )
    assert rec["error"] == (
        "the verified checkpoint could not be persisted: "
        f"OSError: injected fault at write {writer.outcomes.index(False)}"
    )
    assert runner.read_receipt(ws.root, ws.state_dir, result["run_id"]) == result


# --- time and randomness come in through the seams ----------------------------------------

_CLOCK_READS = {"time", "monotonic", "sleep", "perf_counter", "monotonic_ns", "time_ns"}


def test_the_checks_package_reads_no_clock_and_no_randomness_directly() -> None:
    found = []
    for path in sorted(Path(ratchet.checks.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Attribute) and node.attr in ("now", "utcnow", "today"):
                owner = node.value
                owner_name = owner.attr if isinstance(owner, ast.Attribute) else None
                if isinstance(owner, ast.Name):
                    owner_name = owner.id
                if owner_name not in ("datetime", "date"):
                    continue
                names = [f"datetime.{node.attr}"]
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("time", "_time")
                and node.attr in _CLOCK_READS
            ):
                names = ["time"]
            else:
                continue
            for name in names:
                if name in ("time", "secrets") or name.startswith("datetime."):
                    found.append(f"{path.name}:{node.lineno}: {name}")
    assert not found, "read time or randomness through the Clock and the rng seams:\n" + "\n".join(
        found
    )
