"""Port selection for a job's scheduler."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (the scheduler binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
