"""The web dashboard of a supervised job, end to end: its JSON endpoints, then the page itself in
a real headless Chromium (Debian's `chromium`, driven by playwright with `executable_path`).

A real `ratchet run --supervise --rest-port P` on a free loopback port runs the desk agent
(tests/runtime/dashboard_support/desk_agent.py): memory of several types for alice and bob, a
run of carol that fails (a dead letter), a refund for dave that waits for approval. Every wait
is a poll with a deadline; no timed assertion.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_rest_metrics import free_port, get_json, poll, request, stop

AGENT = Path(__file__).parent / "dashboard_support" / "desk_agent.py"
INPUTS = [
    {"key": "alice", "text": "hello"},
    {"key": "bob", "text": "hi"},
    {"key": "alice", "text": "again"},
    {"key": "carol", "fail": True},
    {"key": "dave", "ask": True},
]
TOKEN = "dashboard-test-token"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Job:
    def __init__(self, tmp: Path, port: int, proc: subprocess.Popen[bytes], token: str | None):
        self.tmp, self.port, self.proc, self.token = tmp, port, proc, token

    def get(self, path: str) -> Any:
        return get_json(self.port, path, self.token)

    def outputs(self) -> list[dict[str, Any]]:
        out = self.tmp / "out.jsonl"
        return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []

    def settled(self, completed: int = 4, approvals: int = 1) -> bool:
        """All inputs in: (of INPUTS) four runs completed, dave's refund waiting for approval."""
        runs = self.get("/v1/runs")
        return len(runs["recent"]) == completed and len(self.get("/v1/approvals")) == approvals


def start_job(
    tmp: Path,
    token: str | None = None,
    workers: int = 1,
    inputs: list[dict[str, Any]] = INPUTS,
    settled: tuple[int, int] = (4, 1),
) -> Job:
    (tmp / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in inputs))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RATCHET_REST_TOKEN"}
    if token is not None:
        env["RATCHET_REST_TOKEN"] = token
    cmd = [
        sys.executable, "-m", "ratchet.cli", "run", f"{AGENT}:Desk",
        "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl"),
        "--state", str(tmp / "state"), "--supervise", "--follow", "--rest-port", str(port),
        "--checkpoint-interval", "0.1", "--workers", str(workers),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    job = Job(tmp, port, proc, token)
    poll("the job to settle", lambda: job.settled(*settled), timeout=60)
    return job


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    j = start_job(tmp_path)
    yield j
    stop(j.proc)


# -- the JSON endpoints the page reads -------------------------------------------------------


def test_keys_search_and_memory_with_types(job: Job) -> None:
    assert job.get("/v1/keys") == {
        "total": 3, "keys": ["alice", "bob", "carol"], "key_types": ["str", "str", "str"],
    }  # fmt: skip
    # Case-insensitive, and % is a plain character (not a LIKE wildcard).
    assert job.get("/v1/keys?contains=AL") == {"total": 1, "keys": ["alice"], "key_types": ["str"]}
    assert job.get("/v1/keys?contains=%25") == {"total": 0, "keys": [], "key_types": []}
    assert job.get("/v1/keys?limit=1") == {"total": 3, "keys": ["alice"], "key_types": ["str"]}
    mem = job.get("/v1/keys/alice/memory")
    assert mem["memory"] == {
        "count": 2,
        "last": "again",
        "ticket": {"title": "again", "priority": 2},
    }
    assert [(f["path"], f["type"], f["value"]) for f in mem["fields"]] == [
        ("count", "int", 2),
        ("last", "str", "again"),
        ("ticket", "demo.Ticket", {"title": "again", "priority": 2}),
    ]
    status, body, _ = request(job.port, "GET", "/v1/keys/nobody/memory")
    assert status == 404 and b"nobody" in body


def test_runs_traces_dead_letters_and_approvals(job: Job) -> None:
    runs = job.get("/v1/runs")
    recent = runs["recent"]
    assert sorted((r["key"], r["seq"], r["status"]) for r in recent) == [
        ("alice", 0, "ok"), ("alice", 2, "ok"), ("bob", 1, "ok"), ("carol", 3, "error"),
    ]  # fmt: skip
    # How many tasks each ran (it was always null: the count read an older trace format).
    assert all(isinstance(r["tasks"], int) and r["tasks"] >= 1 for r in recent), recent
    # Newest first: by the checkpoint that completed them, then by input.
    order = [(r["completed_at"], r["seq"]) for r in recent]
    assert order == sorted(order, reverse=True)
    assert [(r["key"], r["seq"]) for r in runs["in_flight"]] == [("dave", 4)]
    [waiting] = runs["waiting"]
    assert waiting["key"] == "dave" and waiting["on"].startswith("signal approval:")

    assert [r["seq"] for r in job.get("/v1/keys/alice/runs")] == [2, 0]
    trace = job.get("/v1/keys/alice/runs/2/trace")
    assert trace["status"] == "ok" and [t["action"] for t in trace["tasks"]] == ["on_input"]
    assert ["s", "last", "again"] in trace["tasks"][0]["memory"]
    status, _, _ = request(job.port, "GET", "/v1/keys/alice/runs/9/trace")
    assert status == 404

    [dead] = job.get("/v1/dead-letters")
    assert (dead["kind"], dead["key"], dead["seq"]) == ("failed-run", "carol", 3)

    [approval] = job.get("/v1/approvals")
    assert approval["key"] == "dave" and approval["tool"] == "refund"
    assert approval["arguments"] == {"order_id": "A-1", "amount_cents": 500}
    assert approval["signal"] == waiting["on"].removeprefix("signal ")


