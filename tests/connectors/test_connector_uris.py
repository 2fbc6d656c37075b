"""--input / --output URIs: what is refused, and how (no servers needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from connector_servers import AGENT

from ratchet._errors import ConfigError
from ratchet.connectors import is_uri, redact, sink_for, source_for


def test_paths_are_not_uris() -> None:
    assert is_uri("postgresql://h/db?table=t") and is_uri("http://127.0.0.1:1")
    assert not is_uri("in.jsonl") and not is_uri("C://data/in.jsonl") and not is_uri(Path("x"))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: source_for("kafka://b:9092", key="key", follow=False),
         "--input kafka://b:9092: unknown connector 'kafka'; ratchet takes a JSON Lines path"),
        (lambda: source_for("https://0.0.0.0:1", key="key", follow=False),
         "the ingestion endpoint speaks plain HTTP; put TLS in a reverse proxy"),
        (lambda: source_for("http://127.0.0.1:1/hooks", key="key", follow=False),
         "give only the address (http://HOST:PORT); events are POSTed to /v1/events"),
        (lambda: source_for("http://127.0.0.1", key="key", follow=False),
         "name the host and port, e.g. http://127.0.0.1:8090"),
        (lambda: source_for("http://127.0.0.1:1?max_pending=x", key="key", follow=False),
         "max_pending and max_body are integers"),
        (lambda: sink_for("http://127.0.0.1:1", append=False),
         "http:// is an input (an ingestion endpoint)"),
        (lambda: sink_for("postgresql://u:pw@h/db?table=t", append=True),
         "--append-output applies to a JSON Lines --output file, not postgresql://u:***@h/db"),
        (lambda: sink_for("postgresql://u:pw@h/db", append=False),
         "--output postgresql://u:***@h/db: name the table with ?table=NAME"),
        (lambda: source_for("postgresql://h/db?table=t&idcolumn=n", key="key", follow=False),
         "invalid URI query parameter: \"idcolumn\"; ratchet's parameters are id_column, poll, table"),
        (lambda: source_for("postgresql://h/db?table=t&poll=soon", key="key", follow=False),
         "poll is in seconds, a number"),
        (lambda: source_for("nats://127.0.0.1:4222?stream=S", key="key", follow=False),
         "name the subject: nats://HOST:PORT?stream=NAME&subject=SUBJECT"),
        (lambda: sink_for("nats://127.0.0.1:4222?subject=x", append=False),
         "name the stream"),
        (lambda: source_for("nats://127.0.0.1:4222?stream=S&subject=x&ack_wait=-1", key="key",
                            follow=False),
         "ack_wait and batch must be positive"),
        (lambda: source_for("postgresql://h/db?table=t&poll=nan", key="key", follow=False),
         "poll must be a number of seconds >= 0"),
        *[(lambda v=v: source_for(f"nats://127.0.0.1:4222?stream=S&subject=x&ack_wait={v}",
                                  key="key", follow=False),
           f"ack_wait is a number of seconds up to 86400 (a day), not {v}")
          for v in ("inf", "nan", "1e12")],
        (lambda: source_for("nats://127.0.0.1:4222?stream=S&subject=x&durable=a.b", key="key",
                            follow=False),
         "durable=a.b is not a NATS consumer name: it must not hold whitespace, '.'"),
        (lambda: source_for("nats://u:pw@127.0.0.1:99999?stream=S&subject=x", key="key",
                            follow=False),
         "--input nats://u:***@127.0.0.1:99999?stream=S&subject=x: the port is not a number"),
        (lambda: sink_for("nats://u:pw@127.0.0.1:abc?stream=S&subject=x", append=False),
         "--output nats://u:***@127.0.0.1:abc?stream=S&subject=x: the port is not a number"),
    ],
)  # fmt: skip
def test_a_wrong_uri_is_a_config_error_naming_it(make: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        make()  # type: ignore[operator]
    assert message in str(err.value)
    assert "pw@" not in str(err.value)


def test_redact_hides_only_the_password() -> None:
    assert redact("postgresql://me:pw@db:5432/x?table=t") == "postgresql://me:***@db:5432/x?table=t"
    assert redact("nats://127.0.0.1:4222?stream=S") == "nats://127.0.0.1:4222?stream=S"
    # A port that is not a number is shown as written, not a ValueError.
    assert redact("postgresql://app:pw@127.0.0.1:abc/x") == "postgresql://app:***@127.0.0.1:abc/x"
    assert redact("nats://u:pw@[::1]:99999?s=1") == "nats://u:***@[::1]:99999?s=1"


@pytest.mark.parametrize(
    ("module", "uri", "flag", "extra"),
    [
        ("psycopg", "postgresql://u@h/db?table=t", "--output", "postgres"),
        ("psycopg", "postgresql://u@h/db?table=t", "--input", "postgres"),
        ("nats", "nats://h:4222?stream=S&subject=x", "--output", "nats"),
        ("nats", "nats://h:4222?stream=S&subject=x", "--input", "nats"),
    ],
)
def test_a_missing_extra_is_named_by_the_cli(
    tmp_path: Path, module: str, uri: str, flag: str, extra: str
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"key": "a", "i": 0}\n')
    other = str(src) if flag == "--output" else str(tmp_path / "out.jsonl")
    io = [flag, uri, "--input" if flag == "--output" else "--output", other]
    # The client library cannot be imported in this process, as on a machine without it.
    code = (
        f"import sys; sys.modules[{module!r}] = None; from ratchet.cli import main; "
        f"sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "run", AGENT, *io, "--state", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"needs the {extra} extra" in proc.stderr
    assert f"install it with: pip install 'ratchet[{extra}]'" in proc.stderr
    assert not (tmp_path / "s").exists()
