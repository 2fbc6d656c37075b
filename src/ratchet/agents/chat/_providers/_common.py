"""Shared helpers of the SDK adapters."""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import ValidationError

from ratchet._errors import ConfigError
from ratchet.agents.chat._errors import ModelCallError
from ratchet.agents.chat._tools import format_validation_error


def require_sdk(module: str, extra: str) -> Any:
    try:
        return __import__(module)
    except ImportError as exc:
        raise ConfigError(
            f"the {module!r} package is not installed; install ratchet with the {extra!r} "
            f"extra: pip install 'ratchet[{extra}]'"
        ) from exc


def require_key(api_key: str | None, env: str, cls_name: str) -> str:
    key = api_key if api_key is not None else os.environ.get(env)
    if not key:
        raise ConfigError(
            f"{cls_name} needs an API key: set the {env} environment variable or pass api_key=... "
            f"(for a local server that needs none, pass api_key='none')"
        )
    return key


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: fall back to the policy's own backoff


def loads_arguments(raw: Any) -> tuple[dict[str, Any], str | None]:
    """(arguments, error) from a provider's tool-call arguments (a JSON string or a dict)."""
    if isinstance(raw, dict):
        return raw, None
    if raw is None or raw == "":
        return {}, None
    try:
        value = json.loads(raw)
    except (TypeError, ValueError) as exc:
        return {}, f"arguments are not valid JSON ({exc}): {str(raw)[:200]}"
    if not isinstance(value, dict):
        return {}, f"arguments must be a JSON object, got {type(value).__name__}"
    return value, None


def sdk_error(
    sdk: Any, provider: str, exc: Exception, transient_statuses: tuple[int, ...] = (408, 409, 429)
) -> ModelCallError:
    """Map an exception of a Stainless-generated SDK (openai, anthropic share the classes'
    names and shapes) to a ModelCallError: timeouts, connection errors and 5xx are transient."""
    if isinstance(exc, sdk.APITimeoutError):
        return ModelCallError(
            f"{provider}: request timed out: {exc}", provider=provider, transient=True
        )
    if isinstance(exc, sdk.APIConnectionError):
        return ModelCallError(
            f"{provider}: connection failed: {exc}", provider=provider, transient=True
        )
    if isinstance(exc, sdk.APIStatusError):
        status = exc.status_code
        return ModelCallError(
            f"{provider}: HTTP {status}: {exc.message}",
            provider=provider,
            status=status,
            transient=status in transient_statuses or status >= 500,
            retry_after=parse_retry_after(exc.response.headers.get("retry-after")),
        )
    return malformed(provider, exc)


def malformed(provider: str, exc: Exception) -> ModelCallError:
    """A reply ratchet cannot read; a pydantic error in one line, without its doc links."""
    detail = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
    return ModelCallError(
        f"{provider}: malformed response ({type(exc).__name__}: {detail})", provider=provider
    )
