"""The latency capability's pure parts: tenant map entries, per-CPU value sums, windows, exposition, status."""

from __future__ import annotations

import random
import re
import struct

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from qosagent.config import parse
from qosagent.hist import NBUCKETS, Histogram, bucket_index, bucket_upper, export_bounds_ns
from qosagent.ebpf.maps import moved, runs
from qosagent.latency import bpfmaps as bm
from qosagent.latency import export
from qosagent.latency.model import LatencyPart, TenantLatency
from qosagent.window import Windows
from qosagent.tenants import tenant_entries, tenant_id

CFG = {
    "tenants": [
        {"name": "acme", "tier": "gold", "match": {"ports": [18001, 18003]}},
        {"name": "lab", "tier": "silver", "match": {"cidrs": ["10.1.0.0/16", "2001:db8::/32"]}},
        {"name": "edge", "tier": "bronze", "match": {"ports": [18004], "cidrs": ["192.168.7.9/32"]}},
    ],
    "latency": {"ports": [8000], "multiplexed_ports": [9001]},
}


def test_port_tenants_claim_their_ports() -> None:
    ports, _ = tenant_entries(parse(CFG, "t"))
    assert ports == {18001: tenant_id("acme"), 18003: tenant_id("acme")}


def test_cidr_tenants_are_ipv4_mapped_and_prefixed_by_the_port() -> None:
    _, cidrs = tenant_entries(parse(CFG, "t"))
    by = {(c.tenant, c.port, c.prefixlen): c.addr for c in cidrs}
    lab, edge = tenant_id("lab"), tenant_id("edge")
    # No port named: any watched port (0); IPv4 /16 -> 96 + 16 address bits after the 16 port bits.
    assert by[(lab, 0, 16 + 96 + 16)] == bytes(10) + b"\xff\xff" + bytes([10, 1, 0, 0])
    assert by[(lab, 0, 16 + 32)] == bytes.fromhex("20010db8") + bytes(12)
    # Ports and CIDRs together: the address on that port only.
    assert by[(edge, 18004, 16 + 128)] == bytes(10) + b"\xff\xff" + bytes([192, 168, 7, 9])
    assert len(cidrs) == 3


def test_tracked_ports_are_the_watched_ones_and_the_multiplexed_ones() -> None:
    assert parse(CFG, "t").tracked_ports() == [8000, 9001, 18001, 18003, 18004]


def row(sum_ns: int, counts: dict[int, int]) -> bytes:
    q = [0] * (1 + NBUCKETS)
    q[0] = sum_ns
    for b, c in counts.items():
        q[1 + b] = c
    return struct.pack(f"<{len(q)}Q", *q)


def test_counters_sum_the_cpus_and_rows_unchanged_are_not_parsed_again() -> None:
    def per_cpu(*cpus: dict[int, int]) -> bytes:  # struct lat_counts of each CPU, back to back
        return b"".join(struct.pack(f"<{bm.NCOUNTERS}Q", *[c.get(w, 0) for w in range(bm.NCOUNTERS)]) for c in cpus)

    assert bm.counters(per_cpu({bm.C_STARTED: 2}, {bm.C_STARTED: 3, bm.C_CONNS: 0})) == {bm.C_STARTED: 5}
    assert bm.counters(per_cpu({}, {})) == {}
    parser = bm.RowParser()
    data = row(360, {100: 3, 101: 4})
    h = bm.histogram(6, data, parser)
    assert (dict(h.counts), h.sum_ns) == ({100: 3, 101: 4}, 360)
    assert bm.histogram(6, bytes(data), parser).counts is h.counts  # same bytes: the parse is reused
    assert bm.histogram(7, row(0, {}), parser).count == 0


