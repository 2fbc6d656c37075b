"""PostgreSQL source and sink against a real server: shapes, job identity, follow, refusals."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from connector_servers import AGENT, RATCHET, Postgres

from ratchet._errors import ConfigError
from ratchet.connectors import sink_for, source_for
from ratchet.connectors._postgres import PostgresSink, PostgresSource
from ratchet.runtime._io import INPUT_MAX_DEPTH, JobIdentity

_names = itertools.count()


def table() -> str:
    return f"pgt_{next(_names)}"


def sink(server: Postgres, name: str) -> PostgresSink:
    s = sink_for(f"{server.dsn}?table={name}", append=False)
    assert isinstance(s, PostgresSink)
    return s


def test_the_sink_creates_its_table_and_writes_each_output_once(
    postgres: Postgres, tmp_path: Path
) -> None:
    name = table()
    s = sink(postgres, name)
    s.open(JobIdentity("job1", tmp_path))
    rec = {"id": "a:0:r>x:0", "key": "a", "seq": 0, "task": "r>x", "output": {"v": 1}}
    try:
        assert s.write([rec]) == 1
        # A release repeated after a crash: only the new row is written, and said to be (the
        # engine counts outputs by it).
        assert s.write([rec, {**rec, "id": "a:1:r>x:0", "seq": 1}]) == 1
        assert s.write([rec]) == 0
    finally:
        s.close()
    rows = postgres.execute(f"SELECT id, job, key, seq, task, record FROM {name} ORDER BY seq")
    assert rows == [
        ("a:0:r>x:0", "job1", "a", 0, "r>x", rec),
        ("a:1:r>x:0", "job1", "a", 1, "r>x", {**rec, "id": "a:1:r>x:0", "seq": 1}),
    ]


def test_the_sink_says_whether_it_holds_outputs_of_the_job(
    postgres: Postgres, tmp_path: Path
) -> None:
    # What a state with no completed checkpoint is checked against: a job that has outputs
    # in its sink lost its history (ratchet.db-wal removed), and must not start over.
    s = sink(postgres, table())
    job = JobIdentity("job1", tmp_path)
    s.open(job)
    try:
        assert s.holds_outputs_of(job) is False
        s.write([{"id": "a:0:r>x:0", "key": "a", "seq": 0, "task": "r>x", "output": 1}])
        assert s.holds_outputs_of(job) is True
        assert s.holds_outputs_of(JobIdentity("job2", tmp_path)) is False
    finally:
        s.close()


def test_the_sink_says_whether_it_holds_outputs_whose_ids_a_test_accepts(
    postgres: Postgres, tmp_path: Path
) -> None:
    """What a sharded job asks of one shard whose state has no checkpoint: does the table hold
    an output of a key that shard owns? The database sends one id per key (the key is what
    an id holds before `:SEQ:TASK:INDEX`, colons and newlines in it included), in batches."""
    name = table()
    s = sink(postgres, name)
    job = JobIdentity("job1", tmp_path)
    s.open(job)
    try:
        assert s.holds_outputs_where(job, lambda i: True) is False  # an empty table
        keys = ["a", "b:1:x:2", "7", "line\nbreak", ""]
        s.write([
            {"id": f"{k}:{seq}:r>x:{index}", "key": k, "seq": seq, "task": "r>x", "output": 1}
            for k in keys for seq in (1, 2) for index in (0, 1)
        ])  # fmt: skip
        asked: list[str] = []

        def key_is(wanted: str) -> Any:
            def keep(out_id: str) -> bool:
                asked.append(out_id)
                return out_id.rsplit(":", 3)[0] == wanted

            return keep

        for k in keys:
            assert s.holds_outputs_where(job, key_is(k)) is True, k
        asked.clear()
        assert s.holds_outputs_where(job, key_is("b")) is False  # "b:1:x:2" is not "b"
        assert sorted(i.rsplit(":", 3)[0] for i in asked) == sorted(keys)  # one id per key
        assert s.holds_outputs_where(JobIdentity("job2", tmp_path), lambda i: True) is False
        # More keys than one batch holds: every one is asked about, each once.
        postgres.execute(
            f"INSERT INTO {name} (id, job, key, seq, task, record) SELECT 'g' || g || ':' || "
            f"s || ':r>x:0', 'job1', 'g' || g, s, 'r>x', '{{}}' FROM generate_series(1, 25000) "
            f"g, generate_series(1, 2) s"
        )
        asked.clear()
        assert s.holds_outputs_where(job, key_is("none")) is False
        assert len(asked) == len(set(asked)) == 25000 + len(keys)
        assert s.holds_outputs_where(job, key_is("g24999")) is True
    finally:
        s.close()


def test_a_table_of_the_wrong_shape_is_refused_naming_the_columns(
    postgres: Postgres, tmp_path: Path
) -> None:
    name = table()
    postgres.execute(f"CREATE TABLE {name} (id integer PRIMARY KEY, body text)")
    with pytest.raises(ConfigError) as err:
        sink(postgres, name).open(JobIdentity("job1", tmp_path))
    msg = str(err.value)
    assert (
        f"(table {name}) exists with another shape: it has the columns (id integer, body text)"
        in msg
    )
    assert "and primary key (id)" in msg
    assert (
        "needs the columns (id text, job text, key text, seq bigint, task text, record jsonb)"
        in msg
    )


def _another_jobs_table_is_refused(postgres: Postgres, tmp_path: Path, name: str) -> None:
    first = sink(postgres, name)
    first.open(JobIdentity("job1", tmp_path))
    first.write([{"id": "a:1:r>x:0", "key": "a", "seq": 1, "task": "r>x", "output": 1}])
    first.close()
    with pytest.raises(
        ConfigError, match="holds outputs of job job1, and this state directory is job job2"
    ):
        sink(postgres, name).open(JobIdentity("job2", tmp_path))


def test_a_table_of_another_job_is_refused(postgres: Postgres, tmp_path: Path) -> None:
    _another_jobs_table_is_refused(postgres, tmp_path, table())


def test_an_output_jsonb_cannot_hold_is_named(postgres: Postgres) -> None:
    s = sink(postgres, table())
    problem = s.validate({"id": "a:0:r>x:0", "output": "nul \x00 here"})
    assert problem == "it holds a NUL character (\\u0000), which PostgreSQL jsonb cannot store"
    assert s.validate({"id": "a:0:r>x:0", "output": "fine"}) is None
    assert s.validate({"id": "a:0:r>x:0", "output": {"k\x00": 1}}) is not None
    # The text backslash-u0000 is no NUL: jsonb stores it.
    assert s.validate({"id": "a:0:r>x:0", "output": "a \\u0000 b"}) is None


def test_an_output_with_a_nul_is_an_error_row_under_its_key_as_text(
    postgres: Postgres, tmp_path: Path
) -> None:
    name = table()
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"key": "a", "i": "nul \x00"})
        + "\n"
        + json.dumps({"key": "a", "i": "\\u0000"})
        + "\n"
    )
    proc = subprocess.run(
        [*RATCHET, "run", AGENT, "--input", str(src), "--output", f"{postgres.dsn}?table={name}",
         "--state", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = postgres.execute(f"SELECT key, seq, record FROM {name} ORDER BY seq")
    assert [(k, s) for k, s, _r in rows] == [("a", 0), ("a", 1)]
    assert rows[0][2]["key"] == "a" and "NUL character" in rows[0][2]["error"]["message"]
    assert rows[1][2]["output"] == {"i": "\\u0000", "n": 2}  # the text, written as it is


def test_the_source_follows_new_rows_and_resumes_after_its_position(
    postgres: Postgres, tmp_path: Path
) -> None:
    name = table()
    postgres.execute(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, key text, v int)")
    postgres.execute(f"INSERT INTO {name} (key, v) VALUES ('a', 1), ('b', 2)")
    src = source_for(f"{postgres.dsn}?table={name}&poll=0", key="key", follow=True)
    assert isinstance(src, PostgresSource)
    src.open(JobIdentity("job1", tmp_path), checkpoint_interval=0.2)
    src.restore({})
    try:
        assert [r.value for r in (src.next_record(), src.next_record())] == [
            {"id": 1, "key": "a", "v": 1},
            {"id": 2, "key": "b", "v": 2},
        ]
        assert src.next_record() is None
        postgres.execute(f"INSERT INTO {name} (key, v) VALUES ('c', 3)")
        rec = src.next_record()
        assert rec is not None and rec.value == {"id": 3, "key": "c", "v": 3}
        position = src.position()
    finally:
        src.close()
    assert position == {"database": "postgres", "table": name, "id_column": "id", "after": 3}
    postgres.execute(f"INSERT INTO {name} (key, v) VALUES ('d', 4)")
    again = source_for(f"{postgres.dsn}?table={name}", key="key", follow=False)
    again.open(JobIdentity("job1", tmp_path), checkpoint_interval=0.2)
    again.restore(position)
    try:
        rec = again.next_record()
        assert rec is not None and rec.key == "d"
        assert again.next_record() is None and not again.follow
        with pytest.raises(ConfigError, match="not from the PostgreSQL table other by 'id'"):
            source_for(f"{postgres.dsn}?table=other", key="key", follow=False).restore(position)
    finally:
        again.close()


def test_the_source_refuses_a_missing_table_or_a_non_integer_id(
    postgres: Postgres, tmp_path: Path
) -> None:
    job = JobIdentity("job1", tmp_path)
    with pytest.raises(ConfigError, match=r"\(table nope_nothing\) does not exist"):
        source_for(f"{postgres.dsn}?table=nope_nothing", key="key", follow=False).open(
            job, checkpoint_interval=0.2
        )
    name = table()
    postgres.execute(f"CREATE TABLE {name} (id text PRIMARY KEY, key text)")
    with pytest.raises(
        ConfigError, match=r"has no integer column 'id' .*\(its columns: id text, key text\)"
    ):
        source_for(f"{postgres.dsn}?table={name}", key="key", follow=False).open(
            job, checkpoint_interval=0.2
        )


def test_the_cli_refuses_a_wrong_table_with_exit_2_and_no_traceback(
    postgres: Postgres, tmp_path: Path
) -> None:
    name = table()
    postgres.execute(f"CREATE TABLE {name} (id integer PRIMARY KEY)")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"key": "a", "i": 0}) + "\n")
    proc = subprocess.run(
        [*RATCHET, "run", AGENT, "--input", str(src), "--output", f"{postgres.dsn}?table={name}",
         "--state", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert (
        f"ratchet: error: --output {postgres.dsn}?table={name} (table {name}) exists" in proc.stderr
    )


def test_rows_nested_too_deeply_are_bad_inputs_not_tracebacks(
    postgres: Postgres, tmp_path: Path
) -> None:
    """A jsonb column the database accepts may nest deeper than ratchet stores (94) or than
    Python's JSON reader can read (~1,000): each is a bad record naming its row."""
    name = table()
    postgres.execute(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, key text, v jsonb)")
    for depth in (50, 98, 3000):
        deep = "[" * depth + "]" * depth
        postgres.execute(f"INSERT INTO {name} (key, v) VALUES ('a', '{deep}')")
    src = source_for(f"{postgres.dsn}?table={name}", key="key", follow=False)
    src.open(JobIdentity("job1", tmp_path), checkpoint_interval=0.2)
    src.restore({})
    try:
        ok, deeper, deepest = src.next_record(), src.next_record(), src.next_record()
    finally:
        src.close()
    assert ok is not None and ok.error is None and ok.key == "a"
    assert deeper is not None and deeper.error is not None
    assert f"{name} row id=2: the input nests more than {INPUT_MAX_DEPTH}" in deeper.error
    assert deepest is not None and deepest.error is not None
    assert f"{name} row id=3: invalid JSON (arrays or objects nested too deeply" in deepest.error


