"""No-op resume of `ratchet checks` beside `doit` on the same plan.

A plan of 50 stages over 5 git repositories holding 5,000 input files in all. Both tools
run it once (everything executes), then again with nothing changed; only that second,
no-op run is timed, as the median of a few repeats: ratchet in this process
(`runner.run_checks`) and through its command line (`ratchet checks run --resume ...`,
the console script beside this interpreter, else `python -m ratchet.cli`; a fresh
interpreter each time, its bytecode compiled as an installed package's is), doit in this process. The printed ratios are ratchet / doit and ratchet's
command line / ratchet in process.

Not like for like: doit decides "up to date" from file timestamps (it hashes only files
whose mtime moved); ratchet lists every repository with git, lstats every listed file and
re-hashes it unless its stat cache (or the repository's tree cache) entry matches all of
mode, device, inode, size, mtime_ns and ctime_ns (files that changed within 2 s of being
hashed are always re-read), re-hashes every reused log, and writes a sealed receipt
(fsync'd) at the start and the end, with the reused checkpoints in one journal append
between. Both ratchet figures do the same run; the command line's also includes the
interpreter's start-up, its imports, reading the project file and printing the receipt.
Run:

    .venv/bin/python benchmarks/checks_noop_resume.py [--stages 50 --files 5000 --repos 5]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ratchet.checks import load_project, plan_stages, runner

# Issue 17's targets: ahead of doit at 5,000 files, under 300 ms at 50,000 files, under 1 s
# at 500 stages, and through the command line under 2x the in-process time.
TARGET_50K_FILES_SECONDS = 0.300
TARGET_500_STAGES_SECONDS = 1.0
TARGET_CLI_RATIO = 2.0


def make_workspace(root: Path, repos: int, files: int) -> list[Path]:
    paths = []
    per_repo = files // repos
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.com"}
    env |= {"GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.com"}
    for r in range(repos):
        repo = root / f"repo{r}"
        for i in range(per_repo):
            f = repo / f"pkg{i % 20}" / f"mod{i}.py"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(f"# repo {r} file {i}\nVALUE = {i}\n" + "x = 1\n" * 20)
        for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "init"]):
            subprocess.run(
                ["git", "-c", "commit.gpgsign=false", *argv], cwd=repo, env=env, check=True
            )
        paths.append(repo)
    return paths


def plan(repos: int, stages: int) -> list[dict[str, Any]]:
    """Stages spread over the repos; within a repo each stage depends on the previous one,
    and every fifth also comes after a stage of the previous repo."""
    out = []
    per_repo = stages // repos
    for r in range(repos):
        for k in range(per_repo):
            stage: dict[str, Any] = {
                "id": f"r{r}s{k}",
                "title": f"repo{r} step {k}",
                "argv": ["true"],
                "cwd": f"repo{r}",
                "timeout_seconds": 60,
                "inputs": {"repos": [f"repo{r}"]},
                "deps": [f"r{r}s{k - 1}"] if k else [],
                "after": [f"r{r - 1}s{k}"] if r and k % 5 == 0 else [],
                "resources": [],
            }
            out.append(stage)
    return out


def bench_ratchet(
    root: Path, repo_paths: list[Path], stages: list[dict[str, Any]], repeat: int
) -> tuple[float, list[float], list[float]]:
    """(full run, in-process no-op resumes, command-line no-op resumes), in seconds."""
    project = {
        "schema_version": 1,
        "name": "bench",
        "repositories": [{"name": p.name, "path": p.name} for p in repo_paths],
        "checks": [
            {
                "id": s["id"],
                "argv": s["argv"],
                "cwd": s["cwd"],
                "repos": s["inputs"]["repos"],
                "deps": s["deps"],
                "after": s["after"],
            }
            for s in stages
        ],
        "profiles": {},
    }
    (root / "checks.project.json").write_text(json.dumps(project))
    args = argparse.Namespace(
        workspace_root=str(root),
        project="checks.project.json",
        state_dir=str(root.parent / "ratchet-state"),
        dry_run=False,
        jobs=1,
        profile=None,
        resume=None,
        repo=None,
        changed=False,
    )
    stages = plan_stages(load_project(root / "checks.project.json"), workspace_root=root)
    t0 = time.perf_counter()
    first = runner.run_checks(args, stages)
    full = time.perf_counter() - t0
    assert first["status"] == "passed", first["status"]
    times = []
    previous = first["run_id"]
    for _ in range(repeat):
        args.resume = previous
        t0 = time.perf_counter()
        result = runner.run_checks(args, stages)
        times.append(time.perf_counter() - t0)
        assert result["status"] == "passed", result["status"]
        assert all(s.get("reused_from") for s in result["stages"]), "not a no-op resume"
        previous = result["run_id"]
    # An installed ratchet has its bytecode compiled; give the command line a bytecode cache
    # of its own (outside the source tree) and warm it once, even where the environment
    # says PYTHONDONTWRITEBYTECODE, so every timed run is not compiling ratchet's source.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(root.parent / "pycache")
    cli = _command_line()
    warm = [*cli, "checks", "--help"]
    subprocess.run(warm, env=env, capture_output=True, check=True)
    # Which ratchet the command runs: the one this interpreter imports with this environment
    # (PYTHONPATH first, then the installed package), as the console script does.
    where = [sys.executable, "-c", "import ratchet; print(ratchet.__file__)"]
    package = subprocess.run(where, env=env, capture_output=True, text=True, check=True)
    print(f"ratchet  command line {' '.join(cli)} imports {package.stdout.strip()}")
    cli_times = []
    for _ in range(repeat):
        argv = [*cli, "checks", "run", "--workspace-root"]
        argv += [str(root), "--state-dir", args.state_dir, "--resume", previous]
        argv += ["--no-cache", "--json"]
        t0 = time.perf_counter()
        proc = subprocess.run(argv, env=env, capture_output=True, check=False)
        cli_times.append(time.perf_counter() - t0)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        result = json.loads(proc.stdout)
        assert all(s.get("reused_from") for s in result["stages"]), "not a no-op resume"
        previous = result["run_id"]
    return full, times, cli_times


def _command_line() -> list[str]:
    """The `ratchet` command as installed beside this interpreter (what a user types; pip's
    console script imports `ratchet.cli` and calls `main`), else `python -m ratchet.cli`
    (which also loads `runpy`, a few milliseconds more)."""
    script = Path(sys.executable).with_name("ratchet")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "ratchet.cli"]


def bench_doit(
    root: Path, repo_paths: list[Path], stages: list[dict[str, Any]], repeat: int
) -> tuple[float, list[float]] | None:
    try:
        from doit.cmd_base import ModuleTaskLoader
        from doit.doit_cmd import DoitMain
    except ImportError:
        return None
    files = {
        p.name: sorted(str(f) for f in p.rglob("*.py") if ".git" not in f.parts) for p in repo_paths
    }
    namespace: dict[str, Any] = {}

    def task_checks() -> Any:
        for s in stages:
            repo = s["inputs"]["repos"][0]
            yield {
                "name": s["id"],
                "actions": [" ".join(s["argv"])],
                "file_dep": files[repo],
                "task_dep": [f"checks:{d}" for d in s["deps"] + s["after"]],
                "verbosity": 0,
            }

    namespace["task_checks"] = task_checks
    namespace["DOIT_CONFIG"] = {
        "dep_file": str(root.parent / "doit-state" / ".doit.db"),
        "verbosity": 0,
        "reporter": "zero",
    }
    (root.parent / "doit-state").mkdir(exist_ok=True)

    def once() -> float:
        sink = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            code = DoitMain(ModuleTaskLoader(namespace)).run(["run"])
        elapsed = time.perf_counter() - t0
        assert code == 0, sink.getvalue()
        return elapsed

    full = once()
    return full, [once() for _ in range(repeat)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=50)
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--repos", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5)
    opts = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="ratchet-bench-"))
    old_xdg = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp / "xdg")
    try:
        root = tmp / "ws"
        root.mkdir()
        repo_paths = make_workspace(root, opts.repos, opts.files)
        stages = plan(opts.repos, opts.stages)
        print(
            f"plan: {len(stages)} stages, {opts.repos} repos, {opts.files} input files; median of {opts.repeat}"
        )
        r_full, r_times, c_times = bench_ratchet(root, repo_paths, stages, opts.repeat)
        r_med, c_med = statistics.median(r_times), statistics.median(c_times)
        print(
            f"ratchet  full run {r_full * 1000:8.1f} ms   no-op resume {r_med * 1000:7.1f} ms "
            f"(min {min(r_times) * 1000:.1f}) in process"
        )
        print(
            f"ratchet  command line              no-op resume {c_med * 1000:7.1f} ms "
            f"(min {min(c_times) * 1000:.1f})"
        )
        cli_ratio = c_med / r_med
        verdict = "within" if cli_ratio < TARGET_CLI_RATIO else "OVER"
        print(
            f"ratio    command line / in process = {cli_ratio:.2f} "
            f"[{verdict} the {TARGET_CLI_RATIO:g}x target]"
        )
        if len(stages) >= 500:
            verdict = "within" if r_med < TARGET_500_STAGES_SECONDS else "OVER"
            print(f"target   500 stages under {TARGET_500_STAGES_SECONDS:g} s: {verdict}")
        if opts.files >= 50000:
            verdict = "within" if r_med < TARGET_50K_FILES_SECONDS else "OVER"
            print(
                f"target   50,000 files under {TARGET_50K_FILES_SECONDS * 1000:.0f} ms: {verdict}"
            )
        d = bench_doit(root, repo_paths, stages, opts.repeat)
        if d is None:
            print(
                "doit     not installed (pip install doit) - no baseline; ratchet's time is above"
            )
            return 0
        d_full, d_times = d
        d_med = statistics.median(d_times)
        print(
            f"doit     full run {d_full * 1000:8.1f} ms   no-op run    {d_med * 1000:7.1f} ms "
            f"(min {min(d_times) * 1000:.1f}) in process"
        )
        verdict = "ahead of" if r_med < d_med else "BEHIND"
        print(f"ratio    ratchet / doit no-op = {r_med / d_med:.2f} [{verdict} doit]")
        return 0
    finally:
        if old_xdg is None:
            os.environ.pop("XDG_STATE_HOME", None)
        else:
            os.environ["XDG_STATE_HOME"] = old_xdg
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
