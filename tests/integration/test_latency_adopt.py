"""Connections open before the agent: a gateway keeps a pool of keep-alive connections to an inference server for
hours, across agent starts, restarts and upgrades. Each connection found open on a watched port is observed from its
next request, its tenant resolved by the same rules (here the client's network: clients bound to 127.0.0.2 and
127.0.0.3), in every latency mode this kernel offers; what is not observed is reported by reason.

The server is FastAPI on uvicorn streaming Server-Sent Events, in its own process (testkit/sse_server.py);
the clients are raw keep-alive connections (h11), each timing what it saw. Runs as root with BPF.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Iterator

import pytest

from qosagent.capability import AgentContext, State
from qosagent.config import parse
from qosagent.features import ensure_mounted, probe
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.latency import adopt
from qosagent.latency.adopt import RELIST_S
from qosagent.latency.capability import Latency
from qosagent.latency.model import LatencyPart, Plan, TenantLatency
from tests.integration.latency_helpers import free_port, until
from testkit.sse_client import RawClient, Timing, percentile
from testkit.sse_server import sse_server
from tests.integration.test_latency_streaming import close_to, prefills
from tests.kernel_modes import latency_modes

N = 20  # requests per connection
KEEP_S = 600.0  # the server keeps idle connections this long, as for a gateway's pool (uvicorn's default is 5 s)
NET2, NET3 = "127.0.0.2", "127.0.0.3"


def tenants(port: int, extra_port: int | None = None) -> list[dict[str, Any]]:
    out = [{"name": "net2", "tier": "gold", "match": {"cidrs": [f"{NET2}/32"]}},
           {"name": "net3", "tier": "silver", "match": {"cidrs": [f"{NET3}/32"]}}]
    if extra_port:  # NET3 on that port alone: a port and network rule, more specific than net3's
        out.append({"name": "edge", "tier": "bronze", "match": {"ports": [extra_port], "cidrs": [f"{NET3}/32"]}})
    return out


def agent(mode: str, port: int, extra_port: int | None = None) -> tuple[Latency, Plan]:
    fs = HostFS("/")
    ensure_mounted(fs)
    cfg = parse({"tenants": tenants(port, extra_port),
                 "latency": {"mode": mode, "ports": [port], "runqueue": {"enabled": False}}}, "test")
    cap = Latency(AgentContext(config=cfg, hostfs=fs, gpu=NoGpu("test")))
    verdict = cap.probe(probe(fs))
    assert verdict.state is State.ACTIVE and verdict.plan.egress, verdict.reason
    return cap, verdict.plan


@pytest.fixture(params=latency_modes())
def mode(request: pytest.FixtureRequest, bpf: None) -> str:
    return request.param


@pytest.fixture
def connections() -> Iterator[list[RawClient]]:
    """Client connections the test opens; closed at the end, even when it fails."""
    opened: list[RawClient] = []
    yield opened
    for c in opened:
        c.close()


def stream(prefill_ms: float) -> dict[str, Any]:
    return {"stream": True, "prefill_ms": prefill_ms, "token_ms": 5.0, "tokens": 3}


def serve(c: RawClient, bodies: list[dict[str, Any]], out: list[Timing]) -> threading.Thread:
    th = threading.Thread(target=lambda: out.extend(c.request(b) for b in bodies), daemon=True)
    th.start()
    return th


def tick(cap: Latency) -> LatencyPart:
    """What the daemon does with the capability each tick: its periodic upkeep (adoption's among it), then a read."""
    cap.maintain()
    return cap.collect()


def settled(cap: Latency, want: dict[str, int]) -> LatencyPart:
    def done(p: LatencyPart) -> bool:
        return all(p.tenants[name].ttft.count >= n and p.tenants[name].requests >= n for name, n in want.items())

    return until(lambda: tick(cap), done)


def same_ttft(t: TenantLatency, timings: list[Timing]) -> None:
    client = [x.ttft for x in timings]
    for q in (0.5, 0.95):
        assert close_to(t.ttft.quantile(q), percentile(client, q)), (t.tenant, q, t.ttft.quantile(q),
                                                                     percentile(client, q))


@pytest.mark.privileged
@pytest.mark.slow
def test_keepalive_connections_open_before_the_agent_are_timed_from_their_next_request_by_client_network(
        mode: str, connections: list[RawClient]) -> None:
    port = free_port()
    with sse_server("uvicorn", port=port, keep_alive_s=KEEP_S):
        # A gateway's pool: connections that have served before the agent starts, and one that stays idle.
        a, b, idle = (RawClient(port, source=src) for src in (NET2, NET3, NET2))
        connections += [a, b, idle]
        for c in (a, b):
            c.request(stream(10.0))
        cap, plan = agent(mode, port)
        cap.start(plan)
        try:
            part = cap.collect()
            assert (part.found_open, part.unobserved[adopt.AWAITING]) == (3, 3), part
            seen: dict[str, list[Timing]] = {"a": [], "b": [], "new": []}
            ths = [serve(a, [stream(p) for p in prefills(N, 1)], seen["a"]),
                   serve(b, [stream(p) for p in prefills(N, 2)], seen["b"])]
            for th in ths:
                th.join(60)
            new = RawClient(port, source=NET2)  # opened after the agent: hooked at its establishment
            connections.append(new)
            seen["new"] = [new.request(stream(p)) for p in prefills(N, 3)]
            part = settled(cap, {"net2": 2 * N, "net3": N})
            net2, net3 = part.tenants["net2"], part.tenants["net3"]
            # Counts exact: every request on the adopted connections, none of another tenant's.
            assert (net2.requests, net2.ttft.count, net2.connections, net2.adopted, net2.unpaired) == (2 * N, 2 * N,
                                                                                                      2, 1, 0), net2
            assert (net3.requests, net3.ttft.count, net3.connections, net3.adopted, net3.unpaired) == (N, N, 1, 1, 0)
            assert "unmatched" not in part.tenants or part.tenants["unmatched"].requests == 0
            same_ttft(net2, seen["a"] + seen["new"])
            same_ttft(net3, seen["b"])
            # Those adopted are forgotten at the next check (once a second); the idle one still waits.
            part = until(lambda: tick(cap), lambda p: p.unobserved[adopt.AWAITING] == 1, timeout=3)
            assert part.unobserved == {adopt.AWAITING: 1, adopt.NOT_HOOKED: 0, adopt.NO_ROOM: 0}, part.unobserved
            # The idle one closes before it asks anything: it is forgotten, not adopted.
            idle.close()
            part = until(lambda: tick(cap), lambda p: not p.unobserved[adopt.AWAITING],
                         timeout=2 * RELIST_S)
            assert part.unobserved[adopt.AWAITING] == 0 and part.found_open == 3
            assert part.tenants["net2"].adopted == 1
            st = cap.status(_snapshot(part))
            assert st["found_open"] == 3 and {t["tenant"]: t["adopted"] for t in st["tenants"]}["net3"] == 1
            assert "3 found, 2 observed since their next request" in cap.render(st)
            text = _scrape(cap, part)
            assert 'qosagent_latency_connections_adopted_total{tenant="net2",tier="gold"} 1.0' in text
            assert 'qosagent_latency_connections_unobserved{reason="awaiting_request"} 0.0' in text
        finally:
            cap.stop()


@pytest.mark.privileged
@pytest.mark.slow
def test_a_restart_under_load_times_every_request_that_began_after_the_new_agent_listed(
        mode: str, connections: list[RawClient], monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    with sse_server("uvicorn", port=port, keep_alive_s=KEEP_S):
        pool = [RawClient(port, source=src) for src in (NET2, NET3)]  # open before the first agent
        connections += pool
        first, plan = agent(mode, port)
        first.start(plan)
        try:
            pool.append(RawClient(port, source=NET2))  # established under the first agent, hooked by it
            connections.append(pool[-1])
            stop = threading.Event()
            seen: list[list[Timing]] = [[] for _ in pool]

            def load(i: int) -> None:
                # Prefills around 90 ms: three client threads share the GIL and two busy CPUs, and a client's clock
                # runs late by what its thread waits; the 10 % bound must hold for what the client saw.
                bodies = [stream(2 * p) for p in prefills(400, 10 + i)]
                while not stop.is_set():
                    seen[i].append(pool[i].request(bodies[len(seen[i]) % len(bodies)]))

            ths = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(len(pool))]
            for th in ths:
                th.start()
            until(lambda: tick(first), lambda p: p.tenants["net2"].requests >= 6)
        finally:
            first.stop()  # an upgrade: the old agent is gone, the load goes on
        # When the new agent lists the open connections, and when it has handed them to the kernel: a request that
        # began after that is observed; one in between may be (its segment may have come after the hand-over).
        marks: dict[str, float] = {}
        listing, adding = adopt.established, adopt.Adoption.add

        def established(*args: Any, **kwargs: Any) -> Any:
            marks.setdefault("listed", time.perf_counter())
            return listing(*args, **kwargs)

        def add(self: adopt.Adoption, *args: Any) -> int:
            n = adding(self, *args)
            marks.setdefault("written", time.perf_counter())
            return n

        monkeypatch.setattr(adopt, "established", established)
        monkeypatch.setattr(adopt.Adoption, "add", add)
        second, plan = agent(mode, port)
        second.start(plan)
        try:
            time.sleep(3.0)
            stop.set()
            for th in ths:
                th.join(30)
            after = [[t for t in s if t.start > marks["written"]] for s in seen]
            between = [[t for t in s if marks["listed"] <= t.start <= marks["written"]] for s in seen]
            nets = {"net2": (0, 2), "net3": (1,)}
            want = {name: sum(len(after[i]) for i in idx) for name, idx in nets.items()}
            part = settled(second, want)
            for name, idx in nets.items():
                t = part.tenants[name]
                lo, slack = want[name], sum(len(between[i]) for i in idx)
                assert lo <= t.requests <= lo + slack and t.ttft.count == t.requests, (name, t, lo, slack)
                assert (t.connections, t.adopted, t.unpaired) == (len(idx), len(idx), 0), t
                same_ttft(t, [x for i in idx for x in after[i]])
            assert part.found_open == 3 and not any(part.unobserved.values()), part
        finally:
            second.stop()


@pytest.mark.privileged
@pytest.mark.slow
def test_a_reload_that_watches_a_port_adopts_its_open_connections_by_port_and_network(
        mode: str, connections: list[RawClient]) -> None:
    port, later = free_port(), free_port()
    with sse_server("uvicorn", port=port, keep_alive_s=KEEP_S), sse_server("uvicorn", port=later, keep_alive_s=KEEP_S):
        cap, plan = agent(mode, port)
        cap.start(plan)
        try:
            c2, c3 = RawClient(later, source=NET2), RawClient(later, source=NET3)
            connections += [c2, c3]
            c2.request(stream(10.0))
            c3.request(stream(10.0))  # not watched yet: nobody counts these
            new = parse({"tenants": tenants(port, later),
                         "latency": {"mode": mode, "ports": [port], "runqueue": {"enabled": False}}}, "test")
            cap.prepare(new).commit()
            cap.ctx.config = new
            assert cap.collect().found_open == 2
            s2 = [c2.request(stream(p)) for p in prefills(5, 4)]
            s3 = [c3.request(stream(p)) for p in prefills(5, 5)]
            part = settled(cap, {"net2": 5, "edge": 5})
            # NET3 on the newly watched port is edge's (port and network), NET2 anywhere is net2's.
            got = {n: (t.requests, t.adopted) for n, t in part.tenants.items() if t.requests or t.adopted}
            assert got == {"net2": (5, 1), "edge": (5, 1)}, got
            same_ttft(part.tenants["net2"], s2)
            same_ttft(part.tenants["edge"], s3)
        finally:
            cap.stop()


def _snapshot(part: LatencyPart) -> Any:
    class One:
        def part(self, _name: str) -> LatencyPart:
            return part

    return One()


def _scrape(cap: Latency, part: LatencyPart) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    class Collector:
        def collect(self) -> Any:
            return cap.metrics(_snapshot(part))

    reg = CollectorRegistry()
    reg.register(Collector())
    return generate_latest(reg).decode()


def test_sock_diag_and_proc_net_tcp_find_the_same_connections() -> None:
    """The two ways open connections are listed agree, on real sockets (no BPF: nothing to lock)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port), source_address=(src, 0)) for src in (NET2, NET3)]
    accepted = [srv.accept()[0] for _ in clients]
    try:
        diag = adopt.established(HostFS("/"), {port}, cgroups=True)
        proc = adopt.established(HostFS("/"), {port})
        assert {c.key for c in diag} == {c.key for c in proc} and len(proc) == 2
        assert {c.remote for c in diag} == {adopt.mapped(NET2), adopt.mapped(NET3)}
        assert all(c.cgroup_id for c in diag)  # sock_diag names each socket's cgroup, for linking it
    finally:
        for s in clients + accepted + [srv]:
            s.close()
