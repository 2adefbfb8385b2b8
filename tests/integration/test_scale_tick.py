"""Many tenants, few of them sending: the latency program in-process with 200 tenants matched by client address, real
traffic on loopback from two of them. A tick reads the rows of the tenants whose generation moved (lat_gen) and no
other; an idle tenant's window drains without being read, and a tenant that comes back shows what it sent."""

from __future__ import annotations

import http.client
import http.server
import time
from typing import Any, Iterator

import pytest

from qosagent import features
from qosagent.capability import AgentContext, State
from qosagent.config import parse
from qosagent.ebpf import maps
from qosagent.features import probe
from qosagent.gpu.backend import NoGpu
from qosagent.hist import bucket_index, bucket_lower
from qosagent.hostfs import HostFS
from qosagent.latency.capability import Latency
from qosagent.latency.model import LatencyPart
from tests.integration.latency_helpers import serving
from tests.kernel_modes import latency_modes

PORT = 18031
TENANTS = 200


def address(i: int) -> str:
    return f"127.1.{i // 250}.{i % 250 + 1}"


class Handler(http.server.BaseHTTPRequestHandler):
    """GET /<ms>: answers after that many milliseconds."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802
        time.sleep(int(self.path[1:]) / 1e3)
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture(params=latency_modes())
def latency(request: pytest.FixtureRequest, bpf: None) -> Iterator[Latency]:
    fs = HostFS("/")
    features.ensure_mounted(fs)
    cfg = parse({
        "tenants": [{"name": f"t{i}", "tier": "silver", "match": {"cidrs": [f"{address(i)}/32"]}}
                    for i in range(TENANTS)],
        "latency": {"mode": request.param, "ports": [PORT], "multiplexed_ports": [], "window": "1s",
                    "runqueue": {"enabled": False}},
    }, "test")
    cap = Latency(AgentContext(config=cfg, hostfs=fs, gpu=NoGpu("test")))
    verdict = cap.probe(probe(fs))
    assert verdict.state is State.ACTIVE
    cap.start(verdict.plan)
    try:
        with serving((PORT,), Handler):
            yield cap
    finally:
        cap.stop()


def send(source: str, delay_ms: int, n: int) -> None:
    for _ in range(n):
        c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=10, source_address=(source, 0))
        c.request("GET", f"/{delay_ms}")
        c.getresponse().read()
        c.close()


def ticks_until(cap: Latency, done: Any, reads: list[int], timeout: float = 10.0) -> LatencyPart:
    """Ticks (100 ms apart) until done(part), each tick's rows read noted."""
    end = time.monotonic() + timeout
    while True:
        part = cap.collect()
        reads.append(part.rows_read)
        if done(part) or time.monotonic() > end:
            return part
        time.sleep(0.1)


def within(got: float | None, sent_s: float) -> bool:
    """A server-side time of a request the server held sent_s, as a quantile of the histogram: at least the lower
    edge of the bucket that holds sent_s (the quantile is interpolated inside its bucket, so requests of 60.1 ms all
    in [58.7, 60.8) ms put the median at 59.9 ms), at most a bucket's width (6 %) and a loaded host's scheduling
    more."""
    return got is not None and bucket_lower(bucket_index(int(sent_s * 1e9))) / 1e9 <= got <= sent_s * 1.10 + 0.005


