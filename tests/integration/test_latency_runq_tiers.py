"""Run-queue latency by tier, for real: the sched probes count each serving process's threads in the row of the tier
it serves, and a process serving two tiers in the shared row, never in one tier's (bpf/latency_runq.c,
bpf/include/lat_state.h's lat_note_process, qosagent/latency/runq.py).

Five server processes, each one thread blocked in select() between connections (nothing wakes them but a client):
A serves gold's port, B bronze's, E two gold tenants' ports (one tier: still gold's), C a gold and a bronze tenant's,
D a port whose gold tenant is its clients' network (127.0.0.4), first reached by an unmatched client (a probe's or a
scrape's: unmatched traffic is no tier's, so D still waits in gold's row).
Each phase sends connections to one process and reads which rows moved. Runs as root with BPF (CI=true makes a
missing capability a failure), in every latency mode the kernel offers: each notes the serving process from another
hook (sockops: the sendmsg callback; tracepoint and kprobe: the read)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any, Iterator

import pytest

from qosagent.capability import AgentContext, State
from qosagent.config import parse
from qosagent.features import ensure_mounted, probe
from qosagent.gpu.backend import NoGpu
from qosagent.hostfs import HostFS
from qosagent.latency import bpfmaps as bm
from qosagent.latency.capability import Latency
from qosagent.latency.model import SHARED_TIER, LatencyPart
from tests.integration.latency_helpers import free_port, until
from tests.kernel_modes import latency_modes
from testkit.agent import TIME_SCALE

# One thread, one select() over its listening sockets: each connection is read to its blank line, answered, closed.
SERVER = """
import selectors, socket, sys
sel = selectors.DefaultSelector()
for port in sys.argv[1:]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(port)))
    s.listen(64)
    sel.register(s, selectors.EVENT_READ)
print("listening", flush=True)
while True:
    for key, _ in sel.select():
        conn, _ = key.fileobj.accept()
        buf = b""
        while b"\\r\\n\\r\\n" not in buf:
            chunk = conn.recv(4096)
            if not chunk:
                break
            buf += chunk
        conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 3\\r\\nConnection: close\\r\\n\\r\\nok\\n")
        conn.close()
"""


GOLD_NET = "127.0.0.4"  # gold-d's clients; the others connect from 127.0.0.1, matched by no tenant on D's port


def request(port: int, src: str = "127.0.0.1") -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(src, 0)) as c:
        c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        while c.recv(4096):
            pass


class Lab:
    def __init__(self) -> None:
        self.ports = {name: free_port() for name in ("a", "b", "c_gold", "c_bronze", "e_one", "e_two", "d")}
        self.procs: list[subprocess.Popen[bytes]] = []

    def config(self, mode: str) -> Any:
        p = self.ports
        tenants = [("gold-a", "gold", p["a"]), ("bronze-b", "bronze", p["b"]), ("gold-c", "gold", p["c_gold"]),
                   ("bronze-c", "bronze", p["c_bronze"]), ("gold-e1", "gold", p["e_one"]),
                   ("gold-e2", "gold", p["e_two"])]
        by_net = {"name": "gold-d", "tier": "gold", "match": {"cidrs": [f"{GOLD_NET}/32"]}}
        return parse({"tenants": [*({"name": n, "tier": t, "match": {"ports": [port]}} for n, t, port in tenants),
                                  by_net],
                      "latency": {"mode": mode, "ports": sorted(p.values()), "window": "1s"}}, "test")

    def serve(self, *names: str) -> None:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, *(str(self.ports[n]) for n in names)],
                                stdout=subprocess.PIPE)
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"listening"

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def lab() -> Iterator[Lab]:
    lab = Lab()
    try:
        for names in (("a",), ("b",), ("c_gold", "c_bronze"), ("e_one", "e_two"), ("d",)):
            lab.serve(*names)
        yield lab
    finally:
        lab.close()


def counts(part: LatencyPart) -> dict[str, int]:
    return {tier: h.count for tier, h in part.runqueue_tiers.items()}


def kernel_rows(cap: Latency) -> tuple[int, int]:
    """The waits (count, sum in ns) lat_hist's run-queue rows hold, summed over every row, read from the map itself."""
    dp = cap.dp
    assert dp is not None
    hist, first = dp.map("lat_hist"), bm.KINDS * dp.nslots  # LAT_RUNQ_ROW
    count = sum_ns = 0
    for row in range(first, first + dp.nrows):
        q = memoryview(bytes(hist.lookup(row))).cast("Q")  # struct lat_row: sum_ns, then the buckets' counts
        count, sum_ns = count + sum(q[1:]), sum_ns + q[0]
    return count, sum_ns


