"""Free ports for the servers and process groups that multi-process runs and tests start."""

import socket

from grpo_lightning.utils.ports import _ephemeral_port_range, free_port


def test_free_port_is_outside_the_ephemeral_range_distinct_and_bindable():
    """A port-0 port is ephemeral and may be reassigned before a child binds it: free_port avoids them."""
    low_ephemeral, high_ephemeral = _ephemeral_port_range()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert all(not low_ephemeral <= port <= high_ephemeral for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))


def test_vllm_master_port_falls_back_to_a_non_ephemeral_port():
    from grpo_lightning.samplers import vllm_launch

    held = []
    for port in vllm_launch.MASTER_PORTS:  # occupy the conventional ports
        sock = socket.socket()
        try:
            sock.bind(("localhost", port))
        except OSError:
            sock.close()
            continue
        held.append(sock)
    try:
        port = vllm_launch.free_master_port()
    finally:
        for sock in held:
            sock.close()
    low_ephemeral, high_ephemeral = _ephemeral_port_range()
    assert port not in vllm_launch.MASTER_PORTS and not low_ephemeral <= port <= high_ephemeral
