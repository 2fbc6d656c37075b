"""Logging set-up for the command line, imported only by the commands that log."""

from __future__ import annotations

import logging

__all__ = ["JsonLogFormatter", "configure_logging"]


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: time (ISO, UTC), level, logger, message, and the error."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime
        import json

        line: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(verbose: bool, fmt: str) -> None:
    """One handler on the root logger: text or JSON lines, INFO with -v, else WARNING."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
