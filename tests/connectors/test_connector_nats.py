"""NATS JetStream source and sink against a real `nats-server -js`."""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from connector_servers import AGENT, RATCHET, Nats, free_port, nats_binary

from ratchet._errors import ConfigError
from ratchet.connectors import sink_for, source_for
from ratchet.connectors._nats import NatsSink, NatsSource
from ratchet.runtime._io import JobIdentity

_names = itertools.count()


def streams(server: Nats) -> str:
    s = f"N{next(_names)}"
    server.add_stream(f"IN{s}", [f"in.{s}"])
    server.add_stream(f"OUT{s}", [f"out.{s}"])
    return s


def source(server: Nats, s: str, tmp: Path, interval: float = 0.05, **params: Any) -> NatsSource:
    query = "".join(f"&{k}={v}" for k, v in params.items())
    src = source_for(f"{server.url}?stream=IN{s}&subject=in.{s}{query}", key="key", follow=True)
    assert isinstance(src, NatsSource)
    src.open(JobIdentity("job1", tmp), checkpoint_interval=interval)
    return src


def next_values(src: NatsSource, n: int) -> list[Any]:
    """The next `n` records' values (waiting for the fetcher, which runs in its thread)."""
    out: list[Any] = []
    deadline = time.monotonic() + 60
    while len(out) < n:
        rec = src.next_record()
        if rec is None:
            assert time.monotonic() < deadline, f"only {out}"
            time.sleep(0.01)
        else:
            out.append(rec.value)
    return out


def consumer(server: Nats, s: str, durable: str) -> Any:
    async def info(js: Any) -> Any:
        return await js.consumer_info(f"IN{s}", durable)

    return server.run(info)


def test_redeliveries_are_recognised_by_stream_sequence_and_not_admitted_again(
    nats_server: Nats, tmp_path: Path
) -> None:
    s = streams(nats_server)
    nats_server.publish(f"in.{s}", [json.dumps({"key": "a", "i": i}).encode() for i in range(3)])
    first = source(nats_server, s, tmp_path, ack_wait=1)
    first.restore({})
    assert [v["i"] for v in next_values(first, 3)] == [0, 1, 2]
    position = first.position()
    assert position == {"stream": f"IN{s}", "durable": "ratchet-job1", "pending": [1, 2, 3]}
    first.close()  # as after a crash: the checkpoint holds 1-3, none was acknowledged

    again = source(nats_server, s, tmp_path)
    again.restore(position)
    nats_server.publish(f"in.{s}", [json.dumps({"key": "b", "i": 3}).encode()])
    # 1-3 come back once their ack-wait (1 s) ran out: recognised, acknowledged, skipped.
    assert [v["i"] for v in next_values(again, 1)] == [3]
    assert again.position()["pending"] == [1, 2, 3, 4]
    deadline = time.monotonic() + 30
    # 1-3 are acknowledged as they come back; the position forgets them once the server
    # confirmed it. None of them is a record.
    while again.position()["pending"] != [4]:
        assert again.next_record() is None
        assert time.monotonic() < deadline, again.position()
        time.sleep(0.01)
    assert consumer(nats_server, s, "ratchet-job1").num_ack_pending == 1  # only 4 is not acked
    again.acknowledge(again.position())
    again.close()  # waits for the acknowledgements
    info = consumer(nats_server, s, "ratchet-job1")
    assert (info.num_ack_pending, info.num_pending, info.ack_floor.stream_seq) == (0, 0, 4)


def test_an_ack_wait_shorter_than_the_checkpoint_interval_allows_is_refused(
    nats_server: Nats, tmp_path: Path
) -> None:
    s = streams(nats_server)
    with pytest.raises(
        ConfigError, match=r"ack-wait \(2 s\) is too short for the checkpoint interval \(500 ms\)"
    ):
        source(nats_server, s, tmp_path, interval=0.5, ack_wait=2)
    # A consumer made by someone else is checked the same way.
    from nats.js.api import ConsumerConfig

    async def add(js: Any) -> None:
        await js.add_consumer(f"IN{s}", ConsumerConfig(durable_name="theirs", ack_wait=1.5,
                                                       filter_subject=f"in.{s}"))  # fmt: skip

    nats_server.run(add)
    with pytest.raises(
        ConfigError, match=r"ack-wait \(1.5 s\) is too short .*\(`nats consumer edit`\)"
    ):
        source(nats_server, s, tmp_path, interval=0.2, durable="theirs")


