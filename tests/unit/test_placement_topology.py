from __future__ import annotations

import json

from click.testing import CliRunner

from qosagent.cli import main
from qosagent.gpu.backend import GpuDevice
from qosagent.gpu.fake import FakeBackend, with_device
from qosagent.hostfs import HostFS
from qosagent.cpulist import format_cpulist, parse_cpulist
from qosagent.placement.topology import read_topology
from testkit.placement_trees import numa_tree, pci_device, two_socket_8gpu


def test_cpulist_round_trip() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == frozenset()
    assert format_cpulist({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11"
    for bad in ("3-1", "a", "1-", "-2"):
        try:
            parse_cpulist(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def test_real_three_node_snapshot(node_exporter_sysfs) -> None:
    topo = read_topology(HostFS(node_exporter_sysfs))
    assert sorted(topo.nodes) == [0, 1, 2]
    assert topo.nodes[0].cpus == {0, 1} and topo.nodes[1].cpus == {2, 3}
    # node2 holds memory and no CPU: it can receive pages, never threads.
    assert topo.nodes[2].cpus == frozenset() and topo.nodes[2].has_memory
    assert topo.memory_nodes() == [0, 1, 2]
    # Its PCI devices are a bridge, an NVMe drive and a NIC: none of them computes.
    assert topo.accelerators == ()


def test_two_socket_eight_gpus_join_nvml_by_bus_id(tmp_path) -> None:
    fake = FakeBackend.preset("h200x8")
    topo = read_topology(HostFS(two_socket_8gpu(tmp_path)), fake.devices())
    gpus = [a for a in topo.accelerators if a.kind == "gpu"]
    assert len(gpus) == 8, "the NVSwitch bridge is not an accelerator"
    assert [topo.gpu(i).node for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(a.node_source == "sysfs" and a.local_cpus is not None for a in gpus)
    assert topo.gpu(5).local_cpus == frozenset(range(48, 96))
    assert topo.nodes[0].distances == ((0, 10), (1, 21))
    assert topo.warnings == ()


def test_nvml_bus_id_form_is_normalized(tmp_path) -> None:
    numa_tree(tmp_path, {0: "0-3"}, "0-3")
    pci_device(tmp_path, "0000:3b:00.0", "0x10de", "0x030200", 0, "0-3")
    dev = GpuDevice(0, "GPU-x", "NVIDIA H200", "00000000:3B:00.0")
    topo = read_topology(HostFS(tmp_path), [dev])
    assert len(topo.accelerators) == 1 and topo.accelerators[0].gpu_index == 0


def _minus_one_tree(tmp_path):
    numa_tree(tmp_path, {0: "0-3", 1: "4-7"}, "0-7")
    pci_device(tmp_path, "0000:18:00.0", "0x10de", "0x030200", -1, "0-7")
    return tmp_path


def test_numa_node_minus_one_is_unknown_not_node_zero(tmp_path) -> None:
    dev = GpuDevice(0, "GPU-x", "NVIDIA H200", "0000:18:00.0")
    topo = read_topology(HostFS(_minus_one_tree(tmp_path)), [dev])
    a = topo.gpu(0)
    assert a.sysfs_node is None and a.node is None and a.node_source == "unknown"
    assert any("NUMA node unknown" in w for w in topo.warnings)


def test_numa_node_minus_one_takes_nvml_affinity(tmp_path) -> None:
    _minus_one_tree(tmp_path)
    by_memory = GpuDevice(0, "GPU-x", "NVIDIA H200", "0000:18:00.0", cpu_affinity=(4, 5, 6, 7), numa_node=1)
    topo = read_topology(HostFS(tmp_path), [by_memory])
    assert (topo.gpu(0).node, topo.gpu(0).node_source) == (1, "nvml-memory")
    by_cpus = GpuDevice(0, "GPU-x", "NVIDIA H200", "0000:18:00.0", cpu_affinity=(4, 5, 6, 7), numa_node=None)
    topo = read_topology(HostFS(tmp_path), [by_cpus])
    assert (topo.gpu(0).node, topo.gpu(0).node_source) == (1, "nvml-cpus")


def test_sysfs_wins_over_disagreeing_nvml_with_a_warning(tmp_path) -> None:
    two_socket_8gpu(tmp_path)
    fake = FakeBackend.preset("h200x8")
    fake.gpus[0] = with_device(fake.gpus[0], numa_node=1)
    topo = read_topology(HostFS(tmp_path), fake.devices())
    assert topo.gpu(0).node == 0
    assert any("NVML says node 1" in w for w in topo.warnings)


def test_tree_without_node_zero(tmp_path) -> None:
    numa_tree(tmp_path, {1: "0-3", 3: "4-7"}, "0-7")
    pci_device(tmp_path, "0000:18:00.0", "0x1002", "0x120000", 3, "4-7")  # a non-NVIDIA accelerator
    topo = read_topology(HostFS(tmp_path))
    assert sorted(topo.nodes) == [1, 3]
    assert topo.accelerators[0].kind == "accelerator" and topo.accelerators[0].node == 3
    assert topo.node_of_cpus({4, 5}) == 3 and topo.node_of_cpus({3, 4}) is None


def test_offline_cpus_are_not_node_cpus(tmp_path) -> None:
    numa_tree(tmp_path, {0: "0-3"}, "0-1")
    assert read_topology(HostFS(tmp_path)).nodes[0].cpus == {0, 1}


def test_no_numa_directory_is_one_domain_without_migration(tmp_path) -> None:
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp_path / "sys/devices/system/cpu/online").write_text("0-3\n")
    topo = read_topology(HostFS(tmp_path))
    assert not topo.numa and topo.nodes[0].cpus == {0, 1, 2, 3}
    assert topo.warnings


def test_cli_topology(tmp_path) -> None:
    two_socket_8gpu(tmp_path)
    runner = CliRunner()
    res = runner.invoke(main, ["topology", "--host-root", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [n["id"] for n in data["nodes"]] == [0, 1]
    assert sorted(a["node"] for a in data["accelerators"]) == [0, 0, 0, 0, 1, 1, 1, 1]
    res = runner.invoke(main, ["topology", "--host-root", str(tmp_path)])
    assert res.exit_code == 0 and "0000:9a:00.0" in res.output and "48-95" in res.output


def test_cli_topology_with_fake_gpus_names_their_index(tmp_path) -> None:
    two_socket_8gpu(tmp_path / "host")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gpu: {backend: fake}\n")
    res = CliRunner().invoke(main, ["topology", "--host-root", str(tmp_path / "host"), "--config", str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert {a["bus_id"]: a["gpu_index"] for a in data["accelerators"]}["0000:db:00.0"] == 7
