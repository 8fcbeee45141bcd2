"""Networking helpers shared by the demo (torchrun's rendezvous port) and the dashboard server."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it; another process may still take
    it before the caller binds, which is why callers start their server right away)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
