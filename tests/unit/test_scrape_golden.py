"""The whole scrape of one fixed Snapshot, every capability's part filled, against the exposition it gave when the
families were moved into tables (golden/scrape.txt, golden/scrape.pb): families, names, help, labels and values must
not change under a refactoring. QOSAGENT_UPDATE_GOLDEN=1 rewrites the files (then read the diff before committing:
a change here is a change every dashboard sees)."""

from __future__ import annotations

import os
import pathlib
from types import MappingProxyType
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from qosagent import config as config_mod
from qosagent import exposition
from qosagent.admission.capability import Admission
from qosagent.admission.model import AdmissionPart, TenantAdmission, TierAdmission
from qosagent.capability import State, Verdict
from qosagent.daemon import Agent
from qosagent.dvfs.capability import Dvfs
from qosagent.dvfs.model import DvfsPart, PolicyView
from qosagent.fleet.agent import Seen
from qosagent.fleet.alloc import Round, TenantRound
from qosagent.fleet.allocator import Allocator, Stats
from qosagent.fleet.capability import Fleet
from qosagent.fleet.etcd import Leadership
from qosagent.fleet.model import FleetPart, TenantShare
from qosagent.gpu.backend import GpuProcess, GpuSample, GpuState, NoGpu
from qosagent.hist import Histogram
from qosagent.hostfs import HostFS
from qosagent.latency.capability import Latency
from qosagent.latency.model import Hooks, LatencyPart, TenantLatency
from qosagent.metrics import make_registry
from qosagent.placement.capability import Placement
from qosagent.placement.model import PlacementPart
from qosagent.placement.topology import Node, Topology
from qosagent.pods.service import Pods
from qosagent.quota.capability import Quota
from qosagent.quota.model import QuotaPart, TenantQuota
from qosagent.servers.capability import Servers
from qosagent.servers.model import ServerReading, ServersPart
from qosagent.snapshot import Snapshot
from qosagent.tenants import TenantLimit

GOLDEN = pathlib.Path(__file__).parent / "golden"

CONFIG = """
tenants:
  - {name: chat, tier: gold, match: {ports: [8000]}}
  - {name: batch, tier: bronze, match: {ports: [8001]}}
"""


def _latency(name: str, tier: str, scale: int) -> TenantLatency:
    h = Histogram.of([scale * k for k in (150_000, 2_000_000, 40_000_000, 90_000_000, 700_000_000)])
    w = Histogram.of([scale * k for k in (2_000_000, 40_000_000)])
    return TenantLatency(tenant=name, tier=tier, requests=5 * scale, headers=h, ttft=h, response=h, inter_token=w,
                         headers_window=w, ttft_window=w, response_window=w, inter_token_window=Histogram(),
                         rate_rps=1.5, in_flight=2, unpaired=3, overlapped=1, unpaired_send=1, unpaired_close=2,
                         pipelined=4, connections=7, multiplexed_connections=1, lost=0, untracked=2,
                         no_ttft={"not_http": 3}, interim=1, framed=5, adopted=1)


