"""The one free-port helper, shared by the demo's torchrun launch and the dashboard server."""

from __future__ import annotations

import socket

import dynascope.dashboard.serve as server
import dynascope.demo as demo
from dynascope.core.net import free_port


def test_free_port_is_bindable_and_shared():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free a moment ago, so binding it now succeeds
    assert 1024 <= port <= 65535
    assert server.free_port is free_port and demo.free_port is free_port
    assert not hasattr(demo, "_free_port")