@pytest.mark.parametrize("name", ["Res", "my-t"])
def test_a_mixed_case_or_special_table_name_is_that_exact_table(
    postgres: Postgres, tmp_path: Path, name: str
) -> None:
    """The table is looked up by its quoted name: `Res` is not `res`, `my-t` is one name."""
    suffix = next(_names)
    name = f"{name}{suffix}"
    _another_jobs_table_is_refused(postgres, tmp_path, name)
    # A source reads it by that name too.
    src = source_for(f"{postgres.dsn}?table={name}&id_column=seq", key="key", follow=False)
    src.open(JobIdentity("job1", tmp_path), checkpoint_interval=0.2)
    src.restore({})
    try:
        rec = src.next_record()
        assert rec is not None and rec.key == "a" and rec.value["id"] == "a:1:r>x:0"
    finally:
        src.close()


def test_a_table_named_like_an_existing_one_in_another_case_is_a_new_table(
    postgres: Postgres, tmp_path: Path
) -> None:
    lower = table()
    postgres.execute(f"CREATE TABLE {lower} (id integer PRIMARY KEY)")  # not an output table
    upper = lower.upper()
    s = sink(postgres, upper)
    s.open(JobIdentity("job1", tmp_path))  # "PGT_n" is not pgt_n: created, not refused
    try:
        s.write([{"id": "a:0:r>x:0", "key": "a", "seq": 0, "task": "r>x", "output": 1}])
    finally:
        s.close()
    assert postgres.execute(f'SELECT job FROM "{upper}"') == [("job1",)]


