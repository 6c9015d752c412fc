"""Free TCP ports for servers and process groups started later (a child process, vLLM, gloo).

Layer L0: standard library only.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_PORTS_HANDED_OUT: set[int] = set()
_PORT_RNG = random.SystemRandom()  # not reseeded by tests that seed ``random``


def _ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing and port-0 sockets (Linux default 32768-60999)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _non_ephemeral_ports() -> tuple[int, int]:
    """``[low, high)``: the wider of the gaps below (from 20000, clear of well-known service ports)
    and above the ephemeral range."""
    low_ephemeral, high_ephemeral = _ephemeral_port_range()
    below, above = (20000, low_ephemeral), (high_ephemeral + 1, 65536)
    low, high = max(below, above, key=lambda gap: gap[1] - gap[0])
    if high - low < 100:
        raise RuntimeError(f"ephemeral port range {low_ephemeral}-{high_ephemeral} leaves no ports for "
                           "servers; narrow net.ipv4.ip_local_port_range")
    return low, high


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, for a child process to bind later.

    Binding port 0 would hand out an *ephemeral* port, and between closing it here and the child
    binding it the kernel may give that same port to any outgoing connection (gloo's own pair
    sockets, the rendezvous client): the child then fails with "address already in use". So pick
    at random outside the ephemeral range, where the kernel never assigns ports on its own, check
    the port binds, and never hand the same one out twice in this process.
    """
    low, high = _non_ephemeral_ports()
    for _ in range(200):
        port = _PORT_RNG.randrange(low, high)
        if port in _PORTS_HANDED_OUT:
            continue
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port in [{low}, {high}) after 200 tries")