def test_a_missing_stream_is_refused(nats_server: Nats, tmp_path: Path) -> None:
    src = source_for(f"{nats_server.url}?stream=NOPE&subject=x", key="key", follow=False)
    with pytest.raises(ConfigError, match="JetStream has no stream 'NOPE'; create it first"):
        src.open(JobIdentity("job1", tmp_path), checkpoint_interval=0.2)
    out = sink_for(f"{nats_server.url}?stream=NOPE&subject=x", append=False)
    with pytest.raises(ConfigError, match="JetStream has no stream 'NOPE'"):
        out.open(JobIdentity("job1", tmp_path))


def test_the_sink_publishes_with_the_output_id_and_the_server_drops_a_republish(
    nats_server: Nats, tmp_path: Path
) -> None:
    s = streams(nats_server)
    out = sink_for(f"{nats_server.url}?stream=OUT{s}&subject=out.{s}", append=False)
    assert isinstance(out, NatsSink)
    out.open(JobIdentity("job1", tmp_path))
    rec = {"id": "a:0:r>x:0", "key": "a", "seq": 0, "task": "r>x", "output": {"v": 1}}
    try:
        assert out.write([rec]) == 1
        assert out.write([rec]) == 0  # released again after a crash: not a new output
        assert out.duplicates == 1 and out.duplicate_window == 120
    finally:
        out.close()
    [(data, headers)] = nats_server.messages(f"OUT{s}")
    assert json.loads(data) == {"id": "a:0:r>x:0", "job": "job1", **rec}
    assert headers["Nats-Msg-Id"] == "job1:a:0:r>x:0"
    assert headers["Ratchet-Output-Id"] == "a:0:r>x:0"


def test_messages_are_acknowledged_only_when_the_engine_says_their_checkpoint_completed(
    nats_server: Nats, tmp_path: Path
) -> None:
    s = streams(nats_server)
    nats_server.publish(f"in.{s}", [json.dumps({"key": "a", "i": i}).encode() for i in range(3)])
    src = source(nats_server, s, tmp_path)
    src.restore({})
    try:
        next_values(src, 2)
        taken = src.position()  # what a checkpoint would hold now
        next_values(src, 1)  # admitted after that checkpoint was taken
        info = consumer(nats_server, s, "ratchet-job1")
        assert (info.num_ack_pending, info.ack_floor.stream_seq) == (3, 0)  # nothing acked yet
        src.acknowledge(taken)
        deadline = time.monotonic() + 30
        while consumer(nats_server, s, "ratchet-job1").ack_floor.stream_seq < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        info = consumer(nats_server, s, "ratchet-job1")
        assert (info.num_ack_pending, info.ack_floor.stream_seq) == (1, 2)
        while src.position()["pending"] != [3]:  # 1-2 forgotten once it saw the floor pass
            assert src.next_record() is None
            assert time.monotonic() < deadline, src.position()
            time.sleep(0.01)
    finally:
        src.close()