def parts() -> dict[str, Any]:
    gpu = GpuState(True, gpus=(
        GpuSample(0, "GPU-0", memory_total=80 << 30, memory_used=60 << 30, utilization_pct=75.0, temperature_c=61.0,
                  power_w=300.5, power_limit_w=700.0, sm_clock_mhz=1980, mem_clock_mhz=2619,
                  clock_event_reasons=4, processes=(GpuProcess(4242, 50 << 30),)),
        GpuSample(1, "GPU-1", lost=True)))
    topo = Topology({0: Node(0, frozenset({0, 1}), 1 << 20)}, (), frozenset({0, 1}))
    return {
        "gpu": gpu,
        "pods": {"runtime": "containerd", "known": True, "ready": 3, "age_s": 1.5, "errors": 2, "reason": ""},
        "quota": QuotaPart(
            tenants={"chat": TenantQuota("chat", "gold", TenantLimit(100, 200), TenantLimit(50, 100), 1000, 20, 30, 1,
                                         12.5, 0.5, 42.0),
                     "batch": TenantQuota("batch", "bronze", None, None, 10, 0)},
            unmatched_packets=9, unmatched_counts=(9, 0, 2, 0), passed={"unmatched": 9, "not_tcp": 3},
            interfaces=("lo",), pins="/sys/fs/bpf/qosagent"),
        "latency": LatencyPart(
            window_s=30.0, tenants={"chat": _latency("chat", "gold", 1), "batch": _latency("batch", "bronze", 3)},
            runqueue=Histogram.of([20_000, 70_000, 3_000_000]), runqueue_window=Histogram.of([20_000]),
            runqueue_tiers={"gold": Histogram.of([20_000, 70_000]), "_shared": Histogram.of([3_000_000])},
            runqueue_tiers_window={"gold": Histogram.of([20_000])},
            found_open=2, unobserved={"awaiting_request": 1, "not_hooked": 0}, hooks=Hooks("tracepoint", 6)),
        "servers": ServersPart(servers=(
            ServerReading(8000, "vllm", "http://127.0.0.1:8000/metrics", False, True, age_s=0.4, pid=4242,
                          pids=frozenset({4242}), kv_cache_usage=0.61, requests_waiting=3.0, requests_running=8.0,
                          preemptions=2.0, generated_tokens_per_second=120.5,
                          scrapes=MappingProxyType({"ok": 40, "timeout": 1}), restarts=1),
            ServerReading(8001, "generic", "http://127.0.0.1:8001/metrics", True, False, reason="connection refused",
                          scrapes=MappingProxyType({"refused": 3}), counter_resets=1)), round_errors=1),
        "admission": AdmissionPart(
            near_slo=frozenset({"gold"}), decided=True, mode="enforce", enforcing=True, quantile=0.99, signal="ttft",
            gpu="pressed", shed_tiers=1, servers_known=(8000, 8001), server_pressure=frozenset({8000}),
            tiers=(TierAdmission("gold", 0.11, 0.12, 0, False, True), TierAdmission("bronze", None, 1.2, 2, True,
                                                                                     False)),
            tenants=(TenantAdmission("chat", "gold", TenantLimit(100, 200), None, False, False, "config",
                                     "baseline"),
                     TenantAdmission("batch", "bronze", TenantLimit(10, 10), TenantLimit(0, 1), True, True, "gpu",
                                     "shed")),
            decisions={("batch", "shed", "gpu"): 2}, pre_cleanup_runs={"ok": 1}),
        "dvfs": DvfsPart(
            mode="enforce", temperatures={"cpu0": 55.0, "nvme": 41.5}, hottest_c=55.0, critical_c=95.0,
            emergency=False, policies=(
                PolicyView("policy0", (0, 1), "acpi-cpufreq", "userspace", "userspace", "high", 3_000_000,
                           2_900_000, 0.42, 3, "load", "busy", "", ""),
                PolicyView("policy1", (2,), "intel_pstate", "powersave", None, None, None, None, None, 0, "", "",
                           "", "no actuator")),
            gpu_bands={0: "cool", 1: None}, gpu_off={}, bad_readings={("nvme", "range"): 2},
            writes={"ok": 3, "same": 1}),
        "fleet": FleetPart("node-a", Seen(leader="node-b", etcd_up=True, report_errors=1, reports=40, watching=True,
                                          watch_breaks=2), 100.0, {
            "chat": TenantShare("chat", 500.0, 125.5, "lease", 2.5, 110.0),
            "batch": TenantShare("batch", 40.0, 4.0, "safe", None, None)}),
        "placement": PlacementPart(
            mode="enforce", topology=topo, reconcile=True, procs=(), records=({
                "pid": 4242, "name": "vllm", "selector": "gpu", "node": 0, "cpus": "0-1", "gpus": [0],
                "last_action": "pin",
                "applied": True, "reason": "gpu 0 on node 0", "memory_local": 0.9, "pages": {"0": 900, "1": 100},
            },), counters={"actions": {"pin": 1}, "migrations": {"moved": 1}, "pages_migrated": {"moved": 900},
                           "drift": {"corrected": 1}, "errors": {}}),
    }


