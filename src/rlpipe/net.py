"""Ports for the servers rlpipe starts on 127.0.0.1.

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the same range it uses
for outgoing connections: between choosing it and the server binding it, any outgoing connection
(a gRPC client inside SeaweedFS, an HTTP pool) may take it, and the server dies with "address
already in use". ``free_port`` chooses below that range instead, where only listeners live.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free on 127.0.0.1, outside the ephemeral range, not handed out before by this process."""
    lo, _ = _ephemeral_range()
    low = 10000 if lo > 12000 else 1025
    for _ in range(200):
        port = random.SystemRandom().randrange(low, lo)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # a crowded machine: fall back to the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