@pytest.mark.slow
def test_a_slow_agent_gets_each_message_once_though_the_buffer_outlives_the_ack_wait(
    nats_server: Nats, tmp_path: Path
) -> None:
    # The engine holds 1,000 inputs and the fetcher buffers up to 4 batches more: at 10 ms an
    # input on two keys, the last 300 wait in the source's buffer past the 1 s ack-wait. The
    # server redelivers them and a second copy reaches the buffer; the copy of a message
    # already acknowledged (below the ack floor) must not be admitted again.
    s = streams(nats_server)
    n = 1300
    inputs = [{"key": f"k{i % 2}", "i": i, "sleep": 0.01} for i in range(n)]
    nats_server.publish(f"in.{s}", [json.dumps(r).encode() for r in inputs])
    with open(tmp_path / "stderr.log", "wb") as err:
        proc = subprocess.run(
            [*RATCHET, "run", AGENT, "--input",
             f"{nats_server.url}?stream=IN{s}&subject=in.{s}&ack_wait=1",
             "--output", f"{nats_server.url}?stream=OUT{s}&subject=out.{s}",
             "--state", str(tmp_path / "state"), "--checkpoint-interval", "20"],
            stdout=subprocess.DEVNULL, stderr=err, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 0, (tmp_path / "stderr.log").read_text()[-3000:]
    outs = [json.loads(data) for data, _h in nats_server.messages(f"OUT{s}")]
    assert sorted(o["output"]["i"] for o in outs) == list(range(n))
    per_key: dict[str, list[int]] = {}
    for o in outs:
        per_key.setdefault(o["key"], []).append(o["output"]["n"])
    for key, counts in per_key.items():  # the state counted each input once
        assert sorted(counts) == list(range(1, len(counts) + 1)), key


def test_a_stale_copy_fetched_before_the_ack_is_not_admitted_after_the_ack_floor_passed_it(
    nats_server: Nats, tmp_path: Path
) -> None:
    s = streams(nats_server)
    nats_server.publish(f"in.{s}", [json.dumps({"key": "a", "i": 0}).encode()])
    src = source(nats_server, s, tmp_path, ack_wait=1)
    src.restore({})
    try:
        assert [v["i"] for v in next_values(src, 1)] == [0]
        time.sleep(2.5)  # past the ack-wait: the server redelivers 1, the fetcher buffers it
        src.acknowledge(src.position())
        deadline = time.monotonic() + 30
        while src.position()["pending"]:  # forgotten once the ack floor passed it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert consumer(nats_server, s, "ratchet-job1").delivered.consumer_seq >= 2
        for _ in range(50):
            assert src.next_record() is None  # the copy in the buffer is skipped
            time.sleep(0.01)
    finally:
        src.close()


def test_a_message_holding_nan_is_a_bad_input(nats_server: Nats, tmp_path: Path) -> None:
    # Python's json took NaN and Infinity, which JSON has not (a JSONL line holding one is a
    # bad input already).
    s = streams(nats_server)
    nats_server.publish(f"in.{s}", [b'{"key": "a", "v": NaN}'])
    src = source(nats_server, s, tmp_path)
    src.restore({})
    try:
        deadline = time.monotonic() + 30
        while (rec := src.next_record()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert rec.error is not None and "NaN is not JSON" in rec.error, rec
    finally:
        src.close()


def test_an_unreachable_server_or_a_subject_outside_the_stream_is_one_line_and_exit_2(
    nats_server: Nats, tmp_path: Path
) -> None:
    s = streams(nats_server)
    nowhere = f"nats://u:pw@127.0.0.1:{free_port()}"
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"key": "a", "i": 0}) + "\n")
    cases = [
        (["--input", f"{nowhere}?stream=IN{s}&subject=in.{s}", "--output", str(tmp_path / "o")],
         f"--input {nowhere.replace('pw', '***')}?stream=IN{s}&subject=in.{s}: cannot reach "
         f"NATS at {nowhere.rsplit('@', 1)[1]}: ConnectionRefusedError"),
        (["--input", str(src), "--output", f"{nowhere}?stream=OUT{s}&subject=out.{s}"],
         f"cannot reach NATS at {nowhere.rsplit('@', 1)[1]}"),
        (["--input", f"{nats_server.url}?stream=IN{s}&subject=elsewhere", "--output",
          str(tmp_path / "o")],
         f"JetStream refused a consumer of subject 'elsewhere' on stream IN{s}"),
    ]  # fmt: skip
    for i, (io, message) in enumerate(cases):
        started = time.monotonic()
        proc = subprocess.run(
            [*RATCHET, "run", AGENT, *io, "--state", str(tmp_path / f"state{i}")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert time.monotonic() - started < 15, proc.stderr  # not the 30 s call timeout
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and "pw@" not in proc.stderr
        assert message in proc.stderr


@pytest.mark.slow
def test_a_server_going_away_and_back_is_a_line_each_not_tracebacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    own = Nats(nats_binary())  # one this test may stop
    try:
        own.add_stream("OUT", ["out.x"])
        out = sink_for(f"{own.url}?stream=OUT&subject=out.x", append=False)
        out.open(JobIdentity("job1", tmp_path))
        rec = {"id": "a:0:r>x:0", "key": "a", "seq": 0, "task": "r>x", "output": 1}
        out.write([rec])
        with caplog.at_level(logging.DEBUG):
            own.down()
            time.sleep(5)  # reconnects fail meanwhile, every 2 s
            own.up()
            deadline = time.monotonic() + 30
            while "reconnected to NATS" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.1)
            out.write([{**rec, "id": "a:1:r>x:0", "seq": 1}])
            out.close()
    finally:
        own.stop()
    ours = [r for r in caplog.records if r.name == "ratchet.connectors.nats"]
    assert not any(r.exc_info for r in caplog.records), caplog.text
    assert sum("disconnected from NATS" in r.getMessage() for r in ours) == 1
    assert sum("reconnected to NATS" in r.getMessage() for r in ours) == 1
    assert sum(r.levelno >= logging.WARNING for r in ours) <= 3, caplog.text


def test_a_state_refused_at_restore_fetched_nothing(nats_server: Nats, tmp_path: Path) -> None:
    s = streams(nats_server)
    nats_server.publish(f"in.{s}", [json.dumps({"key": "a", "i": i}).encode() for i in range(5)])
    src = source(nats_server, s, tmp_path)
    try:
        time.sleep(1)  # time enough for a fetcher started by open to fetch
        with pytest.raises(ConfigError, match="not from the JetStream stream"):
            src.restore({"database": "x", "table": "t", "id_column": "id", "after": 3})
        info = consumer(nats_server, s, "ratchet-job1")
        assert (info.delivered.stream_seq, info.num_ack_pending) == (0, 0)
    finally:
        src.close()


def test_several_workers_are_refused_and_auto_picks_one(nats_server: Nats, tmp_path: Path) -> None:
    """After a coordinator's crash NATS gives the unacknowledged messages back in another
    order, and `--workers N` numbers inputs by the order it reads them: a chaos test saw one
    message dropped as done (and acknowledged upstream) and another run twice."""
    s = streams(nats_server)
    nats_server.publish(
        f"in.{s}", [json.dumps({"key": f"k{i}", "i": i}).encode() for i in range(5)]
    )
    base = [*RATCHET, "run", AGENT, "--input", f"{nats_server.url}?stream=IN{s}&subject=in.{s}",
            "--output", str(tmp_path / "o.jsonl"), "--state", str(tmp_path / "st")]  # fmt: skip
    refused = subprocess.run([*base, "--workers", "2"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert "cannot be read by --workers 2" in line and "--workers 1" in line, line
    auto = subprocess.run([*base, "--workers", "auto"], capture_output=True, text=True, timeout=120)
    assert auto.returncode == 0, auto.stderr
    assert "1 (a source that gives unacknowledged inputs back in another order" in auto.stderr
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 5


def test_the_client_loop_closes_without_leaving_pending_tasks() -> None:
    """What a stop just after the server came back left (a subscription's reader still
    waiting): closing the client's loop printed "Task was destroyed but it is pending!" and a
    RuntimeError traceback at exit. Tasks left are cancelled and awaited first."""
    import sys

    code = (
        "import asyncio\n"
        "from ratchet.connectors._nats import _Loop\n"
        "loop = _Loop('t')\n"
        "async def reader():\n"
        "    await asyncio.Queue().get()\n"
        "loop.submit(reader())\n"
        "loop.submit(asyncio.sleep(0))\n"
        "import time; time.sleep(0.2)\n"
        "loop.close()\n"
        "del loop\n"
        "import gc; gc.collect()\n"
        "print('closed')\n"
    )
    pytest.importorskip("nats", reason="nats-py is not installed: pip install 'ratchet[nats]'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "closed", done.stderr
    assert "Task was destroyed" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def consumer_names(server: Nats, stream: str) -> list[str]:
    async def names(js: Any) -> list[str]:
        return sorted(c.name for c in await js.consumers_info(stream))

    return list(server.run(names))


def test_a_start_refused_after_open_deletes_the_consumer_it_created(
    nats_server: Nats, tmp_path: Path
) -> None:
    """A state that read a JSONL file, given a NATS --input: refused at restore, which comes
    after the source's open created its durable consumer. The consumer was left on the
    server, unused for good (named after this state's job id)."""
    s = streams(nats_server)
    nats_server.publish(f"in.{s}", [json.dumps({"key": "a", "i": 0}).encode()])
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"key": "a", "i": 0}) + "\n")
    base = [*RATCHET, "run", AGENT, "--output", str(tmp_path / "o.jsonl"),
            "--state", str(tmp_path / "st")]  # fmt: skip
    first = subprocess.run([*base, "--input", str(inp)], capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    uri = f"{nats_server.url}?stream=IN{s}&subject=in.{s}"
    refused = subprocess.run([*base, "--input", uri], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr
    assert "not from the JetStream stream" in refused.stderr
    assert consumer_names(nats_server, f"IN{s}") == []
    assert nats_server.count(f"IN{s}") == 1  # the stream itself is untouched


def test_a_refused_start_keeps_a_consumer_that_existed_before(
    nats_server: Nats, tmp_path: Path
) -> None:
    """A consumer this start did not create is never deleted: the job's consumer holds its
    position (the ack floor), and one the user made may have settings of their own."""
    s = streams(nats_server)
    nats_server.publish(f"in.{s}", [json.dumps({"key": "a", "i": i}).encode() for i in range(3)])
    uri = f"{nats_server.url}?stream=IN{s}&subject=in.{s}"
    base = [*RATCHET, "run", AGENT, "--output", str(tmp_path / "o.jsonl"),
            "--state", str(tmp_path / "st")]  # fmt: skip
    first = subprocess.run([*base, "--input", uri], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    (ours,) = consumer_names(nats_server, f"IN{s}")
    assert consumer(nats_server, s, ours).ack_floor.stream_seq == 3

    # The same state through another consumer: refused at restore, naming the one it read
    # through. The consumer this start created goes; the job's stays, its progress with it.
    other = subprocess.run(
        [*base, "--input", f"{uri}&durable=other"], capture_output=True, text=True, timeout=60
    )
    assert other.returncode == 2, other.stderr
    assert f"pass ?durable={ours} to resume it" in other.stderr
    assert consumer_names(nats_server, f"IN{s}") == [ours]
    assert consumer(nats_server, s, ours).ack_floor.stream_seq == 3

    # A consumer the user made beforehand, never read from, named by a start that is refused:
    # not this start's to delete.
    from nats.js.api import AckPolicy, ConsumerConfig

    async def make(js: Any) -> None:
        await js.add_consumer(
            f"IN{s}",
            ConsumerConfig(durable_name="mine", ack_policy=AckPolicy.EXPLICIT,
                           filter_subject=f"in.{s}", ack_wait=30),
        )  # fmt: skip

    nats_server.run(make)
    mine = subprocess.run(
        [*base, "--input", f"{uri}&durable=mine"], capture_output=True, text=True, timeout=60
    )
    assert mine.returncode == 2, mine.stderr
    assert consumer_names(nats_server, f"IN{s}") == sorted([ours, "mine"])


def test_a_state_whose_consumer_is_gone_is_refused_not_read_again_from_the_start(
    nats_server: Nats, tmp_path: Path
) -> None:
    """The consumer holds the job's progress: deleted (or lost with the server's store), open
    made a new one, which delivered the whole stream again, and every input already
    processed ran a second time (its outputs written twice, its key's state applied twice)."""
    s = streams(nats_server)
    nats_server.publish(f"in.{s}", [json.dumps({"key": "a", "i": i}).encode() for i in range(3)])
    out = tmp_path / "o.jsonl"
    args = [*RATCHET, "run", AGENT, "--input", f"{nats_server.url}?stream=IN{s}&subject=in.{s}",
            "--output", str(out), "--state", str(tmp_path / "st")]  # fmt: skip
    first = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    (ours,) = consumer_names(nats_server, f"IN{s}")

    async def delete(js: Any) -> None:
        await js.delete_consumer(f"IN{s}", ours)

    nats_server.run(delete)
    again = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2, again.stderr
    line = one_line(again.stderr)
    assert (
        f"the durable consumer '{ours}' that this state read stream IN{s} through is gone" in line
    )
    assert "or start over with a new --state" in line
    assert len(out.read_text().splitlines()) == 3  # nothing processed twice
    assert consumer_names(nats_server, f"IN{s}") == []  # the one this start made is gone too


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    (line,) = [x for x in stderr.splitlines() if x.startswith("ratchet: error:")]
    return line
