"""What `qosagent check` says of serving groups already above a memory limit they would get, on fixture hosts (cgroup
v1 as on the development machine, and v2): the groups found the way resources finds them (a tenant's port → the
process listening on it → its cgroup), one line per group above, the file it reads and what the kernel will do,
and a clear line, never a crash, where the use cannot be read."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest

from qosagent.hostfs import HostFS
from qosagent.resources.applier import Applier, Store
from qosagent.resources.model import Files, Group
from qosagent.resources.reading import memory_check
from qosagent.units import approx_size
from tests.unit.test_cli import run_cli

GiB = 1 << 30
HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def put(root: Path, rel: str, text: str) -> None:
    p = root / rel.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def host(root: Path, version: str, servers: dict[int, tuple[int, str, dict[str, str]]]) -> Path:
    """A host whose processes (pid -> (port, cgroup, its memory files)) listen on their ports (socket inode
    5000 + pid) in the host's network namespace, each in its own cgroup; cpu and memory as v1 hierarchies or in
    the unified one."""
    put(root, "/sys/devices/system/cpu/online", "0-7\n")
    put(root, "/proc/meminfo", f"MemTotal: {64 * GiB // 1024} kB\n")
    if version == "v2":
        put(root, "/sys/fs/cgroup/cgroup.controllers", "cpu memory pids\n")
    rows = []
    for i, (pid, (port, cgroup, files)) in enumerate(sorted(servers.items())):
        rows.append(f"   {i}: 00000000:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0"
                    f"        0 {5000 + pid} 1 0 100 0 0 10 0\n")
        put(root, f"/proc/{pid}/comm", f"server{pid}\n")
        put(root, f"/proc/{pid}/stat", f"{pid} (server{pid}) S " + " ".join(["0"] * 18 + ["1000"] + ["0"] * 10))
        fd = root / f"proc/{pid}/fd"
        fd.mkdir(parents=True)
        os.symlink(f"socket:[{5000 + pid}]", fd / "3")
        if version == "v2":
            put(root, f"/proc/{pid}/cgroup", f"0::{cgroup}\n")
            dirs = [f"/sys/fs/cgroup{cgroup}"]
            put(root, f"{dirs[0]}/cgroup.controllers", "cpu memory\n")
        else:
            put(root, f"/proc/{pid}/cgroup", f"5:memory:{cgroup}\n4:cpu,cpuacct:{cgroup}\n0::/\n")
            dirs = [f"/sys/fs/cgroup/{c}{cgroup}" for c in ("cpu", "memory")]
            for c in ("cpu", "memory"):
                put(root, f"/sys/fs/cgroup/{c}/cgroup.procs", "1\n")
        for d in dirs:
            put(root, f"{d}/cgroup.procs", f"{pid}\n")
        for name, value in files.items():
            put(root, f"{dirs[-1]}/{name}", value + "\n")
    put(root, "/proc/net/tcp", HEADER + "".join(rows))
    return root


CONFIG = """
tiers:
  gold: {slo_p99: 120ms, weight: 10, resources: {memory: 4GiB}}
  silver: {slo_p99: 350ms, weight: 5, resources: {memory: 2GiB, memory_high: max}}
  bronze: {slo_p99: 1s, weight: 1, resources: {memory: 1GiB, memory_max: 2GiB}}
tenants:
  - {name: acme, tier: gold, match: {ports: [8000]}}
  - {name: beta, tier: silver, match: {ports: [8001]}}
  - {name: hobby, tier: bronze, match: {ports: [8002]}}
  - {name: spare, tier: gold, match: {ports: [8003]}}
