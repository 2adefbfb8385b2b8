"""Map memory worked out before the maps exist (`qosagent check`), and the flow front sized from the config and the
CPU count rather than from the CPU count alone."""

from __future__ import annotations

from pathlib import Path

from qosagent.config import parse
from qosagent.ebpf import mapsize
from qosagent.hostfs import HostFS
from qosagent.quota.datapath import flow_l1_bits, map_sizes


def test_possible_cpus_from_sysfs(tmp_path: Path) -> None:
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp_path / "sys/devices/system/cpu/possible").write_text("0-383\n")
    assert mapsize.possible_cpus(HostFS(str(tmp_path))) == 384
    (tmp_path / "sys/devices/system/cpu/possible").write_text("0\n")
    assert mapsize.possible_cpus(HostFS(str(tmp_path))) == 1


def test_per_entry_costs_as_the_kernel_accounts_them() -> None:
    # memlock of maps made on 6.18: a 2048-entry hash of 16-byte keys and 64-byte values took 144 B per entry, a
    # per-CPU array of 8-byte values 8 + 8 per CPU.
    assert mapsize.MapSize("h", mapsize.HASH, 2048, 16, 64).bytes(2) == 2048 * 144
    assert mapsize.MapSize("p", mapsize.PERCPU_ARRAY, 1024, 4, 8).bytes(2) == 1024 * 24
    assert mapsize.MapSize("a", mapsize.ARRAY, 10, 4, 5).bytes(2) == 80


def test_the_flow_front_follows_the_flow_cache_not_the_cpu_count() -> None:
    assert flow_l1_bits(65536, 2) == 12  # capped: 4096 entries per CPU, as before
    assert flow_l1_bits(65536, 384) == 8  # 256 per CPU: each CPU's share of the cache
    assert flow_l1_bits(1024, 384) == 6  # the floor
    cfg = parse({"quota": {"enabled": True}}, "test")
    front = {m.name: m for m in map_sizes(cfg, 384)}["quota_flow_l1"]
    # ~75 MB on a 384-thread host when the front was 4096 entries per CPU; now ~4.7 MB.
    assert front.bytes(384) < 5 * 2**20 < mapsize.MapSize("old", mapsize.PERCPU_ARRAY, 4096, 4, 48).bytes(384) / 10
