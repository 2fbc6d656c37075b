"""Issue 17: the content-addressed cache. Verified checkpoints are found by cache key, so
any run reuses them without `--resume`; entries are re-verified, damaged ones are misses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from checks_helpers import Workspace, by_id, check
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def _built(ws: Workspace) -> Path:
    """A passed, cached `build` whose declared output `app/out` is then deleted; the path
    of its (unsigned) cache entry."""
    ws.repo("app", {"src.txt": "good", ".gitignore": "out\n"})  # a folder or a link
    ws.project([check("build", _BUILD, cwd="app", repos=["app"], outputs=["app/out"])])
    assert ws.run(cache=True)["status"] == "passed"
    (entry,) = _entries(ws.state_dir / "cache")
    for f in (ws.root / "app" / "out").iterdir():
        f.unlink()
    (ws.root / "app" / "out").rmdir()
    return entry


def _forge(entry: Path, extra: dict[str, str], redigest: bool) -> None:
    """What a writer of an unsigned cache can do: name more files in an entry's outputs
    manifest (with the outputs digest made to match, or not) and seal it again."""
    from ratchet.checks._decide import digest

    forged = read_json(entry)
    forged.pop("seal")
    forged["outputs"] = {**forged["outputs"], **extra}
    if redigest:
        forged["outputs_digest"] = digest(forged["outputs"])
    entry.write_text(json.dumps(seal(forged)))


@pytest.mark.parametrize("redigest", [True, False], ids=["digest-matched", "digest-kept"])
@pytest.mark.parametrize("target", ["escape", "absolute", "source"])
def test_a_cache_entry_restores_nothing_but_the_stage_declared_outputs(
    ws: Workspace, tmp_path: Path, target: str, redigest: bool
) -> None:
    """A forged manifest naming a file out of the workspace (by `..` or an absolute path)
    or a file the stage does not declare (the repository's own source) writes nothing: the
    entry is a miss and the stage runs. (Restoring wrote any named file.)"""
    entry = _built(ws)
    outside = tmp_path / "escaped"
    rel = {
        "escape": "../" * len(ws.root.relative_to(tmp_path).parts) + "escaped",
        "absolute": str(outside),
        "source": "app/src.txt",
    }[target]
    ident = read_json(entry)["outputs"]["app/out/data.txt"]  # the bytes "GOOD"
    _forge(entry, {rel: ident}, redigest)
    result = ws.run(cache=True)
    build = by_id(result)["build"]
    assert result["status"] == "passed"
    assert not build.get("cache_hit")
    why = build["explain"]["cache"]
    if redigest:
        assert f"it names {rel!r}, which is not among the stage's declared outputs" in why
    else:
        assert "its outputs manifest does not match its outputs digest" in why
    assert not outside.exists()
    assert (ws.root / "app" / "src.txt").read_text() == "good"
    assert (ws.root / "app" / "out" / "data.txt").read_text() == "GOOD"  # the stage's own


def test_a_cache_entry_restores_nothing_through_a_link_out_of_the_workspace(
    ws: Workspace, tmp_path: Path
) -> None:
    entry = _built(ws)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (ws.root / "app" / "out").symlink_to(elsewhere)  # the declared output, now a link
    dry = by_id(ws.run(cache=True, dry_run=True))["build"]
    assert dry["prediction"] == "run"
    assert any("leads out of the workspace" in r for r in dry["reasons"])
    assert list(elsewhere.iterdir()) == []
    assert "leads out of the workspace" in by_id(ws.run(cache=True))["build"]["explain"]["cache"]
    assert entry.exists()


def test_a_dry_run_re_hashes_the_cached_outputs_it_would_restore(ws: Workspace) -> None:
    """--dry-run predicts `run`, as the run then does, when an output blob it would restore
    was altered (it predicted `reuse`)."""
    entry = _built(ws)
    sha = read_json(entry)["outputs"]["app/out/data.txt"].removeprefix("sha256:")
    blob = ws.state_dir / "cache" / "blobs" / sha[:2] / sha
    blob.chmod(0o644)
    blob.write_text("BAD")
    dry = by_id(ws.run(cache=True, dry_run=True))["build"]
    assert dry["prediction"] == "run"
    assert any("the cached output app/out/data.txt was altered" in r for r in dry["reasons"])
    build = by_id(ws.run(cache=True))["build"]
    assert not build.get("cache_hit")
    assert "was altered" in build["explain"]["cache"]


_NAMES = st.sampled_from(["a", "b.txt", "c.log", ".h", "d"])


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    files=st.lists(st.lists(_NAMES, min_size=1, max_size=4), min_size=1, max_size=8),
    patterns=st.lists(
        st.lists(
            st.sampled_from(["a", "d", "b.txt", "*", "*.txt", "**", "[ab]*", "."]),
            min_size=1,
            max_size=4,
        ).map("/".join),
        min_size=1,
        max_size=3,
    ),
)
def test_declared_output_admits_every_path_the_manifest_lists(
    tmp_path_factory: pytest.TempPathFactory, files: list[list[str]], patterns: list[str]
) -> None:
    """Whatever a stage's patterns make `outputs_manifest` list, `declared_output` admits
    (so a genuine entry always restores); a path out of the workspace never."""
    from ratchet.checks.checkpoints import declared_output, outputs_manifest

    root = tmp_path_factory.mktemp("outputs")
    for parts in files:
        path = root.joinpath(*parts)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("x")
        except (IsADirectoryError, NotADirectoryError, FileExistsError):
            continue  # a name used both as a file and as a folder: one of them wins
    for rel in outputs_manifest(root, patterns):
        assert declared_output(rel, patterns), (rel, patterns)
    for bad in ("../a", "a/../../b", "/a", "", "a//b", "./../a", "a/./b"):
        assert not declared_output(bad, patterns)
