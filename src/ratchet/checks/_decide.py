"""Reuse or run: the rules of `--resume`, as pure functions.

Every fact arrives as an argument (the stage's cache key, the previous run's record of it,
the re-hash of its log), so the rules are table-tested without a disk, a clock or a process.
When a rule needs a fact the caller has not gathered yet (the log's digest, which is worth
computing only once the key matched), the decision says so and the caller asks again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ratchet.store import canonical_json, sha256_bytes

__all__ = [
    "CHECKPOINT_VERSION",
    "FINGERPRINT_VERSION",
    "Decision",
    "Facts",
    "LogEvidence",
    "cache_components",
    "checkpoint_id",
    "decide",
    "digest",
    "outcome",
    "run_status",
]

FINGERPRINT_VERSION = 1
CHECKPOINT_VERSION = 1

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Any, Literal, NamedTuple

    Action = Literal["run", "reuse", "refuse", "hash-log", "hash-outputs"]
    Outcome = Literal["passed", "failed", "stale"]
else:
    from ratchet._records import NamedTuple  # the same classes, built without `typing`

_WORD = {
    "run": "ran",
    "reuse": "reused",
    "refuse": "refused",
    "hash-log": "undecided",
    "hash-outputs": "undecided",
}


def digest(value: Any) -> str:
    """SHA-256 of a JSON value's canonical form."""
    return sha256_bytes(canonical_json(value))


def cache_components(
    stage: Mapping[str, Any],
    inputs: Any,
    dep_checkpoints: Mapping[str, str | None],
    environment: str,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a stage's cache key is made of; `inputs` is its probed input identity and
    `dep_checkpoints` maps each data dependency to what it produced in this run (its output
    digest when it declares outputs, else its checkpoint). `extra` holds the components
    only some stages have (declared outputs, hashed env values, runtime inputs)."""
    scope = stage.get("inputs")
    return {
        **dict(extra or {}),
        "fingerprint_version": FINGERPRINT_VERSION,
        "command": list(stage["argv"]),
        "cwd": stage["cwd"],
        "scope": None if scope is None else sorted(scope.get("repos") or []),
        "inputs": inputs,
        "deps": {d: dep_checkpoints[d] for d in sorted(stage["deps"])},
        "environment": environment,
    }


def checkpoint_id(cache_key: str, log_sha256: str, run_id: str) -> str:
    """The id of a checkpoint made in `run_id`: what its consumers' cache keys name."""
    return digest({"cache_key": cache_key, "log_sha256": log_sha256, "run": run_id})


# Immutable records as NamedTuples rather than dataclasses: `dataclasses` imports `inspect`,
# which every `ratchet checks` start-up would pay for. Change one with `_replace`.


class LogEvidence(NamedTuple):
    """What re-hashing a previous run's log found: its sha256, or why there is none."""

    sha256: str | None = None
    missing: bool = False
    error: str | None = None  # why it could not be read


class Facts(NamedTuple):
    """Everything the reuse decision for one stage depends on."""

    stage_id: str
    reuse: str  # the stage's "auto" or "never"
    cache_key: str
    resumed_from: str | None  # the previous run's id; None for a fresh run
    previous: Mapping[str, Any] | None  # the previous run's record of this stage
    log: LogEvidence | None = None  # the previous log's re-hash, once the decision asked
    outputs: str | None = None  # the declared outputs' digest on disk, once asked


class Decision(NamedTuple):
    """`run`, `reuse`, `refuse` (fail the stage without running it), `hash-log` (hash the
    log at `log_path` and decide again with the evidence in `Facts.log`) or `hash-outputs`
    (hash the declared outputs on disk and decide again with `Facts.outputs`)."""

    action: Action
    reasons: tuple[str, ...] = ()
    key_changed: bool = False  # `run` because the cache key differs: `_explain` names why
    log_path: str | None = None

    def explanation(self, resumed_from: str | None) -> dict[str, Any]:
        """The `explain` entry of a stage record (the long form is spelled out by `explain`)."""
        return {
            "resumed_from": resumed_from,
            "decision": _WORD[self.action],
            "reasons": list(self.reasons),
        }


def decide(facts: Facts) -> Decision:
    """Reuse the previous checkpoint only if it was verified, its key matches and its log
    still hashes to the sealed digest; a match with damaged evidence is refused, never
    re-run quietly. Anything else runs."""
    prev_id, old = facts.resumed_from, facts.previous
    if prev_id is None:
        return Decision("run", ("fresh run (no --resume)",))
    if old is None:
        return Decision("run", (f"new stage: not in run {prev_id}",))
    if facts.reuse == "never":
        return Decision("run", ("reuse is 'never'",))
    if old.get("checkpoint_version") != CHECKPOINT_VERSION or "cache_key" not in old:
        return Decision("run", (f"run {prev_id} recorded no checkpoint for it (legacy record)",))
    if old.get("status") != "passed" or old.get("checkpoint_verified") is not True:
        error = f": {old['error']}" if old.get("error") else ""
        return Decision(
            "run",
            (
                f"run {prev_id} left no verified checkpoint for it "
                f"(status {old.get('status')!r}{error})",
            ),
        )
    if old.get("cache_key") != facts.cache_key:
        return Decision("run", key_changed=True)
    log_path, expected = old.get("log_path"), old.get("log_sha256")
    if not log_path or not expected:
        problem = "has no log evidence"
    elif facts.log is None:
        return Decision("hash-log", log_path=str(log_path))
    elif facts.log.missing:
        problem = f"log evidence {log_path} is missing"
    elif facts.log.sha256 is None:
        problem = f"log evidence {log_path} cannot be read ({facts.log.error})"
    elif facts.log.sha256 != expected:
        problem = (
            f"log evidence {log_path} was altered (sha256 {facts.log.sha256}, sealed {expected})"
        )
    elif old.get("outputs_digest"):
        if facts.outputs is None:
            return Decision("hash-outputs")
        if facts.outputs != old["outputs_digest"]:
            return Decision(
                "run",
                (
                    f"declared outputs on disk differ from the checkpoint of run {prev_id} "
                    "(changed or removed since): re-running to produce them",
                ),
            )
        return Decision("reuse")
    else:
        return Decision("reuse")
    return Decision(
        "refuse",
        (
            f"checkpoint of {facts.stage_id!r} from run {prev_id} {problem}; refusing to reuse "
            "it and not re-running it silently: run without --resume to re-run it",
        ),
    )


def outcome(*, command_ok: bool, inputs_unchanged: bool | None) -> Outcome:
    """A finished command's status: only a pass whose inputs provably did not change while
    it ran is `passed`; `inputs_unchanged` is None when the post-run probe failed."""
    if not command_ok:
        return "failed"
    return "passed" if inputs_unchanged else "stale"


def run_status(records: Sequence[Mapping[str, Any]], snapshot_ok: bool) -> str:
    """The run's status from its stages' statuses and the end-of-run snapshot."""
    statuses = {r["status"] for r in records}
    if "failed" in statuses:
        return "failed"
    if "stale" in statuses or not snapshot_ok:
        return "stale"
    if statuses - {"passed"}:
        return "failed"
    return "passed"