def test_generations_that_moved_are_found_and_read_in_runs() -> None:
    gens = [0] * 300
    old = struct.pack("<300Q", *gens)
    assert moved(old, old) == []
    gens[3], gens[4], gens[5], gens[200] = 1, 7, 2, 9
    new = struct.pack("<300Q", *gens)
    assert moved(new, old) == [3, 4, 5, 200]
    # Slots added by a reload since the last read: their generations were zero.
    assert moved(struct.pack("<302Q", *gens, 0, 1), new) == [301]
    assert runs({200, 5, 3, 4, 7}) == [(3, 3), (7, 1), (200, 1)]


def test_a_row_is_parsed_whole_from_its_first_to_its_last_bucket() -> None:
    # Edge buckets, and counts whose low bytes are zero: the parser skips zero bytes only outside the used span.
    counts = {0: 256, 7: 1, NBUCKETS - 1: 1 << 40}
    assert bm.RowParser().parse(0, row(99, counts)) == (counts, 99)
    assert bm.RowParser().parse(0, row(0, {300: 1 << 8})) == ({300: 256}, 0)


def test_a_row_read_again_is_parsed_over_its_span_and_scanned_only_when_it_grows() -> None:
    """Counted: a row that changed inside the buckets it used before is not scanned byte by byte again (a 4.8 KB
    strip each, ~15 us, for every active tenant's rows every tick); one that used a bucket outside them is; either
    way the counts are those a fresh parser reads."""
    parser = bm.RowParser()
    counts = {300: 1, 310: 2}
    for step, (bucket, expect_scans) in enumerate([(None, 1), (305, 1), (300, 1), (299, 2), (NBUCKETS - 1, 3),
                                                   (0, 4), (200, 4)]):
        if bucket is not None:
            counts[bucket] = counts.get(bucket, 0) + (1 << 8)  # low byte zero: only the span's ends are stripped
        data = row(1000 + step, counts)
        assert parser.parse(5, data) == bm.RowParser().parse(5, data) == (counts, 1000 + step)
        assert parser.scanned == expect_scans
    # Counts that went down (a slot's row zeroed) are read as they are, through the span kept or a scan.
    assert parser.parse(5, row(1, {200: 1})) == ({200: 1}, 1)
    assert parser.parse(5, row(0, {})) == ({}, 0)
    assert parser.parse(5, row(2, {NBUCKETS - 1: 3})) == ({NBUCKETS - 1: 3}, 2)


def test_generations_found_in_blocks_are_those_compared_one_by_one() -> None:
    rnd = random.Random(26)
    for _ in range(400):
        n = rnd.choice((1, 7, 8, 9, 63, 64, 65, 300, 1001))
        m = rnd.choice((n, max(1, n - rnd.randint(1, 9)), n + rnd.randint(1, 9)))  # slots added or gone since
        old = [rnd.randint(0, 3) for _ in range(m)]
        new = [old[i] if i < m else 0 for i in range(n)]
        for _ in range(rnd.choice((0, 1, 2, 12))):
            new[rnd.randrange(n)] += rnd.randint(1, 1 << 40)
        a, b = struct.pack(f"<{n}Q", *new), struct.pack(f"<{m}Q", *old)
        assert moved(a, b) == [i for i in range(n) if new[i] != (old[i] if i < m else 0)]


def test_slots_leave_room_for_reloads() -> None:
    assert bm.slots_for(0) == bm.MIN_SLOTS
    assert bm.slots_for(40) == 128  # 41 slots in use, twice that rounded up


def test_window_subtracts_the_checkpoint_one_span_ago() -> None:
    w: Windows[str, int] = Windows(10.0, 0, steps=10)
    assert w.tick(0.0, {"a": 0}) == set() and w.base("a") == 0  # before a full span: since start
    for t in range(1, 31):
        w.tick(float(t), {"a": t * 5})
    assert (w.start, w.base("a"), w.current("a")) == (20.0, 100, 150)
    assert len(w._times) <= 12 and len(w._kept["a"]) <= 12  # bounded, whatever the run time


