"""The environment a supervisor hands its worker, by name only.

A worker (`ratchet run` under `--supervise`) reads these at start-up; keeping them here lets
it do so without importing the supervisor, which an unsupervised run never needs.
"""

STATUS_FD_ENV = "RATCHET_STATUS_FD"
RESOURCE_ID_ENV = "RATCHET_RESOURCE_ID"
SUPERVISOR_PID_ENV = "RATCHET_SUPERVISOR_PID"
REST_TOKEN_ENV = "RATCHET_REST_TOKEN"


def token_problem(token: str) -> str | None:
    """Why `token` cannot be a bearer token, or None. HTTP headers carry Latin-1 text, so a
    token with a character outside printable ASCII (or with a space) could never be sent and
    compared as it was given: it is refused where it is given, not at every request."""
    if not token.strip():
        return "must not be empty"
    bad = sorted({c for c in token if not "!" <= c <= "~"})
    if bad:
        return (
            f"holds {', '.join(repr(c) for c in bad[:5])}: use printable ASCII without spaces "
            f"(letters, digits, -._~+/=), e.g. the output of `openssl rand -hex 32`"
        )
    return None