resources: {enabled: true}
"""


def check(tmp_path: Path, root: Path, *extra: str, mode: str = "") -> tuple[int, str, dict]:
    """`qosagent check` in text and --json; `mode`: resources.mode (default: the config's default, dry-run)."""
    cfg = tmp_path / "qosagent.yaml"
    cfg.write_text(CONFIG.replace("resources: {enabled: true}", f"resources: {{enabled: true, mode: {mode}}}")
                   if mode else CONFIG)
    text = run_cli("check", "--config", str(cfg), "--host-root", str(root), *extra)
    js = run_cli("check", "--json", "--config", str(cfg), "--host-root", str(root), *extra)
    assert text.returncode == js.returncode, (text.stderr, js.stderr)
    return text.returncode, text.stdout + text.stderr, json.loads(js.stdout)


def test_check_names_each_v1_group_above_what_it_would_get_and_exits_as_before(tmp_path) -> None:
    """cgroup v1 (this machine's layout): `memory` becomes memory.soft_limit_in_bytes and `memory_max`
    memory.limit_in_bytes, read against memory.usage_in_bytes. Above the soft limit: reclaimed first under node
    pressure; above the hard one: the write is refused."""
    root = host(tmp_path / "host", "v1", {
        10: (8000, "/srv/gold", {"memory.usage_in_bytes": str(5 * GiB + (1 << 29)),
                                 "memory.soft_limit_in_bytes": "9223372036854771712"}),
        11: (8001, "/srv/silver", {"memory.usage_in_bytes": str(GiB)}),  # below its 2GiB: nothing said
        12: (8002, "/srv/bronze", {"memory.usage_in_bytes": str(3 * GiB), "memory.soft_limit_in_bytes": "garbage",
                                   "memory.limit_in_bytes": str(8 * GiB)}),
        13: (8003, "/srv/spare", {"memory.usage_in_bytes": "max"}),
    })
    rc, out, js = check(tmp_path, root)
    assert rc == 0, out  # warnings: exit status as the verdicts make it
    lines = [line for line in out.splitlines() if line.startswith("resources ") and "/srv/" in line]
    assert len(lines) == 3, out
    bronze, gold, spare = lines  # in cgroup order
    # resources.mode is dry-run (the default): nothing would be written, so the limits are enforce's.
    assert ("tier gold: /sys/fs/cgroup/memory/srv/gold (memory v1): memory.usage_in_bytes 5.5GiB, above the "
            "memory.soft_limit_in_bytes 4GiB it would get (in enforce) by 1.5GiB (now max): reclaimed first when the "
            "node runs short of memory (no throttle, no kill)") in gold, gold
    assert "memory.soft_limit_in_bytes 1GiB it would get (in enforce) by 2GiB (now 'garbage', not a size)" in bronze
    assert "memory.limit_in_bytes 2GiB it would get (in enforce) by 1GiB (now 8GiB): the write is refused (EBUSY) " \
           "unless reclaim brings it under" in bronze, bronze
    assert "tier gold: /sys/fs/cgroup/memory/srv/spare (memory v1): cannot tell whether it is above the limits it " \
           "would get (in enforce): memory.usage_in_bytes reads 'max', not a byte count" in spare, spare
    assert [f["text"] for f in js["findings"]["resources"]] == [line[len("resources    "):] for line in lines]
    found = {f["cgroup"]: f for f in js["findings"]["resources"]}
    assert {f["mode"] for f in found.values()} == {"dry-run"}
    assert set(found) == {"/srv/gold", "/srv/bronze", "/srv/spare"}
    assert found["/srv/gold"]["usage_bytes"] == 5 * GiB + (1 << 29)
    assert [(a["file"], a["limit_bytes"]) for a in found["/srv/gold"]["above"]] == [
        ("memory.soft_limit_in_bytes", 4 * GiB)]
    assert found["/srv/spare"]["usage_bytes"] is None and "max" in found["/srv/spare"]["error"]
    assert js["capabilities"]["resources"]["state"] in ("active", "degraded")
    rc_strict, _, _ = check(tmp_path, root, "--strict")
    assert rc_strict == run_cli("check", "--strict", "--host-root", str(root)).returncode, \
        "--strict exits for capabilities that cannot run, as without the groups above"


def test_check_on_cgroup_v2_reads_memory_current_against_memory_high(tmp_path) -> None:
    root = host(tmp_path / "host", "v2", {
        10: (8000, "/srv/gold", {"memory.current": str(6 * GiB), "memory.high": "max"}),
        11: (8001, "/srv/silver", {"memory.current": str(8 * GiB)}),  # memory_high: max, no throttle to be above
        12: (8002, "/srv/bronze", {}),  # no memory.current at all
    })
    rc, out, js = check(tmp_path, root, mode="enforce")
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith("resources ") and "/srv/" in line]
    assert len(lines) == 2 and "(in enforce)" not in out, out
    assert ("tier gold: /sys/fs/cgroup/srv/gold (memory v2): memory.current 6GiB, above the memory.high 4GiB it "
            "would get by 2GiB (now max): throttled from the first write") in lines[1], lines[1]
    assert ("tier bronze: /sys/fs/cgroup/srv/bronze (memory v2): cannot tell whether it is above the limits it "
            "would get: memory.current cannot be read") in lines[0], lines[0]
    assert [(f["cgroup"], f["mode"]) for f in js["findings"]["resources"]] == [("/srv/bronze", "enforce"),
                                                                               ("/srv/gold", "enforce")]


def test_nothing_above_says_nothing(tmp_path) -> None:
    root = host(tmp_path / "host", "v2", {10: (8000, "/srv/gold", {"memory.current": str(GiB)})})
    rc, out, js = check(tmp_path, root)
    assert rc == 0 and "FOUND" not in out and js["findings"] == {}, out


