"""Latency of servers in pods: FastAPI on uvicorn, streaming, each in its own network namespace behind a veth pair
whose other end is in a "node" namespace (as a CNI lays pods out), reached from the node and from a client namespace
routed through it. Both pods serve port 8000 with different delays and are two tenants matched by their serving
process (match.process), attributed by the pod's address in every latency mode this kernel offers: counts exact,
TTFT quantiles within 10 % of the clients'. A keep-alive connection into a pod opened before the agent is adopted
(in sockops mode past the start's learning window, on the pod's cgroup linked at start);
the second pod appears after the agent started and is followed, then deleted and its entries removed.

The agent's latency capability runs in the test process, in the host's namespace: the pods are namespaces other than
its own, as on a node where the DaemonSet has hostNetwork.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import threading
from typing import Any, Iterator

import pytest

from qosagent.capability import AgentContext, State
from qosagent.config import UNMATCHED, Config, parse
from qosagent.features import ensure_mounted, probe
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.latency.capability import Latency
from qosagent.latency.model import LatencyPart, Plan
from tests.conftest import require
from tests.integration.latency_helpers import until
from tests.integration.netlab import Lab, sh
from tests.integration.test_latency_streaming import close_to, prefills
from tests.kernel_modes import latency_modes
from testkit.sse_client import RawClient, Timing, percentile
from testkit.sse_server import sse_server

pytestmark = [pytest.mark.privileged, pytest.mark.slow]

POD_A, POD_B, CLIENT = "198.18.1.1", "198.18.2.1", "198.18.3.1"
NODE_A, NODE_B, NODE_C = "198.18.1.254", "198.18.2.254", "198.18.3.254"
PORT = 8000
N = 12  # requests per client
KEEP_S = 600.0  # idle connections kept open this long, as for a gateway's pool
CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """This thread in network namespace ns for the block (sockets made there stay there), then back."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET):
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(target)
        os.close(own)