def settle(cap: Latency, past: float = 1.2) -> LatencyPart:
    """Ticks for `past` seconds, scaled (the capability re-lists the serving threads once a second), the last part."""
    end = time.monotonic() + past * TIME_SCALE
    part = cap.collect()
    while time.monotonic() < end:
        cap.maintain()
        part = cap.collect()
        time.sleep(0.05)
    return part


def traffic(cap: Latency, port: int, rows: set[str], before: dict[str, int], n: int = 20,
            src: str = "127.0.0.1") -> dict[str, int]:
    """n connections to port from src (each wakes its server), then ticks until every row of `rows` gained waits."""
    for _ in range(n):
        request(port, src)

    def now() -> dict[str, int]:
        cap.maintain()
        return counts(cap.collect())

    return until(now, lambda got: all(got.get(r, 0) > before.get(r, 0) for r in rows), timeout=10.0 * TIME_SCALE)


@pytest.mark.privileged
@pytest.mark.parametrize("mode", latency_modes())
def test_each_server_waits_in_its_tiers_row_and_one_serving_two_tiers_in_the_shared_row(bpf: None, lab: Lab,
                                                                                      mode: str) -> None:
    fs = HostFS("/")
    ensure_mounted(fs)
    cap = Latency(AgentContext(config=lab.config(mode), hostfs=fs, gpu=NoGpu("test")))
    verdict = cap.probe(probe(fs))
    assert verdict.state is not State.UNAVAILABLE and verdict.plan.runq, verdict.reason
    cap.start(verdict.plan)
    try:
        # A process is noted by its first connection, its threads followed from the next re-listing (1 s): a first
        # connection to each, then their waits.
        for port in lab.ports.values():
            # C's bronze port last (C serves gold alone until then); D's in its own phase.
            if port not in (lab.ports["c_bronze"], lab.ports["d"]):
                request(port)
        base = counts(settle(cap))
        assert SHARED_TIER not in base, base
        got = traffic(cap, lab.ports["a"], {"gold"}, base)
        assert got.get("gold", 0) > base.get("gold", 0), got
        got = traffic(cap, lab.ports["b"], {"bronze"}, got)
        assert got.get("bronze", 0) > base.get("bronze", 0), got
        # E serves two gold tenants: one tier, so gold's row, not the shared one.
        request(lab.ports["e_two"])
        got = counts(settle(cap))
        got = traffic(cap, lab.ports["e_one"], {"gold"}, got)
        assert SHARED_TIER not in got, got
        # D: an unmatched client first (its process noted for no tier), then gold-d's; gold's row, not the shared one.
        request(lab.ports["d"])
        request(lab.ports["d"], GOLD_NET)
        got = counts(settle(cap))
        got = traffic(cap, lab.ports["d"], {"gold"}, got, src=GOLD_NET)
        got = traffic(cap, lab.ports["d"], {"gold"}, got)  # unmatched again: still gold's
        assert SHARED_TIER not in got, got
        # C, so far gold's, now serves bronze too: from the next re-listing on, its waits are the shared row's.
        request(lab.ports["c_bronze"])
        before = counts(settle(cap))
        got = traffic(cap, lab.ports["c_gold"], {SHARED_TIER}, before)
        got = traffic(cap, lab.ports["c_bronze"], {SHARED_TIER}, got)
        assert got.get(SHARED_TIER, 0) > 0, got
        # ... and in neither tier's: A, B and E were idle meanwhile.
        assert (got.get("gold"), got.get("bronze")) == (before.get("gold"), before.get("bronze")), (before, got)
        # Every process's waits as reported are what the kernel's run-queue rows hold, all of them, read from the map
        # (the servers are idle now; a late wait between the reads is read again).
        def reads() -> tuple[tuple[int, int], tuple[int, int] | None, tuple[int, int]]:
            before, part = kernel_rows(cap), cap.collect()
            rq = part.runqueue
            return before, (rq.count, rq.sum_ns) if rq is not None else None, kernel_rows(cap)

        before_read, reported, after_read = until(reads, lambda r: r[0] == r[2], timeout=5.0 * TIME_SCALE)
        assert before_read[0] > 0 and reported == before_read == after_read, (before_read, reported, after_read)
    finally:
        cap.stop()