def run_cli(state: Path, *io: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RATCHET, "run", AGENT, *io, "--state", str(state)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_what_the_database_refuses_is_one_line_and_exit_2(
    postgres: Postgres, tmp_path: Path
) -> None:
    name = table()
    postgres.execute(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, key text)")
    postgres.execute(f"INSERT INTO {name} (key) VALUES ('a')")
    postgres.execute("DROP ROLE IF EXISTS nopriv")
    postgres.execute("CREATE ROLE nopriv LOGIN")
    nopriv = postgres.dsn.replace("postgres@", "nopriv@")
    out = str(tmp_path / "out.jsonl")
    (tmp_path / "in.jsonl").write_text(json.dumps({"key": "a", "i": 0}) + "\n")
    cases = [
        (["--input", f"{nopriv}?table={name}", "--output", out],
         f"(table {name}): PostgreSQL refused to read the table: permission denied for table "
         f"{name}; grant the user that privilege"),
        (["--input", str(tmp_path / "in.jsonl"), "--output", f"{nopriv}?table={table()}"],
         "PostgreSQL refused to prepare the output table: permission denied for schema public; "
         "grant the user that privilege"),
        (["--input", str(tmp_path / "in.jsonl"), "--output", f"{postgres.dsn}?table=noschema.t"],
         "PostgreSQL refused to prepare the output table: schema \"noschema\" does not exist; "
         "create the schema first"),
        (["--input", str(tmp_path / "in.jsonl"), "--output",
          f"postgresql://app:pw@127.0.0.1:abc/postgres?table={name}"],
         "--output postgresql://app:***@127.0.0.1:abc/postgres?table="),
    ]  # fmt: skip
    for i, (io, message) in enumerate(cases):
        proc = run_cli(tmp_path / f"state{i}", *io)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and "pw@" not in proc.stderr
        assert message in proc.stderr


def test_a_followed_source_retries_a_reconnect_that_fails(
    postgres: Postgres, tmp_path: Path
) -> None:
    """The database restarting: the connection drops and logging in fails for a while. The
    source logs "will retry" and reads on once it can, never failing the job."""
    name = table()
    postgres.execute(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, key text, v int)")
    postgres.execute(f"INSERT INTO {name} (key, v) VALUES ('a', 1)")
    role = f"r_{name}"
    postgres.execute(f"CREATE ROLE {role} LOGIN")
    postgres.execute(f"GRANT SELECT ON {name} TO {role}")
    dsn = postgres.dsn.replace("postgres@", f"{role}@")
    src = source_for(f"{dsn}?table={name}&poll=0", key="key", follow=True)
    src.open(JobIdentity("job1", tmp_path), checkpoint_interval=0.2)
    src.restore({})
    try:
        rec = src.next_record()
        assert rec is not None and rec.value["v"] == 1
        postgres.execute(f"ALTER ROLE {role} NOLOGIN")
        postgres.execute(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
        )
        for _ in range(3):  # the read fails, then each reconnect is refused
            assert src.next_record() is None
        postgres.execute(f"ALTER ROLE {role} LOGIN")
        postgres.execute(f"INSERT INTO {name} (key, v) VALUES ('b', 2)")
        deadline = time.monotonic() + 30
        while (rec := src.next_record()) is None:  # retried once a second
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert rec.value["v"] == 2
    finally:
        src.close()


def server_pids(server: Postgres) -> list[int]:
    """The postmaster and its children (backends, checkpointer, ...)."""
    pids = [server.proc.pid]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == server.proc.pid:
            pids.append(int(stat.parent.name))
    return pids


@contextlib.contextmanager
def frozen(server: Postgres) -> Iterator[None]:
    """The server SIGSTOPped, all of its processes: its sockets stay open, nothing answers."""
    # The postmaster first, so it forks nothing new; a backend may end between the listing
    # and its signal (a client that just disconnected), which is no reason to fail, and
    # whatever was stopped is continued whatever happens, so later tests find a live server.
    stopped = [server.proc.pid]
    try:
        os.kill(server.proc.pid, signal.SIGSTOP)
        for pid in server_pids(server)[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def sigterm_stops(proc: subprocess.Popen[bytes], err: Path, within: float) -> None:
    """SIGTERM ends the job cleanly (exit 0), within `within` seconds."""
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    took = time.monotonic() - began
    assert code == 0, err.read_text()
    assert took < within, took


def test_a_stop_is_honoured_while_the_database_does_not_answer(
    postgres: Postgres, tmp_path: Path
) -> None:
    """SIGSTOP the server mid-run (its sockets stay open, no query returns): SIGTERM still
    stops the job within seconds, exit 0, and a restart adds no output and loses none."""
    name = table()
    n = 20
    postgres.execute(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, key text, i int)")
    postgres.execute(
        f"INSERT INTO {name} (key, i) SELECT 'k' || (g % 3), g FROM generate_series(0, {n - 1}) g"
    )
    out = tmp_path / "out.jsonl"
    args = [*RATCHET, "run", AGENT, "--input", f"{postgres.dsn}?table={name}&poll=0.05",
            "--output", str(out), "--state", str(tmp_path / "state")]  # fmt: skip
    err = tmp_path / "stderr.log"
    with open(err, "wb") as fh:
        proc = subprocess.Popen([*args, "--follow"], stderr=fh)
    try:
        deadline = time.monotonic() + 60
        while not out.exists() or len(out.read_text().splitlines()) < n:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with frozen(postgres):
            time.sleep(1.5)  # the source's next poll now hangs
            sigterm_stops(proc, err, within=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    postgres.execute(f"INSERT INTO {name} (key, i) VALUES ('k0', {n})")
    again = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    outs = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(o["output"]["i"] for o in outs) == list(range(n + 1))


def test_a_row_with_a_null_key_is_named_as_such(postgres: Postgres, tmp_path: Path) -> None:
    name = table()
    postgres.execute(f"CREATE TABLE {name} (id bigserial PRIMARY KEY, key text)")
    postgres.execute(f"INSERT INTO {name} (key) VALUES (NULL)")
    src = source_for(f"{postgres.dsn}?table={name}", key="key", follow=False)
    src.open(JobIdentity("job1", tmp_path), checkpoint_interval=0.2)
    src.restore({})
    try:
        rec = src.next_record()
    finally:
        src.close()
    assert rec is not None and rec.error == (
        f"{name} row id=1: key field 'key' is null (NULL); keys must be strings or integers"
    )


@pytest.mark.slow
def test_a_stop_is_honoured_while_the_output_database_does_not_answer(
    postgres: Postgres, tmp_path: Path
) -> None:
    """SIGSTOP the server while the job writes outputs to it (its sockets stay open, no
    statement returns): SIGTERM still stops the job within seconds, and a restart writes
    every output once."""
    name = table()
    inp, out_uri = tmp_path / "in.jsonl", f"{postgres.dsn}?table={name}&write_timeout=2"
    inp.write_text("".join(json.dumps({"key": f"k{i % 3}", "i": i}) + "\n" for i in range(10)))
    args = [*RATCHET, "run", AGENT, "--input", str(inp), "--output", out_uri,
            "--state", str(tmp_path / "state")]  # fmt: skip
    err = tmp_path / "stderr.log"
    with open(err, "wb") as fh:
        proc = subprocess.Popen([*args, "--follow"], stderr=fh)
    try:
        deadline = time.monotonic() + 60
        while _rows(postgres, name) < 10:
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        with frozen(postgres):
            with inp.open("a") as f:
                f.write("".join(json.dumps({"key": "k0", "i": i}) + "\n" for i in range(10, 20)))
            time.sleep(1.5)  # their outputs' write now hangs
            sigterm_stops(proc, err, within=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    again = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    rows = postgres.execute(f"SELECT record FROM {name}")
    assert sorted(r[0]["output"]["i"] for r in rows) == list(range(20))


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "soon"])
def test_a_write_timeout_that_is_not_a_positive_number_is_refused(
    postgres: Postgres, bad: str
) -> None:
    with pytest.raises(ConfigError, match="write_timeout is a number of seconds > 0"):
        sink_for(f"{postgres.dsn}?table=t&write_timeout={bad}", append=False)


def _rows(server: Postgres, name: str) -> int:
    try:
        return int(server.execute(f"SELECT count(*) FROM {name}")[0][0])
    except Exception:  # noqa: BLE001 - the table is made by the job's sink
        return 0
