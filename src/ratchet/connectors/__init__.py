"""Sources and sinks beyond JSON Lines files, chosen by the URI given to --input / --output.

    http://HOST:PORT                              an ingestion endpoint (POST /v1/events)
    postgresql://USER@HOST:PORT/DB?table=NAME     rows of a table / a table of outputs
    nats://HOST:PORT?stream=S&subject=SUBJ        a JetStream stream (durable pull consumer)

Each connector lives in its own module and imports its client library only when it is used,
so a missing extra is reported by name (`pip install 'ratchet[postgres]'`), never as an
ImportError. The interface they implement is `ratchet.runtime._io.Source` / `Sink`; see
docs/connectors.md.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from ratchet._errors import ConfigError
from ratchet.runtime._io import Sink, Source

SCHEMES = ("http", "postgresql", "postgres", "nats")


def is_uri(text: Any) -> bool:
    """Whether an --input/--output value is a connector URI rather than a path."""
    if not isinstance(text, str) or "://" not in text:
        return False
    scheme = text.split("://", 1)[0]
    # RFC 3986: a letter, then letters, digits, "+", "-" or "." (s3://, git+ssh://); one
    # letter alone is a drive letter, not a scheme.
    return (
        len(scheme) > 1
        and scheme.isascii()
        and scheme[0].isalpha()
        and all(c.isalnum() or c in "+-." for c in scheme)
    )


def redact(uri: str) -> str:
    """`uri` with its password replaced by `***`, for messages and logs."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    # The host and port as written: parts.port raises on a port that is not a number.
    host = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def query_of(uri: str, flag: str, known: frozenset[str]) -> dict[str, str]:
    """The query parameters of `uri`; one ratchet does not know is refused by name."""
    params = dict(parse_qsl(urlsplit(uri).query, keep_blank_values=True))
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(
            f"{flag} {redact(uri)}: unknown parameter(s) {', '.join(unknown)}; this connector "
            f"takes {', '.join(sorted(known))}"
        )
    return params


def _scheme(uri: str, flag: str) -> str:
    scheme = uri.split("://", 1)[0].lower()
    if scheme == "https":
        raise ConfigError(
            f"{flag} {redact(uri)}: the ingestion endpoint speaks plain HTTP; put TLS in a "
            f"reverse proxy in front of it and pass --input http://127.0.0.1:PORT"
        )
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{flag} {redact(uri)}: unknown connector {scheme!r}; ratchet takes a JSON Lines "
            f"path, http://HOST:PORT (input only), postgresql://...?table=NAME or "
            f"nats://HOST:PORT?stream=NAME&subject=SUBJECT"
        )
    return scheme


def missing_extra(flag: str, uri: str, extra: str, module: str, exc: ImportError) -> ConfigError:
    """The error for a connector whose client library is not installed."""
    return ConfigError(
        f"{flag} {redact(uri)} needs the {extra} extra ({module} is not installed: {exc}); "
        f"install it with: pip install 'ratchet[{extra}]'"
    )


def replays_in_order(inputs: Any) -> bool:
    """Whether reading an input again from a checkpointed position gives the same inputs in
    the same order, which `--workers N`'s coordinator needs (it numbers inputs in the order it
    reads them). NATS does not: the messages not yet acknowledged at a crash come back after
    their ack-wait, in another order and among new ones."""
    if isinstance(inputs, Source):
        return bool(getattr(inputs, "replays_in_order", True))
    return not (is_uri(inputs) and inputs.split("://", 1)[0].lower() == "nats")


def source_for(uri: str, *, key: str, follow: bool) -> Source:
    """The source an --input URI names (its client library imported now)."""
    scheme = _scheme(uri, "--input")
    if scheme == "http":
        from ratchet.connectors._http import HttpSource

        return HttpSource.from_uri(uri, key_field=key)
    if scheme in ("postgresql", "postgres"):
        from ratchet.connectors._postgres import PostgresSource

        return PostgresSource.from_uri(uri, key_field=key, follow=follow)
    from ratchet.connectors._nats import NatsSource

    return NatsSource.from_uri(uri, key_field=key, follow=follow)


def sink_for(uri: str, *, append: bool) -> Sink:
    """The sink an --output URI names."""
    scheme = _scheme(uri, "--output")
    if append:
        raise ConfigError(
            f"--append-output applies to a JSON Lines --output file, not {redact(uri)}: write "
            f"another job's outputs to another table or stream"
        )
    if scheme == "http":
        raise ConfigError(
            f"--output {redact(uri)}: http:// is an input (an ingestion endpoint); write outputs "
            f"to a JSON Lines file, postgresql://...?table=NAME or nats://...?stream=&subject="
        )
    if scheme in ("postgresql", "postgres"):
        from ratchet.connectors._postgres import PostgresSink

        return PostgresSink.from_uri(uri)
    from ratchet.connectors._nats import NatsSink

    return NatsSink.from_uri(uri)


__all__ = ["is_uri", "redact", "sink_for", "source_for"]