def test_history_follows_the_reports_and_matches_the_job(job: Job) -> None:
    samples = job.get("/v1/job/history")["samples"]
    assert samples, "a sample per worker report"
    last = samples[-1]
    assert (last["inputs"], last["runs_completed"], last["runs_failed"]) == (5, 4, 1)
    assert last["checkpoint"]["id"] >= 1 and last["checkpoint"]["size_bytes"] > 0
    times = [s["t"] for s in samples]
    assert times == sorted(times)
    info = job.get("/v1/job")
    assert (info["in_flight_runs"], info["restarts"]) == (last["in_flight_runs"], 0)


def test_the_page_and_its_files_are_served_and_need_no_token(tmp_path: Path) -> None:
    j = start_job(tmp_path, token=TOKEN)
    try:
        status, body, headers = request(j.port, "GET", "/")
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert b"/dashboard/app.js" in body
        for name in ("app.js", "style.css"):
            status, body, _ = request(j.port, "GET", f"/dashboard/{name}")
            assert status == 200 and body
        # The data is not open: the page asks for the token.
        for path in ("/v1/keys", "/v1/runs", "/v1/approvals", "/v1/job/history"):
            assert request(j.port, "GET", path)[0] == 401
            assert request(j.port, "GET", path, TOKEN)[0] == 200
        # Nothing on the page is fetched from elsewhere: it works offline.
        page = request(j.port, "GET", "/")[1].decode()
        assert "http://" not in page and "https://" not in page
    finally:
        stop(j.proc)


# -- the page in a real browser ---------------------------------------------------------------

CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",  # this machine's network is closed
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian package `chromium`; .ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def open_page(browser: Any, url: str) -> tuple[Any, list[str]]:
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_selector("body[data-loaded=true]", timeout=30_000)
    return page, errors


def test_dashboard_in_chromium(job: Job, browser: Any, tmp_path: Path) -> None:
    walk_the_dashboard(job, browser, tmp_path)


def test_dashboard_in_chromium_over_a_sharded_job(browser: Any, tmp_path: Path) -> None:
    """The same walk over `--workers 2`: every view answers for the whole job (keys, runs,
    traces, dead letters with job-wide ids, approvals routed to the key's shard)."""
    job = start_job(tmp_path, workers=2)
    try:
        assert len(job.get("/v1/job")["shards"]) == 2
        walk_the_dashboard(job, browser, tmp_path)
    finally:
        stop(job.proc)


def walk_the_dashboard(job: Job, browser: Any, tmp_path: Path) -> None:
    base = f"http://127.0.0.1:{job.port}"
    page, errors = open_page(browser, base + "/")

    # The live figures are the API's.
    info = job.get("/v1/job")
    last = job.get("/v1/job/history")["samples"][-1]
    assert page.text_content("#job-state") == info["state"] == "running"
    assert page.text_content("#fig-restarts") == str(info["restarts"])
    assert page.text_content("#fig-in-flight") == str(info["in_flight_runs"])
    assert page.text_content("#fig-inputs") == str(int(last["inputs"])) == "5"
    assert page.text_content("#fig-runs-completed") == "4"
    assert page.text_content("#fig-runs-failed") == "1"
    assert page.locator("#chart-checkpoints path.line").count() == 1
    assert page.locator("#chart-throughput path.line").count() == 1
    assert page.text_content("#checkpoint-latest").startswith("latest checkpoint ")
    shot = tmp_path / "dashboard-overview.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Runs → the most recent completed run → its trace.
    page.click("nav a[data-view=runs]")
    page.wait_for_selector("#runs-recent tbody a")
    assert "dave" in page.text_content("#runs-in-flight")
    assert "signal approval:" in page.text_content("#runs-waiting")
    page.click("#runs-recent a[href='#/trace/alice/2']")
    page.wait_for_selector("#trace-tree li.task")
    assert page.text_content("#trace-title") == "Run of key alice, input 2"
    assert page.locator("#trace-tree li.task[data-action=on_input]").count() == 1
    tree = page.text_content("#trace-tree")
    assert 'memory set last = "again"' in tree and "executed" in tree
    page.screenshot(path=str(tmp_path / "dashboard-trace.png"), full_page=True)

    # Keys: search, then a key's memory with its types.
    page.click("nav a[data-view=keys]")
    page.fill("#key-search", "bo")
    page.wait_for_function("document.querySelectorAll('#key-list li').length === 1")
    page.click("#key-list a")
    page.wait_for_selector("#memory-table:not([hidden]) tbody tr")
    rows = page.locator("#memory-table tbody tr").all_text_contents()
    assert any("ticket" in r and "demo.Ticket" in r for r in rows), rows
    assert any("count" in r and "int" in r for r in rows), rows

    # Dead letters: redrive carol's from the page; the worker admits it again (it fails again,
    # the agent is unchanged: a new dead letter that names the one it redrove).
    page.click("nav a[data-view=dead-letters]")
    page.wait_for_selector("#dead-letters button.redrive")
    page.click("#dead-letters button.redrive")
    poll("the redrive to be marked", lambda: job.get("/v1/dead-letters")[0]["redrive_requested"])
    poll("the redriven run", lambda: job.get("/v1/dead-letters")[0]["redriven_as"] is not None)

    # Approvals: approve dave's refund; the run goes on and writes the model's reply.
    page.click("nav a[data-view=approvals]")
    page.wait_for_selector("#approvals button.approve")
    assert "refund" in page.text_content("#approvals")
    page.click("#approvals button.approve")
    poll(
        "dave's reply",
        lambda: any(o.get("output") == {"reply": "refund handled"} for o in job.outputs()),
    )
    assert job.get("/v1/approvals") == []
    assert errors == [], errors


