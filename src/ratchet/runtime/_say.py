"""What a command says about its own course (a REST address, a worker's restart, a savepoint
restored, the workers `auto` chose): shown without -v, as `ratchet: MESSAGE` on stderr, or
with --log-format json as a log record the JSON formatter writes (a plain line among JSON
lines breaks a log shipper)."""

from __future__ import annotations

import logging
import sys


def say(logger: logging.Logger, message: str, log_format: str, level: int = logging.INFO) -> None:
    if log_format == "json":
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)  # shown without -v, as the text line is
        logger.log(level, message)
    else:
        print(f"ratchet: {message}", file=sys.stderr)