class Cluster:
    def __init__(self, lab: Lab, stack: contextlib.ExitStack):
        self.lab, self.stack = lab, stack
        self.node, self.cli = lab.netns("node"), lab.netns("cli")
        sh("ip", "netns", "exec", self.node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        lab.veth((self.node, "pc", f"{NODE_C}/24"), (self.cli, "eth0", f"{CLIENT}/24"))
        sh("ip", "-n", self.cli, "route", "add", "default", "via", NODE_C)
        self.clients: list[RawClient] = []

    def pod(self, role: str, dev: str, node_addr: str, pod_addr: str, prefill_ms: float) -> tuple[str, Any]:
        """A pod: its namespace, veth and route, and its server (whose command line names its address)."""
        ns = self.lab.netns(role)
        self.lab.veth((self.node, dev, f"{node_addr}/24"), (ns, "eth0", f"{pod_addr}/24"))
        sh("ip", "-n", ns, "route", "add", "default", "via", node_addr)
        return ns, self.serve(ns, pod_addr, PORT, prefill_ms)

    def serve(self, ns: str, addr: str, port: int, prefill_ms: float = 45.0) -> contextlib.ExitStack:
        srv = contextlib.ExitStack()
        srv.enter_context(sse_server("uvicorn", port=port, host=addr, prefill_ms=prefill_ms, keep_alive_s=KEEP_S,
                                     prefix=("nsenter", f"--net=/run/netns/{ns}")))
        self.stack.callback(srv.close)
        return srv

    def client(self, ns: str, host: str, port: int = PORT) -> RawClient:
        with inside(ns):
            c = RawClient(port, host=host)
        self.clients.append(c)
        return c


@pytest.fixture
def cluster(bpf: None) -> Iterator[Cluster]:
    require(all(shutil.which(t) for t in ("ip", "nsenter", "sysctl")), "ip, nsenter or sysctl missing")
    lab = Lab("latpods")
    with contextlib.ExitStack() as stack:
        stack.callback(lab.close)  # last: the namespaces go after their servers and clients
        c = Cluster(lab, stack)
        yield c
        for cl in c.clients:
            cl.close()


def config(mode: str, *ports: int) -> Config:
    return parse({"tenants": [
        {"name": "alpha", "tier": "gold", "match": {"process": rf"--host {POD_A.replace('.', '[.]')} ",
                                                    "ports": list(ports)}},
        {"name": "beta", "tier": "silver", "match": {"process": rf"--host {POD_B.replace('.', '[.]')} "}},
    ], "latency": {"mode": mode, "ports": list(ports), "runqueue": {"enabled": False}}}, "test")


def agent(mode: str) -> tuple[Latency, Plan]:
    fs = HostFS("/")
    ensure_mounted(fs)
    cap = Latency(AgentContext(config=config(mode, PORT), hostfs=fs, gpu=NoGpu("test")))
    verdict = cap.probe(probe(fs))
    assert verdict.state is State.ACTIVE and verdict.plan.egress, verdict.reason
    return cap, verdict.plan


def tick(cap: Latency) -> LatencyPart:
    cap.maintain()
    return cap.collect()


def stream(prefill_ms: float) -> dict[str, Any]:
    return {"stream": True, "prefill_ms": prefill_ms, "token_ms": 5.0, "tokens": 3}


def run(pairs: list[tuple[RawClient, list[float]]]) -> list[list[Timing]]:
    """Each client's requests, clients in parallel."""
    out: list[list[Timing]] = [[] for _ in pairs]
    ths = [threading.Thread(target=lambda c=c, ps=ps, o=o: o.extend(c.request(stream(p)) for p in ps), daemon=True)
           for (c, ps), o in zip(pairs, out)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    return out


def same_ttft(part: LatencyPart, name: str, timings: list[Timing]) -> None:
    t = part.tenants[name]
    client = [x.ttft for x in timings]
    for q in (0.5, 0.95):
        got = t.ttft.quantile(q)
        assert close_to(got, percentile(client, q)), (name, q, got, percentile(client, q))


def followed(part: LatencyPart) -> dict[str, list[str]]:
    return {tenant: n["addresses"] for n in part.namespaces for tenant in n["tenants"].values()}


@pytest.mark.parametrize("mode", latency_modes())
def test_pods_on_one_port_are_two_tenants_by_address_followed_as_they_come_and_go(cluster: Cluster,
                                                                                 mode: str) -> None:
    c = cluster
    pod_a, _ = c.pod("poda", "pa", NODE_A, POD_A, 30.0)
    # A gateway's connection into pod A, open and used before the agent starts.
    pooled = c.client(c.node, POD_A)
    pooled.request(stream(5.0))
    cap, plan = agent(mode)
    cap.start(plan)
    try:
        # sockops mode: from here only the programs on the serving cgroups see requests arrive, as LEARN_S after a
        # start; the pod's server listened before the agent, so its cgroup must have been linked at start.
        if cap.hooks.watch is not None:
            cap.hooks.watch.stop_learning()
        part = tick(cap)
        assert followed(part) == {"alpha": [POD_A]}, part.namespaces
        assert part.found_open == 1, part
        # pod A from the node (on the adopted connection and a new one) and from the client namespace.
        fresh_node, from_cli = c.client(c.node, POD_A), c.client(c.cli, POD_A)
        seen = run([(pooled, prefills(N, 1)), (fresh_node, prefills(N, 2)), (from_cli, prefills(N, 3))])
        alpha = [t for ts in seen for t in ts]
        part = until(lambda: tick(cap), lambda p: p.tenants["alpha"].ttft.count >= 3 * N)
        a = part.tenants["alpha"]
        assert (a.requests, a.ttft.count, a.connections, a.adopted) == (3 * N, 3 * N, 3, 1), a
        same_ttft(part, "alpha", alpha)
        assert part.tenants[UNMATCHED].requests == 0

        # Pod B, on the same port with slower first tokens, appears after the agent started: it is followed.
        _, server_b = c.pod("podb", "pb", NODE_B, POD_B, 90.0)
        part = until(lambda: tick(cap), lambda p: "beta" in followed(p))
        assert followed(part) == {"alpha": [POD_A], "beta": [POD_B]}, part.namespaces
        to_b = [c.client(ns, POD_B) for ns in (c.node, c.cli)]
        seen = run([(cl, [2 * p for p in prefills(N, 4 + i)]) for i, cl in enumerate(to_b)])
        beta = [t for ts in seen for t in ts]
        part = until(lambda: tick(cap), lambda p: p.tenants["beta"].ttft.count >= 2 * N)
        b = part.tenants["beta"]
        assert (b.requests, b.ttft.count, b.connections) == (2 * N, 2 * N, 2), b
        same_ttft(part, "beta", beta)
        assert part.tenants["alpha"].requests == 3 * N and part.tenants[UNMATCHED].requests == 0
        print(f"{mode}: alpha TTFT p50 {a.ttft.quantile(0.5) * 1e3:.1f} ms (client "
              f"{percentile([t.ttft for t in alpha], 0.5) * 1e3:.1f}), beta {b.ttft.quantile(0.5) * 1e3:.1f} ms "
              f"(client {percentile([t.ttft for t in beta], 0.5) * 1e3:.1f})")

        # Pod B deleted: its entries go with it, pod A's stay.
        for cl in to_b:
            cl.close()
        server_b.close()
        c.lab.delete("qa-" + c.lab.tag + "-podb")
        part = until(lambda: tick(cap), lambda p: "beta" not in followed(p))
        assert followed(part) == {"alpha": [POD_A]}, part.namespaces
        addrs = {bytes(k.addr)[12:] for k in cap.dp.map("lat_netns").keys()}
        assert addrs == {bytes([198, 18, 1, 1])}, addrs
        assert pod_a in c.lab.namespaces

        # A reload that watches a second port pod A serves: a connection open there before it is adopted, alpha's.
        c.serve(pod_a, POD_A, PORT + 100)
        early = c.client(c.cli, POD_A, PORT + 100)
        early.request(stream(5.0))
        new = config(mode, PORT, PORT + 100)
        cap.prepare(new).commit()
        cap.ctx.config = new  # as the daemon does once every capability committed
        assert tick(cap).found_open == 2
        late = run([(early, prefills(N, 7))])[0]
        part = until(lambda: tick(cap), lambda p: p.tenants["alpha"].ttft.count >= 4 * N)
        a = part.tenants["alpha"]
        assert (a.requests, a.connections, a.adopted) == (4 * N, 4, 2), a
        assert part.tenants[UNMATCHED].requests == 0
        assert a.ttft.count == 4 * N and len(late) == N
    finally:
        cap.stop()
