"""Issue 17: the content-addressed cache. Verified checkpoints are found by cache key, so
any run reuses them without `--resume`; entries are re-verified, damaged ones are misses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from checks_helpers import Workspace, by_id, check

from ratchet.checks import runner
from ratchet.checks.common import read_json
from ratchet.cli import main as ratchet_main
from ratchet.store import seal

_BUILD = (
    "import pathlib\n"
    "pathlib.Path('out').mkdir(exist_ok=True)\n"
    "pathlib.Path('out/data.txt').write_text(pathlib.Path('src.txt').read_text().upper())\n"
)
_TEST = "import sys; sys.exit(0 if open('app/out/data.txt').read() == 'GOOD' else 1)"


def _ran(result: dict[str, Any]) -> set[str]:
    return {
        s["id"] for s in result["stages"] if s["status"] != "skipped" and not s.get("reused_from")
    }


def _hits(result: dict[str, Any]) -> set[str]:
    return {s["id"] for s in result["stages"] if s.get("cache_hit")}


def _entries(root: Path) -> list[Path]:
    return sorted((root / "entries").glob("*/*.json"))


def test_a_fresh_run_reuses_any_verified_result_with_the_same_key(two_repos: Workspace) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"]), check("b", repos=["lib"])], profiles={"p": ["b"]})
    first = ws.run(cache=True)
    assert _ran(first) == {"a", "b"}
    subset = ws.run(profile="p", cache=True)  # no --resume, another selection
    assert _hits(subset) == {"b"}
    assert by_id(subset)["b"]["reused_from"] == first["run_id"]
    reasons = runner.explain(ws.root, ws.state_dir, subset["run_id"], "b")["reasons"]
    assert reasons[0].startswith(f"cache hit: run {first['run_id']} left a verified checkpoint")
    ws.write("lib/lib.py", "Y = 3\n")
    third = ws.run(cache=True)
    assert _ran(third) == {"b"}
    assert _hits(third) == {"a"}
    # --resume keeps working beside the cache, and a reused stage's log is re-verified.
    resumed = ws.run(resume=third["run_id"], cache=True)
    assert _ran(resumed) == set()
    assert Path(by_id(subset)["b"]["log_path"]).read_text() == "ok\n"


def test_missing_outputs_are_restored_from_the_cache(ws: Workspace) -> None:
    ws.repo("app", {"src.txt": "good", ".gitignore": "out/\n"})
    ws.project(
        [
            check("build", _BUILD, cwd="app", repos=["app"], outputs=["app/out"]),
            check("test", _TEST, deps=["build"], repos=["app"]),
        ]
    )
    first = ws.run(cache=True)
    assert first["status"] == "passed"
    data = ws.root / "app" / "out" / "data.txt"
    data.unlink()  # a fresh clone, or `git clean -xdf`
    second = ws.run(cache=True)
    assert second["status"] == "passed"
    assert _hits(second) == {"build", "test"}
    assert data.read_text() == "GOOD"
    assert "outputs were restored from the cache" in by_id(second)["build"]["explain"]["reasons"][0]


def test_a_damaged_or_forged_cache_entry_is_a_miss_and_the_stage_runs(
    two_repos: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = two_repos
    monkeypatch.setenv("RATCHET_CHECKS_SIGNING_KEY", "k" * 32)
    ws.project([check("a", repos=["app"]), check("b", "raise SystemExit(1)", repos=["lib"])])
    first = ws.run(cache=True)
    cache = ws.state_dir / "cache"
    (entry,) = _entries(cache)  # only the pass was stored
    assert read_json(entry)["seal"].startswith("hmac-sha256:")
    log_sha = by_id(first)["a"]["log_sha256"]
    (cache / "blobs" / log_sha[:2] / log_sha).write_text("ok, trust me\n")
    second = ws.run(cache=True)
    assert _ran(second) == {"a", "b"}
    assert "was altered" in by_id(second)["a"]["explain"]["cache"]
    assert ws.run(cache=True)["stages"][0]["cache_hit"] is True  # the re-run stored it again
    # A forged entry (sealed by someone without the signing key) is refused.
    forged = read_json(entry)
    forged["origin_run_id"] = "someone-else"
    entry.write_text(json.dumps(seal(forged)))
    third = ws.run(cache=True)
    assert _ran(third) == {"a", "b"}
    assert "not signed" in by_id(third)["a"]["explain"]["cache"]


def test_a_shared_cache_directory_serves_another_clone(tmp_path: Path) -> None:
    shared = tmp_path / "shared-cache"
    made: list[Workspace] = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        ws = Workspace(tmp_path / name)
        ws.repo("app", {"main.py": "print('app')\n"})
        ws.project([check("a", repos=["app"])])
        made.append(ws)
    first = made[0].run(cache=True, cache_dir=str(shared))
    other = made[1].run(cache=True, cache_dir=str(shared))
    assert _hits(other) == {"a"}
    assert by_id(other)["a"]["reused_from"] == first["run_id"]


def test_a_read_only_cache_is_read_and_never_written(two_repos: Workspace) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    shared = ws.control / "cache"
    ws.run(cache=True, cache_dir=str(shared), cache_read_only=True)
    assert not shared.exists()
    first = ws.run(cache=True, cache_dir=str(shared))
    again = ws.run(cache=True, cache_dir=str(shared), cache_read_only=True)
    assert by_id(again)["a"]["reused_from"] == first["run_id"]


def test_the_cli_uses_the_cache_by_default_and_gc_bounds_it(
    two_repos: Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = two_repos
    ws.project([check("a", repos=["app"])])
    common = ["checks", "--workspace-root", str(ws.root), "--state-dir", str(ws.state_dir)]
    assert ratchet_main([*common, "run", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert ratchet_main([*common, "run", "--json"]) == 0
    assert by_id(json.loads(capsys.readouterr().out))["a"]["reused_from"] == first["run_id"]
    assert ratchet_main([*common, "run", "--no-cache", "--json"]) == 0
    assert "reused_from" not in by_id(json.loads(capsys.readouterr().out))["a"]

    assert ratchet_main([*common, "gc", "--keep-runs", "1", "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["removed_runs"]) == 2
    assert len(list((ws.state_dir / "runs").iterdir())) == 3
    assert ratchet_main([*common, "gc", "--keep-runs", "1", "--max-age-days", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["removed_entries"] == 1
    assert report["removed_blobs"] >= 1
    assert _entries(ws.state_dir / "cache") == []
    assert len(list((ws.state_dir / "runs").iterdir())) == 1
    assert ratchet_main([*common, "gc", "--keep-runs", "-1"]) == 2
    assert "must not be negative" in capsys.readouterr().err
