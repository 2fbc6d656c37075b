"""Reading a JSON Lines file another process is still writing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def whole_lines(path: Path) -> list[dict[str, Any]]:
    """Every complete record of `path` (a line cut by a kill, or still being written, has no
    closing brace yet and is left out); none if the file does not exist."""
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