@pytest.fixture
def scrape_agent(tmp_path: pathlib.Path) -> Agent:
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG)
    agent = Agent(config_mod.load(str(path)), HostFS(tmp_path), str(path), gpu=NoGpu())
    agent.latest = Snapshot.build(7, 100.0, 1_700_000_000.0, parts())
    agent.capabilities = [cls(agent.ctx) for cls in (Quota, Latency, Servers, Admission, Dvfs, Placement, Fleet)]
    for name in ("quota", "latency", "servers", "admission", "dvfs", "fleet"):
        agent.verdicts[name] = Verdict(State.ACTIVE)
    agent.verdicts["placement"] = Verdict(State.DEGRADED, "one node")
    agent.services = [Pods(agent.hostfs, agent.ctx.clock)]
    s = agent.stats
    s.ticks, s.tick_seconds_last, s.tick_seconds_max, s.tick_overruns = 70, 0.0125, 0.25, 1
    s.collect_errors.update({"latency": 2, "gpu": 1})
    s.apply_errors.update({"dvfs": 1})
    s.reloads_ok, s.reloads_failed = 3, 1
    return agent


def _check(name: str, got: bytes) -> None:
    path = GOLDEN / name
    if os.environ.get("QOSAGENT_UPDATE_GOLDEN") == "1":
        path.write_bytes(got)
    assert got == path.read_bytes(), f"the scrape differs from {path} (QOSAGENT_UPDATE_GOLDEN=1 rewrites it)"


def test_the_text_scrape_of_a_fixed_snapshot_is_the_golden_one(scrape_agent: Agent) -> None:
    text = generate_latest(make_registry(scrape_agent))
    # The new names only: the deprecated copies are off by default (metrics.deprecated_names).
    assert b"qosagent_latency_ttft_seconds_bucket" in text and b"qosagent_ttft_seconds_bucket" not in text
    _check("scrape.txt", text)


def test_the_protobuf_scrape_of_a_fixed_snapshot_is_the_golden_one(scrape_agent: Agent) -> None:
    _check("scrape.pb", exposition.encode(make_registry(scrape_agent).collect()))


def _allocator(leading: bool) -> Allocator:
    cfg = config_mod.parse({"quota": {"enabled": True}, "fleet": {"enabled": True, "expected_nodes": 2}, "tenants": [
        {"name": "chat", "tier": "gold", "match": {"ports": [8000]}, "quota": {"fleet_rps": 400}},
        {"name": "batch", "tier": "bronze", "match": {"ports": [8001]}, "quota": {"fleet_rps": 90}},
        {"name": "idle", "tier": "bronze", "match": {"ports": [8002]}, "quota": {"fleet_rps": 10}}]}, "test")
    a = Allocator(cfg, None, me="replica-a")  # type: ignore[arg-type]  # the scrape never reaches etcd
    a.leading = Leadership("replica-a", 7, True) if leading else None
    a.reachable, a.nodes = True, 2
    a.stats = Stats(rounds=12, leader_changes=1, deposed=1, errors={"etcd": 2, "foreign": 3}, short={"batch": 4},
                    round_seconds=0.0125, convergence={"chat": 1.5})
    a.last = Round({"chat": TenantRound({"n1": 150.0, "n2": 250.0}, {"n1": 150.0, "n2": 250.0}, 380.0, False, 395.5,
                                       400.0),
                    "batch": TenantRound({"n1": 45.0, "n2": 45.0}, {"n1": 45.0, "n2": 45.0}, 200.0, True, 90.0, 90.0)})
    return a


def test_the_allocators_scrape_of_a_fixed_state_is_the_golden_one() -> None:
    """The allocator's families (qosagent allocator), leading and standing by: a standby shows no round's numbers."""
    scrapes = []
    for leading in (True, False):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_allocator(leading))  # type: ignore[arg-type]
        scrapes.append(generate_latest(registry))
    _check("allocator.txt", b"".join(scrapes))
