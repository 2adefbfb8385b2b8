"""The latency program's socket table (arrays, four slots per bucket): a connection with no free slot is counted as
untracked, not lost silently, and a closed connection gives its slot back. One bucket (latency.socket_slots: 4)
makes every connection land in the same four slots."""

from __future__ import annotations

import socket
from typing import Iterator

import pytest

from qosagent.capability import AgentContext, State
from qosagent.config import parse
from qosagent.features import probe
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.latency.capability import Latency
from tests.integration.latency_helpers import free_port, until


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def latency(bpf: None, port: int) -> Iterator[Latency]:
    from qosagent import features

    fs = HostFS("/")
    features.ensure_mounted(fs)
    cfg = parse({"tenants": [{"name": "t", "tier": "gold", "match": {"ports": [port]}}],
                 "latency": {"mode": "tracepoint", "ports": [port], "socket_slots": 4,
                             "runqueue": {"enabled": False}}}, "test")
    cap = Latency(AgentContext(config=cfg, hostfs=fs, gpu=NoGpu("test")))
    verdict = cap.probe(probe(fs))
    assert verdict.state is State.ACTIVE
    cap.start(verdict.plan)
    try:
        yield cap
    finally:
        cap.stop()


def connect(port: int, n: int) -> list[socket.socket]:
    """n connections to a listener that never accepts: the server side is ESTABLISHED when the handshake ends."""
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


@pytest.mark.privileged
def test_a_full_bucket_counts_connections_as_untracked_and_a_close_frees_slots(latency: Latency, port: int) -> None:
    listener = socket.create_server(("127.0.0.1", port), backlog=16)
    clients = connect(port, 6)
    t = until(lambda: latency.collect().tenants["t"], lambda t: t.connections >= 4)
    assert (t.connections, t.untracked) == (4, 2)
    for c in clients:
        c.close()
    listener.close()  # the never-accepted server sockets are reset: their CLOSE frees the four slots

    listener = socket.create_server(("127.0.0.1", port), backlog=16)
    try:
        clients = connect(port, 4)
        t = until(lambda: latency.collect().tenants["t"], lambda t: t.connections >= 8)
        assert (t.connections, t.untracked) == (8, 2)
    finally:
        for c in clients:
            c.close()
        listener.close()