GROUP = Group("memory", "v2", "/app", "/sys/fs/cgroup/app", ("gold",), (10,), "ok")


@pytest.mark.parametrize("usage, says", [
    (None, "memory.current cannot be read"),
    ("", "memory.current reads '', not a byte count"),
    ("-5", "memory.current reads '-5', not a byte count"),
    ("12 34", "memory.current reads '12 34', not a byte count"),
    ("max", "memory.current reads 'max', not a byte count"),
    ("x" * 100, "reads 'xxxxxxxxxxxxxxxxxxxxxxxx', not a byte count"),
    ("12²", "memory.current reads '12\\xb2', not a byte count"),
    (b"\xff\xfe1", "memory.current reads '\\ufffd\\ufffd1', not a byte count"),  # not UTF-8: replaced, said
])
def test_a_use_that_cannot_be_read_is_said_never_raised(tmp_path, usage: str | bytes | None, says: str) -> None:
    d = tmp_path / "sys/fs/cgroup/app"
    d.mkdir(parents=True)
    if isinstance(usage, bytes):
        (d / "memory.current").write_bytes(usage)
    elif usage is not None:
        (d / "memory.current").write_text(usage)
    found = memory_check(HostFS(tmp_path), GROUP, {"memory.min": "4096", "memory.high": "4096"})
    assert found is not None and found.usage is None and says in found.line(), found


@pytest.mark.parametrize("now, shown", [
    ("max", "max"), ("9223372036854771712", "max"), (str(3 * GiB), "3GiB"), (None, "unreadable"),
    ("bogus", "'bogus', not a size"), ("²", "'\\xb2', not a size"),
])
def test_the_limit_in_force_is_shown_whatever_it_reads(tmp_path, now: str | None, shown: str) -> None:
    d = tmp_path / "sys/fs/cgroup/app"
    d.mkdir(parents=True)
    (d / "memory.current").write_text(f"{2 * GiB}\n")
    if now is not None:
        (d / "memory.high").write_text(now + "\n")
    found = memory_check(HostFS(tmp_path), GROUP, {"memory.high": str(GiB)})
    assert found is not None and f"(now {shown})" in found.line(), found.line()


def test_below_at_or_without_a_limit_is_nothing(tmp_path) -> None:
    d = tmp_path / "sys/fs/cgroup/app"
    d.mkdir(parents=True)
    (d / "memory.current").write_text(f"{GiB}\n")
    fs = HostFS(tmp_path)
    assert memory_check(fs, GROUP, {"memory.high": str(GiB)}) is None  # at it is not above it
    assert memory_check(fs, GROUP, {"memory.min": "4096", "memory.high": "max"}) is None  # a guarantee, no limit
    assert memory_check(fs, GROUP, {}) is None
    cpu = Group("cpu", "v2", "/app", "/sys/fs/cgroup/app", ("gold",), (10,), "ok")
    assert memory_check(fs, cpu, {"memory.high": "4096"}) is None


def test_sizes_as_the_kernel_reports_them() -> None:
    assert [approx_size(n) for n in (0, 1023, 4096, 6 * GiB, 5 * GiB + 4096, (1 << 20) + 1, 1 << 40)] == [
        "0B", "1023B", "4KiB", "6GiB", "5.0GiB", "1.0MiB", "1TiB"]


def test_the_agent_says_the_same_at_its_first_write_of_a_v1_limit(tmp_path, caplog) -> None:
    """The applier's warning is check's line ("it gets"), at the first write of each limit only."""
    d = tmp_path / "sys/fs/cgroup/memory/app"
    d.mkdir(parents=True)
    for f, v in {"memory.soft_limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": str(3 * GiB)}.items():
        (d / f).write_text(v + "\n")
    a = Applier(HostFS(tmp_path), Store(str(tmp_path / "state")), {k: collections.Counter()
                                                                   for k in ("writes", "errors")})
    g = Group("memory", "v1", "/app", "/sys/fs/cgroup/memory/app", ("gold",), (10,), "ok")
    a.files(Files(g, (("memory.soft_limit_in_bytes", str(GiB)),)))
    said = [r.getMessage() for r in caplog.records if "above the" in r.getMessage()]
    assert said == ["tier gold: /sys/fs/cgroup/memory/app (memory v1): memory.usage_in_bytes 3GiB, above the "
                    "memory.soft_limit_in_bytes 1GiB it gets by 2GiB (now max): reclaimed first when the node runs "
                    "short of memory (no throttle, no kill)"], said
    caplog.clear()
    a.files(Files(g, (("memory.soft_limit_in_bytes", str(2 * GiB)),)))
    assert not [r for r in caplog.records if "above the" in r.getMessage()], "once, at the first write"
