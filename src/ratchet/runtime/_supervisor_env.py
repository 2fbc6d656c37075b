"""The environment a supervisor hands its worker, by name only.

A worker (`ratchet run` under `--supervise`) reads these at start-up; keeping them here lets
it do so without importing the supervisor, which an unsupervised run never needs.
"""

STATUS_FD_ENV = "RATCHET_STATUS_FD"
RESOURCE_ID_ENV = "RATCHET_RESOURCE_ID"
SUPERVISOR_PID_ENV = "RATCHET_SUPERVISOR_PID"
REST_TOKEN_ENV = "RATCHET_REST_TOKEN"
# The one line a worker writes to its status pipe instead of a report when it was refused the
# state's lock (`{"state_in_use_by": "pid 123"}`, then exit 2): the supervisor restarts it.
REFUSED_STATE_IN_USE = "state_in_use_by"
# Likewise when a connector's server could not be reached at start (`{"unreachable":
# "PostgreSQL at db:5432"}`, then exit 2): the supervisor restarts it, with a growing delay.
REFUSED_UNREACHABLE = "unreachable"


def check_token(token: str) -> None:
    """Refuse what cannot be a bearer token (ConfigError). HTTP headers carry Latin-1 text, so a
    token with a character outside printable ASCII (or with a space) could never be sent and
    compared as it was given: it is refused where it is given, not at every request."""
    from ratchet._errors import ConfigError

    if not token.strip():
        raise ConfigError(f"--rest-token (or {REST_TOKEN_ENV}) must not be empty")
    bad = sorted({c for c in token if not "!" <= c <= "~"})
    if bad:
        raise ConfigError(
            f"--rest-token (or {REST_TOKEN_ENV}) holds {', '.join(repr(c) for c in bad[:5])}: "
            f"use printable ASCII without spaces (letters, digits, -._~+/=), e.g. the output "
            f"of `openssl rand -hex 32`"
        )