@pytest.mark.privileged
def test_idle_tenants_are_not_read_and_one_that_comes_back_shows_what_it_sent(latency: Latency,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    # Nothing sent yet: after the first reads, no tick reads any tenant's rows.
    part = ticks_until(latency, lambda p: len(reads) >= 4, reads)
    assert reads[-2:] == [0, 0] and len(part.tenants) == TENANTS + 1  # every tenant shown, and unmatched traffic

    # t0 sends; only its row is read, on any tick.
    reads.clear()
    send(address(0), 20, 10)
    part = ticks_until(latency, lambda p: p.tenants["t0"].requests == 10, reads)
    assert part.tenants["t0"].requests == 10 and max(reads) == 1, reads
    assert within(part.tenants["t0"].headers_window.quantile(0.5), 0.020)

    # t0 goes quiet: its window drains (1 s) with no tick reading its row once the kernel's bump has settled.
    reads.clear()
    part = ticks_until(latency, lambda p: p.tenants["t0"].response_window.count == 0, reads)
    assert part.tenants["t0"].response_window.count == 0 and part.tenants["t0"].rate_rps == 0.0
    assert part.tenants["t0"].requests == 10  # since start, kept
    assert sum(reads[2:]) == 0, reads
    # ... nor does it ask the kernel for the generations: they are read in place (a BPF_F_MMAPABLE array).
    calls = []
    lookup_batch = maps._lookup_batch
    monkeypatch.setattr(maps, "_lookup_batch", lambda *a: calls.append(a) or lookup_batch(*a))
    quiet = [latency.collect() for _ in range(5)]
    assert [p.rows_read for p in quiet] == [0] * 5 and calls == []
    # ... and, at rest, makes nothing anew: the part of the tick before is handed on, no tenant's row copied.
    assert all(p is quiet[0] for p in quiet)

    # t0 comes back with slower requests: its window holds exactly those, its since-start counts all of them; t1,
    # idle throughout, shows nothing and was never read.
    reads.clear()
    send(address(0), 60, 8)
    part = ticks_until(latency, lambda p: p.tenants["t0"].requests == 18, reads)
    t0 = part.tenants["t0"]
    assert (t0.requests, t0.headers_window.count, t0.response_window.count) == (18, 8, 8)
    assert within(t0.headers_window.quantile(0.5), 0.060), t0.headers_window.quantile(0.5)
    assert within(t0.headers.quantile(0.25), 0.020) and within(t0.headers.quantile(0.9), 0.060)
    assert t0.rate_rps > 0
    assert part.tenants["t1"].requests == 0 and part.tenants["t1"].headers_window.count == 0
    assert max(reads) == 1, reads


def big_config(pin_root: str, moved: int | None = None) -> Any:
    """4,000 tenants by client network, every fourth with a header and every tenth with a port of its own too; moved:
    that tenant's network is another."""
    tenants = []
    for i in range(4000):
        net = f"10.{i // 250}.{i % 250}.0/24" if i != moved else "192.168.99.0/24"
        match: dict[str, Any] = {"cidrs": [net]}
        if i % 4 == 0:
            match["header"] = {"name": "x-api-key", "value": f"key-{i}"}
        if i % 10 == 0:
            match["ports"] = [20000 + i]
        tenants.append({"name": f"t{i}", "tier": "silver", "match": match, "quota": {"rps": 100 + i, "burst": 10}})
    return parse({"tenants": tenants, "latency": {"ports": [18032]}, "quota": {"enabled": True, "interfaces": ["lo"]},
                  "bpf": {"pin_root": pin_root}}, "test")


@pytest.mark.privileged
def test_a_reload_of_one_tenant_among_4000_rewrites_only_its_entries(bpf: None) -> None:
    import shutil
    import uuid

    from qosagent.ebpf import maps
    from qosagent.latency.datapath import Datapath as LatencyDatapath
    from qosagent.latency.model import Plan
    from qosagent.quota.datapath import Datapath as QuotaDatapath
    from qosagent.quota.rules import baseline_buckets

    pin_root = f"/sys/fs/bpf/qosagent-test-{uuid.uuid4().hex[:8]}"
    cfg = big_config(pin_root)
    quota = QuotaDatapath(cfg)  # loaded, never attached: the maps are what is counted
    lat = LatencyDatapath.load(cfg, Plan("tracepoint", arrival=False, egress=False, runq=False), HostFS("/"))
    try:
        before = maps.writes.copy()
        quota.write_config(cfg, baseline_buckets(cfg))
        lat.write(lat.plan(cfg))
        first = maps.writes - before
        assert first["tenant_cidrs"] >= 2 * 4000 and first["quota_limits"] == 4000  # both programs', every tenant

        new = big_config(pin_root, moved=7)
        before = maps.writes.copy()
        quota.write_config(new, baseline_buckets(new))
        lat.write(lat.plan(new))
        # t7's network: its old entry deleted and its new one written, in each program's trie; the rule change empties
        # quota's flow cache (nothing in it here) and bumps its rules generation, and quota's heartbeat is written, as
        # on every tick. No other tenant's entry, limit, slot or port is written.
        assert dict(maps.writes - before) == {"tenant_cidrs": 4, "quota_config": 2}
    finally:
        lat.close()
        quota.close()
        shutil.rmtree(pin_root, ignore_errors=True)
