from __future__ import annotations

import pytest

from qosagent.gpu.backend import GpuDevice
from qosagent.gpu.fake import FakeBackend, with_device
from qosagent.hostfs import HostFS
from qosagent.cpulist import parse_cpulist
from qosagent.placement.discovery import ProcInfo
from qosagent.placement.planner import Policy, plan
from qosagent.placement.topology import read_topology
from testkit.placement_trees import numa_tree, pci_device, two_socket_8gpu



def cpus(text: str) -> frozenset[int]:
    return parse_cpulist(text)


def proc(pid: int, cpuset: str | None = None, node_pref: int | None = None, tenant: str | None = None) -> ProcInfo:
    return ProcInfo(pid, 1, f"p{pid}", "vllm serve", "/", cpus(cpuset) if cpuset is not None else None,
                    "selectors[0]", node_pref, tenant)


@pytest.fixture
def hgx(tmp_path):
    return read_topology(HostFS(two_socket_8gpu(tmp_path)), FakeBackend.preset("h200x8").devices())


def test_real_snapshot_cpu_only_process_goes_to_most_usable_cpus(node_exporter_sysfs) -> None:
    topo = read_topology(HostFS(node_exporter_sysfs))
    # Nodes 0 and 1 have two CPUs each, node 2 none: the tie goes to the lower id, node 2 is never a home.
    t = plan([proc(10)], {}, topo, Policy())[10]
    assert (t.cpus, t.node) == (cpus("0-1"), 0)
    t = plan([proc(10)], {}, topo, Policy(reserved=cpus("0")))[10]
    assert (t.cpus, t.node) == (cpus("2-3"), 1)
    assert "most usable CPUs" in t.reason


def test_gpu_process_goes_to_its_gpus_node(hgx) -> None:
    t = plan([proc(10)], {10: (5,)}, hgx, Policy(reserved=cpus("0,48")))[10]
    assert (t.cpus, t.node, t.gpus) == (cpus("49-95"), 1, (5,))
    assert "GPU 5 on node 1" in t.reason
    t = plan([proc(11)], {11: (0, 1, 2, 3)}, hgx, Policy())[11]
    assert (t.cpus, t.node) == (cpus("0-47"), 0)


def test_gpus_spanning_nodes_follow_span_policy(hgx) -> None:
    t = plan([proc(10)], {10: (0, 1, 4)}, hgx, Policy())[10]
    assert t.node == 0 and "majority on node 0" in t.reason
    t = plan([proc(10)], {10: (0, 1, 4)}, hgx, Policy(span_policy="unpinned"))[10]
    assert not t.pinned and t.node is None and "span_policy unpinned" in t.reason
    # A tie: the node with more usable CPUs wins, so the answer is the same on every run.
    t = plan([proc(10)], {10: (0, 4)}, hgx, Policy(reserved=cpus("0-3")))[10]
    assert t.node == 1 and "no majority" in t.reason


def test_gpu_with_unknown_node_is_not_pinned(tmp_path) -> None:
    numa_tree(tmp_path, {0: "0-3", 1: "4-7"}, "0-7")
    pci_device(tmp_path, "0000:18:00.0", "0x10de", "0x030200", -1, "0-7")
    topo = read_topology(HostFS(tmp_path), [GpuDevice(0, "GPU-x", "H200", "0000:18:00.0")])
    t = plan([proc(10)], {10: (0,)}, topo, Policy())[10]
    assert not t.pinned and t.node is None
    assert "unknown" in t.reason


def test_gpu_with_unknown_node_uses_nvml_affinity(tmp_path) -> None:
    # The real H200 VM: sysfs numa_node -1, NVML's memory affinity node 0.
    numa_tree(tmp_path, {0: "0-15"}, "0-15")
    pci_device(tmp_path, "0000:00:06.0", "0x10de", "0x030200", -1, "0-15")
    dev = GpuDevice(0, "GPU-x", "NVIDIA H200", "00000000:00:06.0", cpu_affinity=tuple(range(16)), numa_node=0)
    t = plan([proc(10)], {10: (0,)}, read_topology(HostFS(tmp_path), [dev]), Policy(reserved=cpus("0")))[10]
    assert (t.cpus, t.node) == (cpus("1-15"), 0)


def test_nvml_cpus_spanning_nodes_are_used_without_a_memory_node(tmp_path) -> None:
    numa_tree(tmp_path, {0: "0-3", 1: "4-7"}, "0-7")
    pci_device(tmp_path, "0000:18:00.0", "0x10de", "0x030200", -1, "0-7")
    dev = GpuDevice(0, "GPU-x", "H200", "0000:18:00.0", cpu_affinity=(2, 3, 4, 5), numa_node=None)
    t = plan([proc(10)], {10: (0,)}, read_topology(HostFS(tmp_path), [dev]), Policy())[10]
    assert t.cpus == cpus("2-5") and t.node is None


def test_tree_without_node_zero(tmp_path) -> None:
    numa_tree(tmp_path, {1: "0-3", 3: "4-9"}, "0-9")
    topo = read_topology(HostFS(tmp_path))
    t = plan([proc(10)], {}, topo, Policy())[10]
    assert (t.cpus, t.node) == (cpus("4-9"), 3)
    # The selector's node wins over the configured default, which wins over "most CPUs".
    t = plan([proc(10, node_pref=1), proc(11)], {}, topo, Policy(cpu_node=1))
    assert (t[10].node, t[11].node) == (1, 1)
    t = plan([proc(10)], {}, topo, Policy(cpu_node=0))[10]
    assert not t.pinned and "not on this host" in t.reason


