"""Network helpers shared by the processes that listen: ports come from the OS, never constants."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port free on `host` now (the caller's server binds it moments later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_port(url: str) -> tuple[str, int]:
    """(host, port) of `http://host:port/...` or `host:port` (an IPv6 host keeps its brackets; no
    port: the scheme's default)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url if "//" in url else f"http://{url}")
    host = parts.netloc.rpartition("@")[2]
    if parts.port is not None:
        host = host.rpartition(":")[0]
    return host, parts.port or (443 if parts.scheme == "https" else 80)
