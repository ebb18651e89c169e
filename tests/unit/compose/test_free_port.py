"""compose/launcher.py free_port(): a port outside the kernel's ephemeral range (where the
stack's own connections and port-0 binds draw theirs), free to bind."""

import socket
from pathlib import Path

import pytest

from compose.launcher import free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE.exists(), reason="Linux's ephemeral port range")
def test_a_free_port_is_outside_the_ephemeral_range_and_binds():
    low, high = map(int, RANGE.read_text().split())
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high, (port, low, high)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
