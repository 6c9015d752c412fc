"""The shared test helpers the multi-process tests rely on."""

import socket

from tests.helpers import _ephemeral_port_range, free_port


def test_free_port_is_outside_the_ephemeral_range_distinct_and_bindable():
    """A port-0 port is ephemeral and may be reassigned before a child binds it: free_port avoids them."""
    low_ephemeral, high_ephemeral = _ephemeral_port_range()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert all(not low_ephemeral <= port <= high_ephemeral for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