def test_dashboard_asks_for_the_token(tmp_path: Path, browser: Any) -> None:
    j = start_job(tmp_path, token=TOKEN)
    try:
        page = browser.new_page()
        page.goto(f"http://127.0.0.1:{j.port}/")
        page.wait_for_selector("#token-form:not([hidden])")
        page.fill("#token-input", "wrong")
        page.click("#token-form button")
        page.wait_for_selector("#token-form:not([hidden])")
        assert page.text_content("#token-error") == "that token was refused"
        page.fill("#token-input", TOKEN)
        page.click("#token-form button")
        page.wait_for_selector("body[data-loaded=true]")
        assert page.text_content("#job-state") == "running"
        assert page.text_content("#fig-inputs") == "5"
    finally:
        stop(j.proc)


# The string key "7" and the integer key 7: two keys of one text, each with its own memory,
# runs and approval. The key view answered 400 (the API would not guess which key "7" was),
# and an approval could not be sent to either.
TWINS = [
    {"key": "7", "text": "as text"},
    {"key": 7, "text": "as number"},
    {"key": "7", "ask": True},
    {"key": 7, "ask": True},
]


@pytest.mark.parametrize("workers", [1, 2], ids=["one-worker", "two-workers"])
def test_dashboard_shows_each_of_two_keys_of_one_text(
    browser: Any, tmp_path: Path, workers: int
) -> None:
    job = start_job(tmp_path, workers=workers, inputs=TWINS, settled=(2, 2))
    try:
        keys = job.get("/v1/keys")
        assert (keys["keys"], keys["key_types"]) == (["7", "7"], ["int", "str"])
        page, errors = open_page(browser, f"http://127.0.0.1:{job.port}/#/keys")
        page.wait_for_function("document.querySelectorAll('#key-list li').length === 2")
        assert page.locator("#key-list li").all_text_contents() == ["7 (int)", "7 (str)"]
        for kind, text, seq in (("int", "as number", 1), ("str", "as text", 0)):
            page.click(f"#key-list a[href='#/keys/7?key_type={kind}']")
            # showKey fills the runs last: this run's link means the memory is this key's too.
            page.wait_for_selector(f"#key-runs a[href='#/trace/7/{seq}?key_type={kind}']")
            assert page.text_content("#key-title") == f"Key 7 ({kind})"
            rows = page.locator("#memory-table tbody tr").all_text_contents()
            assert any("last" in r and f'"{text}"' in r for r in rows), rows
            runs = page.text_content("#key-runs")
            assert f"input {seq} ok" in runs and page.locator("#key-runs li").count() == 1, runs
        page.click("#key-runs a")
        page.wait_for_selector("#trace-tree li.task")
        assert page.text_content("#trace-title") == "Run of key 7 (str), input 0"
        assert "update failed" not in page.text_content("#refreshed")

        # Each approval goes to its own key's run: the integer key's here.
        page.click("nav a[data-view=approvals]")
        page.wait_for_function(
            "document.querySelectorAll('#approvals button.approve').length === 2"
        )
        row = page.locator("#approvals tbody tr", has_text="7 (int)")
        row.locator("button.approve").click()
        page.wait_for_function(
            "document.querySelector('#approval-result').textContent.includes('for key 7 (int)')"
        )
        poll("the integer key's reply", lambda: len(job.get("/v1/approvals")) == 1)
        [left] = job.get("/v1/approvals")
        assert left["key"] == "7", left  # the string key's run still waits
        assert errors == [], errors
    finally:
        stop(job.proc)