def test_window_takes_checkpoints_at_its_step_not_every_tick() -> None:
    w: Windows[str, int] = Windows(10.0, 0, steps=10)
    for i in range(200):  # 100 ms ticks over 20 s
        w.tick(i / 10, {"a": i})
    assert len(w._times) <= 12 and len(w._kept["a"]) <= 12


def test_an_idle_key_keeps_no_checkpoints_and_its_window_drains_when_asked() -> None:
    """The windows of keys that do not change are not advanced tick by tick, yet each is right whenever read: the
    same as a window over every key's state at every checkpoint (the old way, here the reference)."""
    w: Windows[str, int] = Windows(10.0, 0, steps=10)
    ref: dict[float, dict[str, int]] = {}  # every key's state at every checkpoint
    state = {"busy": 0, "idle": 0, "late": 0}
    moved_at: dict[str, list[float]] = {"busy": [], "idle": [], "late": []}
    for i in range(400):  # 100 ms ticks over 40 s
        now = i / 10
        changed = {}
        if i % 3 == 0:
            changed["busy"] = state["busy"] = state["busy"] + 1
        if 20 <= i < 50:  # idle sends for 3 s, then never again
            changed["idle"] = state["idle"] = state["idle"] + 2
        if i in (60, 300):  # late comes twice
            changed["late"] = state["late"] = state["late"] + 5
        for k in w.tick(now, changed):
            moved_at[k].append(now)
        if not ref or now - max(ref) >= 1.0:
            ref[now] = dict(state)
        b = max(t for t in ref if t <= max(now - 10.0, min(ref)))
        assert w.start == b
        for k in state:
            assert state[k] - w.base(k) == state[k] - ref[b][k], (now, k)
    # idle's window changed only while B passed its checkpoints (2-5 s, then 11-15 s); none since.
    assert moved_at["idle"] and max(moved_at["idle"]) < 16.0
    assert len(w._kept["idle"]) == 1  # one state: the one B is past


def test_le_text_is_the_exact_edge_in_seconds() -> None:
    assert export.le_text(131072) == "0.000131072"
    assert export.le_text(2 * 10**9) == "2.0"
    assert export.le_text(1_500_000_000) == "1.5"
    for b in export_bounds_ns():
        assert int(round(float(export.le_text(b)) * 1e9)) == b


def _tenant(name: str, tier: str, values_ns: list[int]) -> TenantLatency:
    h = Histogram.of(values_ns)
    return TenantLatency(tenant=name, tier=tier, requests=len(values_ns), headers=h, ttft=h, response=h,
                         inter_token=h, headers_window=h, ttft_window=h, response_window=h, inter_token_window=h,
                         rate_rps=1.0, unpaired=1, unpaired_close=1)


def _scrape(part: LatencyPart) -> str:
    reg = CollectorRegistry(auto_describe=False)

    class C:
        def collect(self):  # noqa: ANN202
            return export.families(part, 6, "ttft", 0.99)

    reg.register(C())  # type: ignore[arg-type]
    return generate_latest(reg).decode()


def test_histogram_buckets_are_cumulative_at_exact_edges() -> None:
    # 20 ms lands exactly on an exported edge? Pick values at and just above one.
    edge = next(b for b in export_bounds_ns() if b > 20_000_000)
    part = LatencyPart(10.0, {"acme": _tenant("acme", "gold", [edge, edge + 1, 5_000_000])})
    text = _scrape(part)
    le = export.le_text(edge)
    assert re.search(rf'qosagent_latency_ttft_seconds_bucket{{le="{le}",tenant="acme",tier="gold"}} 2.0', text)
    assert 'qosagent_latency_ttft_seconds_bucket{le="+Inf",tenant="acme",tier="gold"} 3.0' in text
    assert 'qosagent_latency_requests_total{tenant="acme",tier="gold"} 3.0' in text
    assert ('qosagent_latency_requests_unpaired_total{reason="closed_without_response",tenant="acme",tier="gold"} 1.0'
            in text)
    assert 'qosagent_latency_response_window_seconds_count{tenant="acme",tier="gold"} 3.0' in text
    # The SLO's latency as admission judges it, named by signal and quantile, beside the per-signal summaries.
    slo = r'qosagent_latency_slo_seconds{signal="ttft",slo_quantile="0.99",tenant="acme",tier="gold"} 0\.02'
    assert re.search(slo, text)
    assert bucket_upper(bucket_index(edge)) == edge


