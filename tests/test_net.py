import socket

from rlpipe.net import _ephemeral_range, free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    """Outgoing connections take ephemeral ports: a chosen port from that range could be gone before the server binds it."""
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(not lo <= p <= hi for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free when handed out