def test_kubelet_cpuset_bounds_the_target(hgx) -> None:
    t = plan([proc(10, cpuset="50-55,60")], {10: (6,)}, hgx, Policy())[10]
    assert (t.cpus, t.node) == (cpus("50-55,60"), 1) and "within cpuset" in t.reason
    # Kubelet put it on node 0's CPUs only; its GPU is on node 1: kubelet's word stands.
    t = plan([proc(11, cpuset="2-5")], {11: (6,)}, hgx, Policy())[11]
    assert not t.pinned and "kubelet" in t.reason
    # A cpuset spanning both nodes is cut down to the GPU's side.
    t = plan([proc(12, cpuset="40-55")], {12: (6,)}, hgx, Policy())[12]
    assert t.cpus == cpus("48-55")


def test_reserved_cpus_are_never_given(hgx) -> None:
    t = plan([proc(10)], {10: (1,)}, hgx, Policy(reserved=cpus("0-1,47")))[10]
    assert t.cpus == cpus("2-46")
    t = plan([proc(10)], {10: (1,)}, hgx, Policy(reserved=cpus("0-47")))[10]
    assert not t.pinned and "no CPU left" in t.reason


def test_tier_gets_exclusive_cpus_and_others_share_the_rest(hgx) -> None:
    pol = Policy(reserved=cpus("48"), exclusive_cpus={"gold": 4}, tiers={"acme": "gold", "cheap": "bronze"})
    t = plan([proc(20, tenant="acme"), proc(21, tenant="cheap"), proc(22)], {20: (4,), 21: (5,), 22: (6,)}, hgx, pol)
    assert t[20].cpus == cpus("49-52") and t[20].exclusive and "exclusive" in t[20].reason
    assert t[21].cpus == t[22].cpus == cpus("53-95")
    assert not t[21].cpus & t[20].cpus


def test_exclusive_shortage_shares_the_node(hgx) -> None:
    pol = Policy(exclusive_cpus={"gold": 4}, tiers={"acme": "gold"})
    t = plan([proc(20, cpuset="50-51", tenant="acme")], {20: (4,)}, hgx, pol)[20]
    assert t.cpus == cpus("50-51") and not t.exclusive and "only 2 free" in t.reason


def test_gpu_on_a_node_the_host_lacks(tmp_path) -> None:
    # The fake h200x8 on a one-node host: GPUs 4-7 claim node 1.
    numa_tree(tmp_path, {0: "0-1"}, "0-1")
    topo = read_topology(HostFS(tmp_path), FakeBackend.preset("h200x8").devices())
    t = plan([proc(10)], {10: (5,)}, topo, Policy())[10]
    assert not t.pinned and "not on this host" in t.reason
    assert any("sysfs does not list" in w for w in topo.warnings)


def test_issue_example_on_two_cpu_single_node(tmp_path) -> None:
    numa_tree(tmp_path, {0: "0-1"}, "0-1")
    t = plan([proc(10)], {}, read_topology(HostFS(tmp_path)), Policy(reserved=cpus("0")))[10]
    assert (t.cpus, t.node) == ({1}, 0)


def test_memory_only_node_never_gets_threads(tmp_path) -> None:
    numa_tree(tmp_path, {0: "0-3", 1: ""}, "0-3")
    fake = FakeBackend.preset("single")
    fake.gpus[0] = with_device(fake.gpus[0], numa_node=1, cpu_affinity=None, pci_bus_id="0000:99:00.0")
    t = plan([proc(10)], {10: (0,)}, read_topology(HostFS(tmp_path), fake.devices()), Policy())[10]
    assert not t.pinned and "node 1 has no CPUs" in t.reason


def test_placement_series_name_a_process_by_what_survives_its_restart() -> None:
    """No pid label but on the info family: a restarted server keeps its series."""
    from qosagent.placement.export import FAMILIES, process_names
    from qosagent.placement.model import PlacementPart

    def part(pids: list[int]) -> PlacementPart:
        recs = [{"pid": p, "name": "vllm", "selector": "selectors[0]", "gpus": [0] if i == 0 else [],
                 "node": 0, "cpus": "0-1", "last_action": "pin", "applied": True, "reason": "", "memory_local": 0.9,
                 "pages": {"0": 10}} for i, p in enumerate(pids)] + [
            {"pid": pids[-1] + 1, "name": "vllm", "selector": "selectors[0]", "gpus": [], "node": 0, "cpus": None,
             "last_action": "", "applied": False, "reason": "", "memory_local": None, "pages": {}}]
        return PlacementPart("enforce", None, True, (), tuple(recs))  # type: ignore[arg-type]

    before, after = part([100, 200]), part([300, 400])
    assert process_names(before) == {100: "vllm@selectors[0]/gpu0", 200: "vllm@selectors[0]",
                                     201: "vllm@selectors[0]#2"}
    assert sorted(process_names(after).values()) == sorted(process_names(before).values())
    for fam in FAMILIES:
        if fam.name != "qosagent_placement_process_info":
            assert "pid" not in fam.labels, fam.name
    (local,) = [f for f in FAMILIES if f.name == "qosagent_placement_memory_local_ratio"]
    assert list(local.series(before)) == list(local.series(after))