def test_status_and_render_agree_on_quantiles_and_slo() -> None:
    part = LatencyPart(10.0, {"acme": _tenant("acme", "gold", [10_000_000] * 99 + [200_000_000]),
                              "hobby": _tenant("hobby", "bronze", [])})
    st = export.status(part, {"acme": 0.120, "hobby": 1.2}, "ttft", 0.99)
    rows = {r["tenant"]: r for r in st["tenants"]}
    assert rows["acme"]["requests"] == 100
    assert rows["acme"]["response"]["p50"] == Histogram.of([10_000_000] * 99 + [200_000_000]).quantile(0.5)
    assert rows["acme"]["slo"] == "ok"  # the p99 rank lands in the 10 ms bucket
    assert (rows["acme"]["slo_signal"], rows["acme"]["slo_quantile"]) == ("ttft", 0.99)
    assert rows["acme"]["body_writes_per_response"] == 2.0  # the same histogram as TTFT and inter-token here
    assert rows["hobby"]["body_writes_per_response"] is None
    assert rows["hobby"]["slo"] == "no data"
    text = export.render(st)
    assert re.search(r"^acme\s+gold\s+100\s+10\.\d", text, re.M), text
    assert re.search(r"^hobby\s+bronze\s+0\s+-", text, re.M), text
    assert "netns" not in text


def test_status_shows_the_pods_followed_by_address() -> None:
    pods = ({"netns": 4026532315, "pid": 42, "addresses": ["198.18.1.1"], "shared": ["198.18.9.9"],
             "pod": "qa/chat-0", "tenants": {"8000": "acme"}},)
    st = export.status(LatencyPart(10.0, {}, namespaces=pods), {}, "ttft", 0.99)
    assert st["namespaces"] == [dict(pods[0])]
    assert ("netns 4026532315 (pid 42, pod qa/chat-0) by address 198.18.1.1; shared with another namespace, "
            "unmatched: 198.18.9.9: port 8000: acme") in export.render(st)


def test_slo_state() -> None:
    assert export.slo_state(0.2, 0.12) == "breach"
    assert export.slo_state(0.1, 0.12) == "ok"
    assert export.slo_state(None, 0.12) == "no data"
    assert export.slo_state(0.1, 0.0) == "-"


def _probe(tracepoints: set[str], kprobes: bool = False, runqueue: bool = True, mode: str = "auto",
           sockops: bool = False, cgroup2: str = "/sys/fs/cgroup",
           absent_fns: tuple[str, ...] = ()) -> tuple[str, str, str]:
    from qosagent.capability import AgentContext
    from qosagent.features import KPROBE_FUNCTIONS, TRACEPOINTS, Features
    from qosagent.gpu.backend import NoGpu
    from qosagent.hostfs import HostFS
    from qosagent.latency.capability import Latency

    cfg = parse({"latency": {"mode": mode, "runqueue": {"enabled": runqueue}}}, "t")
    cap = Latency(AgentContext(config=cfg, hostfs=HostFS("/nonexistent"), gpu=NoGpu("t")))
    f = Features(tracepoints={tp: tp in tracepoints for tp in TRACEPOINTS}, kprobes=kprobes,
                 kprobe_functions={fn: fn not in absent_fns for fn in KPROBE_FUNCTIONS},
                 sockops_sendmsg=sockops, cgroup2=cgroup2)
    before = dict(vars(cap))
    v = cap.probe(f)
    assert vars(cap) == before, "probe plans; it leaves nothing on the capability"
    return v.state.value, v.reason, v.plan.mode if v.plan else ""


