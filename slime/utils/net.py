"""Network helpers shared by the processes that listen: ports come from the OS, never constants."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port free on `host` now (the caller's server binds it moments later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
