"""Shared helpers of the SDK adapters."""

from __future__ import annotations

import json
import os
from typing import Any

from ratchet._errors import ConfigError


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