ALL_TP = {"sock/inet_sock_set_state", "sock/sock_recv_length", "sock/sock_send_length", "sock/sk_data_ready",
          "sched/sched_wakeup", "sched/sched_wakeup_new", "sched/sched_switch"}


def test_probe_picks_tracepoints_then_kprobes_by_what_the_kernel_has() -> None:
    assert _probe(ALL_TP) == ("active", "", "tracepoint")
    # Without a cgroup2 mount no egress program reads the responses: said, and the rest still measured.
    no_ttft = "no cgroup v2 hierarchy: time to first token and inter-token latency unavailable"
    assert _probe(ALL_TP, cgroup2="") == ("degraded", no_ttft, "tracepoint")
    old = ALL_TP - {"sock/sock_recv_length", "sock/sock_send_length", "sock/sk_data_ready"}
    state, reason, mode = _probe(old, kprobes=True)
    assert (state, mode) == ("active", "kprobe") and "kprobe fallback" in reason and "arrival" in reason
    assert "first read" not in reason  # sock_def_readable is probed for the arrival clock
    state, reason, mode = _probe(old, kprobes=True, absent_fns=("sock_def_readable",))
    assert (state, mode) == ("active", "kprobe") and "first read" in reason
    state, reason, _ = _probe(old, kprobes=True, absent_fns=("tcp_cleanup_rbuf",))
    assert state == "unavailable" and "tcp_cleanup_rbuf" in reason
    state, reason, _ = _probe(old, kprobes=False)
    assert state == "unavailable" and "no kprobes" in reason
    assert _probe(set())[0] == "unavailable"


def test_probe_prefers_sockops_where_the_kernel_and_a_cgroup2_mount_allow_and_honours_a_forced_mode() -> None:
    assert _probe(ALL_TP, sockops=True, cgroup2="/sys/fs/cgroup") == ("active", "", "sockops")
    assert _probe(ALL_TP, sockops=True, cgroup2="")[2] == "tracepoint"  # no cgroup v2: the tracepoints
    assert _probe(ALL_TP, sockops=True, cgroup2="/sys/fs/cgroup", mode="tracepoint")[2] == "tracepoint"
    state, reason, _ = _probe(ALL_TP, mode="sockops", cgroup2="/sys/fs/cgroup")
    assert state == "unavailable" and "6.15" in reason
    state, reason, _ = _probe(ALL_TP, mode="sockops", sockops=True, cgroup2="")
    assert state == "unavailable" and "cgroup v2" in reason
    state, reason, _ = _probe(ALL_TP, mode="kprobe")
    assert state == "unavailable" and "kprobes" in reason


class _Unasked(dict):  # type: ignore[type-arg]
    """kprobe_functions that fail when asked: answering reads /proc/kallsyms (features.KprobeFunctions)."""

    def __getitem__(self, name: str) -> bool:
        raise AssertionError(f"kprobe_functions asked about {name}")

    def get(self, name: str, default: object = None) -> bool:  # type: ignore[override]
        raise AssertionError(f"kprobe_functions asked about {name}")


def test_planning_sockops_or_tracepoints_never_asks_for_kprobe_functions() -> None:
    from qosagent.features import TRACEPOINTS, Features
    from qosagent.latency import planning
    from qosagent.latency.config import LatencyConfig

    for sockops, mode in ((True, "sockops"), (False, "tracepoint")):
        f = Features(tracepoints={tp: tp in ALL_TP for tp in TRACEPOINTS}, kprobes=True,
                     kprobe_functions=_Unasked(), sockops_sendmsg=sockops, cgroup2="/sys/fs/cgroup")
        v = planning.verdict(LatencyConfig(), f)
        assert v.plan is not None and v.plan.mode == mode


