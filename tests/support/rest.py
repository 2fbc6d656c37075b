"""A free loopback port and a JSON GET, for tests that talk to a supervised job's REST API."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> Any:
    """GET `path` on 127.0.0.1:`port`, asserting a 200, its body as JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, (path, resp.status, body)
    return json.loads(body)