def test_planning_unavailable_without_kprobe_mode_never_asks_for_kprobe_functions() -> None:
    """The reason for an unavailable verdict names kprobe functions only where kprobe mode was considered."""
    from qosagent.features import TRACEPOINTS, Features
    from qosagent.latency import planning
    from qosagent.latency.config import LatencyConfig

    set_state_only = {tp for tp in TRACEPOINTS if tp.endswith("inet_sock_set_state")}
    for mode, tps in (("tracepoint", set_state_only), ("auto", set()), ("tracepoint", set())):
        f = Features(tracepoints={tp: tp in tps for tp in TRACEPOINTS}, kprobes=True,
                     kprobe_functions=_Unasked(), sockops_sendmsg=False, cgroup2="/sys/fs/cgroup")
        v = planning.verdict(LatencyConfig(mode=mode), f)
        assert v.plan is None and "unavailable" in str(v.state).lower(), (mode, v)


def test_probe_degrades_without_sched_tracepoints_only_when_runqueue_is_wanted() -> None:
    sock_only = {tp for tp in ALL_TP if tp.startswith("sock/")}
    state, reason, _ = _probe(sock_only)
    assert state == "degraded" and "run-queue" in reason
    assert _probe(sock_only, runqueue=False)[0] == "active"


def test_slots_are_kept_across_reloads_and_refused_when_none_is_free() -> None:
    from qosagent.latency.slots import assign_slots
    from qosagent.tenants import UNMATCHED_ID

    a, b, c = 11, 22, 33
    first = assign_slots({}, {a: None, b: None}, 4)  # type: ignore[dict-item]
    assert first == {UNMATCHED_ID: 0, a: 1, b: 2}
    # b removed, c added: b keeps its slot (its counts since start stay reported), c takes a free one.
    again = assign_slots(first, {a: None, c: None}, 4)  # type: ignore[dict-item]
    assert again == {UNMATCHED_ID: 0, a: 1, b: 2, c: 3}
    with pytest.raises(ValueError, match="4 tenant slots"):
        assign_slots(again, {44: None}, 4)  # type: ignore[dict-item]


def test_status_and_metrics_read_the_snapshot_not_the_capability() -> None:
    """What status and metrics show of the hooks is the tick's, from its part: an unstarted capability object (no
    mode, nothing attached) renders the part it is given."""
    from qosagent.capability import AgentContext
    from qosagent.gpu.backend import NoGpu
    from qosagent.hostfs import HostFS
    from qosagent.latency.capability import Latency
    from qosagent.latency.model import Hooks
    from qosagent.snapshot import Snapshot

    cap = Latency(AgentContext(config=parse(CFG, "t"), hostfs=HostFS("/nonexistent"), gpu=NoGpu("t")))
    hooks = Hooks(mode="sockops", attached=7, programs=(("lat_sockops", 41),), ttft="measured: as they leave",
                  cgroups=("/sys/fs/cgroup/svc",), learning=True, cgroup_errors=2, egress_unread=3)
    part = LatencyPart(10.0, {"acme": _tenant("acme", "gold", [10_000_000])}, hooks=hooks, slo={"acme": 0.005})
    snap = Snapshot.build(1, 0.0, 0.0, {"latency": part})
    st = cap.status(snap)
    assert (st["mode"], st["ttft"], st["programs"]) == ("sockops", "measured: as they leave",
                                                        [{"name": "lat_sockops", "id": 41}])
    assert (st["cgroups"], st["learning"], st["cgroup_errors"], st["egress_unread"]) == (
        ["/sys/fs/cgroup/svc"], True, 2, 3)
    assert st["tenants"][0]["slo"] == "breach"  # 10 ms against the part's 5 ms SLO
    fams = {m.name: m for m in cap.metrics(snap)}
    assert fams["qosagent_latency_programs_attached"].samples[0].value == 7
    assert fams["qosagent_latency_egress_unread_packets"].samples[0].value == 3
    assert cap.status(Snapshot.build(2, 0.0, 0.0, {})) == {}
