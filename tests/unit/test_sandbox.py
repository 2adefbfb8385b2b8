"""The sandbox each capability needs: the drop-in `qosagent check --systemd` prints matches the capabilities a
config enables, the shipped unit grants exactly BASE, and a sandbox that refuses a need is named in the reason."""

from __future__ import annotations

import pytest

from qosagent import capabilities, sandbox
from qosagent.config import Config, parse
from qosagent.hostfs import HostFS
from tests.conftest import REPO

UNIT = REPO / "systemd" / "qosagent.service"
ALL = {
    "latency": {"enabled": True},
    "quota": {"enabled": True},
    "placement": {"enabled": True, "mode": "enforce", "selectors": [{"name": "vllm"}]},
    "dvfs": {"enabled": True, "mode": "enforce"},
}


@pytest.fixture(autouse=True)
def mainline_perf_events(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernel.perf_event_paranoid at mainline's default (2): what a Debian kernel's 3 adds is tested on its own."""
    level = tmp_path / "perf_event_paranoid"
    level.write_text("2\n")
    monkeypatch.setattr(sandbox, "PERF_PARANOID", str(level))


UNIT_CAPS = set(sandbox.BASE["CapabilityBoundingSet"])
# What the unit granted before CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH: the kernel refused it every container's and
# every other user's /proc/PID/ns/net and /proc/PID/fd, and the scans took each refusal for a process gone.
WITHOUT_PROC_READS = {"CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN"}


def dropin(cfg: Config) -> str:
    return sandbox.dropin(capabilities.sandbox_needs(cfg))


def needs(name: str, cfg: Config) -> list[sandbox.Need]:
    return capabilities.sandbox_needs(cfg).get(name, [])


def dropin_settings(text: str) -> dict[str, set[str]]:
    return {k: {v for value in vs for v in value.split()} for k, vs in sandbox.unit_settings(text).items()}


def test_the_shipped_unit_grants_exactly_base() -> None:
    unit = sandbox.unit_settings(UNIT.read_text())
    for setting, values in sandbox.BASE.items():
        got = {v for v in sandbox.granted_by(unit, setting)}
        if setting == "RequiresMountsFor":
            assert values <= got, (setting, got)
        else:
            assert got == values, (setting, got)


def test_the_default_config_needs_no_drop_in() -> None:
    """The shipped unit is made for the shipped config (latency, measuring)."""
    assert dropin(parse({}, "test")) == ""


@pytest.mark.parametrize("enabled", [(), ("quota",), ("placement",), ("dvfs",), ("quota", "placement", "dvfs")])
def test_the_drop_in_grants_what_the_enabled_capabilities_need(enabled: tuple[str, ...]) -> None:
    cfg = parse({k: v for k, v in ALL.items() if k == "latency" or k in enabled}, "test")
    text = dropin(cfg)
    got = dropin_settings(text)
    caps = got.get("CapabilityBoundingSet", set())
    rw = got.get("ReadWritePaths", set())
    assert ("CAP_SYS_NICE" in caps) == ("placement" in enabled)
    assert ("/sys/fs/bpf" in rw) == ("/sys/fs/bpf" in got.get("RequiresMountsFor", set())) == ("quota" in enabled)
    assert ("sys-fs-bpf.mount" in got.get("After", set())) == ("quota" in enabled)
    assert ({"-/sys/devices/system/cpu/cpufreq", "-/sys/devices/system/cpu/intel_pstate"} <= rw) == \
        ("dvfs" in enabled)
    # Nothing the shipped unit grants already, and each capability named above its lines.
    assert not caps & sandbox.BASE["CapabilityBoundingSet"]
    for cap in enabled:
        assert f"# {cap}\n" in text
    assert (text == "") == (not enabled)
    if text:
        # Mount dependencies are [Unit] settings, the rest [Service] ones (systemd ignores a key in the wrong one).
        unit, _, service = text.partition("[Service]\n")
        assert ("RequiresMountsFor=" in unit.partition("[Unit]\n")[2]) == ("quota" in enabled)
        assert "RequiresMountsFor" not in service and ("CAP_" in service) == ("placement" in enabled)


def test_observe_and_dry_run_need_less() -> None:
    cfg = parse({"placement": {**ALL["placement"], "mode": "dry-run"}, "dvfs": {"enabled": True}}, "test")
    got = dropin_settings(dropin(cfg))
    # Reading numa_maps, not pinning: CAP_SYS_PTRACE, which the unit grants (pods' namespaces need it too).
    assert {n.value for n in needs("placement", cfg) if n.setting == "CapabilityBoundingSet"} == {"CAP_SYS_PTRACE"}
    assert "CapabilityBoundingSet" not in got
    assert "ReadWritePaths" not in got  # dvfs in dry-run writes nothing


def test_a_pin_root_or_state_dir_elsewhere_is_made_writable() -> None:
    cfg = parse({"quota": {"enabled": True}, "bpf": {"pin_root": "/run/bpf/qos"},
                 "placement": ALL["placement"], "state_dir": "/var/lib/qosagent"}, "test")
    rw = dropin_settings(dropin(cfg))["ReadWritePaths"]
    assert {"/run/bpf/qos", "/var/lib/qosagent"} <= rw


def sandboxed(caps: set[str], readonly: tuple[str, ...] = (), mounts: dict[str, str] | None = None,
              systemd: bool = True) -> sandbox.Process:
    mounts = {"/sys/fs/bpf": "bpf", "/sys/kernel/tracing": "tracefs"} if mounts is None else mounts
    return sandbox.Process(effective=lambda: frozenset(caps),
                           writable=lambda p: not any(p == r or p.startswith(r + "/") for r in readonly),
                           mounted=mounts.get, under_systemd=systemd)


def test_a_unit_that_drops_a_capability_is_named() -> None:
    cfg = parse(ALL, "test")
    proc = sandboxed(UNIT_CAPS)
    why = sandbox.refusal(needs("placement", cfg), proc)
    assert why is not None and "the unit's CapabilityBoundingSet lacks CAP_SYS_NICE" in why
    assert "qosagent check --systemd" in why
    assert sandbox.refusal(needs("latency", cfg), proc) is None
    bare = sandboxed({"CAP_BPF"}, systemd=False)
    why_bare = sandbox.refusal(needs("latency", cfg), bare) or ""
    assert "this process's CapabilityBoundingSet lacks CAP_PERFMON" in why_bare


def test_a_read_only_sys_and_a_missing_bpffs_are_named() -> None:
    cfg = parse(ALL, "test")
    caps = UNIT_CAPS
    ro = sandbox.refusal(needs("quota", cfg), sandboxed(caps, readonly=("/sys",)))
    assert ro is not None and "ReadOnlyPaths=/sys without ReadWritePaths=/sys/fs/bpf" in ro
    missing = sandbox.refusal(needs("quota", cfg), sandboxed(caps, mounts={"/sys/kernel/tracing": "tracefs"}))
    assert missing is not None and "no bpf mounted at /sys/fs/bpf" in missing and "RequiresMountsFor" in missing
    assert sandbox.refusal(needs("quota", cfg), sandboxed(caps)) is None


def test_not_root_is_left_to_each_capabilitys_probe() -> None:
    proc = sandbox.Process(effective=lambda: None, writable=lambda p: False, mounted=lambda p: None,
                           under_systemd=True)
    assert sandbox.refusal(needs("quota", parse(ALL, "test")), proc) is None


def test_capabilities_and_mounts_read_from_proc() -> None:
    status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000000c000801000\n"
    assert sandbox.caps_from_status(status) == {"CAP_NET_ADMIN", "CAP_SYS_NICE", "CAP_PERFMON", "CAP_BPF"}
    mounts = "sysfs /sys sysfs rw 0 0\nnone /sys/fs/bpf bpf rw 0 0\n"
    assert sandbox.mount_type(mounts, "/sys/fs/bpf") == "bpf" and sandbox.mount_type(mounts, "/sys/fs") is None


def test_resources_in_enforce_needs_nice_and_the_cgroup_tree() -> None:
    """The shipped unit's ProtectControlGroups=yes keeps /sys/fs/cgroup read-only whatever ReadWritePaths= says
    (systemd drops the read-write entry for the same path as the weaker one): the drop-in turns it off too."""
    cfg = parse({"resources": {"enabled": True, "mode": "enforce"}}, "test")
    got = dropin_settings(dropin(cfg))
    assert got["CapabilityBoundingSet"] == {"CAP_SYS_NICE"} and got["ReadWritePaths"] == {"/sys/fs/cgroup"}
    assert got["ProtectControlGroups"] == {"no"}
    assert sandbox.unit_settings(UNIT.read_text())["ProtectControlGroups"] == ["yes"]
    assert dropin(parse({"resources": {"enabled": True}}, "test")) == "", "dry-run writes nothing"
    ro = sandbox.refusal(needs("resources", cfg), sandboxed(POD_CAPS, readonly=("/sys/fs/cgroup",)))
    assert ro is not None and "ProtectControlGroups=yes" in ro and "ReadWritePaths=/sys/fs/cgroup" in ro
    assert sandbox.refusal(needs("resources", cfg), sandboxed(POD_CAPS)) is None


def hybrid_tree(tmp_path) -> HostFS:
    """A hybrid host: v1 cpu and memory hierarchies (and a controller-less cgroup2) under /sys/fs/cgroup's tmpfs."""
    cg = tmp_path / "sys/fs/cgroup"
    for kind in ("cpu", "memory", "systemd"):
        (cg / kind).mkdir(parents=True)
        (cg / kind / "cgroup.procs").write_text("1\n")
    (cg / "unified").mkdir()
    (cg / "unified/cgroup.controllers").write_text("\n")
    return HostFS(tmp_path)


def test_v1_hierarchies_are_checked_not_the_read_only_tmpfs_above_them(tmp_path) -> None:
    """systemd mounts /sys/fs/cgroup's tmpfs read-only on hybrid and legacy hosts; the v1 hierarchies below it,
    which resources writes, are writable mounts of their own: resources is not refused, and where one hierarchy is
    read-only it is the one named."""
    cfg = parse({"resources": {"enabled": True, "mode": "enforce"}}, "test")
    host = hybrid_tree(tmp_path)
    tmpfs = str(tmp_path / "sys/fs/cgroup")

    def proc(readonly: set[str]) -> sandbox.Process:
        return sandbox.Process(effective=lambda: frozenset(POD_CAPS), writable=lambda p: p not in readonly,
                               mounted=lambda p: None, under_systemd=True)

    assert sandbox.refusal(needs("resources", cfg), proc({tmpfs}), host) is None
    why = sandbox.refusal(needs("resources", cfg), proc({tmpfs, f"{tmpfs}/memory"}), host)
    assert why is not None and why.startswith(f"{tmpfs}/memory is read-only here"), why
    assert f"{tmpfs}/cpu " not in why and "ProtectControlGroups=yes" in why


POD_CAPS = UNIT_CAPS | {"CAP_SYS_NICE"}  # the DaemonSet's base with components/placement (resources in enforce)


def host_tree(tmp_path) -> HostFS:
    """A host root (the DaemonSet's /host) with the host files dvfs and resources write."""
    for d in ("sys/fs/cgroup", "sys/devices/system/cpu/cpufreq"):
        (tmp_path / d).mkdir(parents=True)
    return HostFS(tmp_path)


@pytest.mark.parametrize("name", ["resources", "dvfs"])
def test_host_files_are_checked_under_the_host_root(tmp_path, name: str) -> None:
    """In a pod the container's own /sys is read-only while the host's, mounted at /host/sys, may be writable: the
    agent writes cgroup and cpufreq files there, so that is where they are checked, and named."""
    cfg = parse({name: {"enabled": True, "mode": "enforce"}}, "test")
    host = host_tree(tmp_path)
    own_sys_ro = sandboxed(POD_CAPS, readonly=("/sys",), systemd=False)
    assert sandbox.refusal(needs(name, cfg), own_sys_ro, host) is None
    host_sys_ro = sandboxed(POD_CAPS, readonly=(str(tmp_path / "sys"),), systemd=False)
    why = sandbox.refusal(needs(name, cfg), host_sys_ro, host)
    assert why is not None and f"{tmp_path}/sys/" in why and " /sys/" not in why, why
    assert "components/writable-sys" in why
    # Under systemd the unit's settings are named, not the component.
    unit = sandbox.refusal(needs(name, cfg), sandboxed(POD_CAPS, readonly=(str(tmp_path / "sys"),)), host)
    assert unit is not None and "ReadOnlyPaths=/sys without ReadWritePaths=" in unit and "writable-sys" not in unit


def test_the_agents_own_paths_are_not_under_the_host_root(tmp_path) -> None:
    """Pins and the state dir are the agent's own (bpffs mounted into the container, its /run/qosagent): a
    read-only host /sys refuses neither, a read-only own one does."""
    cfg = parse({"quota": {"enabled": True}, "state_dir": "/var/lib/qosagent"}, "test")
    host = host_tree(tmp_path)
    caps = POD_CAPS - {"CAP_SYS_NICE"}
    assert sandbox.refusal(needs("quota", cfg), sandboxed(caps, readonly=(str(tmp_path),), systemd=False),
                           host) is None
    why = sandbox.refusal(needs("quota", cfg), sandboxed(caps, readonly=("/sys",), systemd=False), host)
    assert why is not None and "/sys/fs/bpf is read-only here" in why and "writable-sys" not in why


@pytest.mark.parametrize("level", ["3", "4"])
def test_perf_events_above_paranoid_2_need_sys_admin(tmp_path, monkeypatch: pytest.MonkeyPatch, level: str) -> None:
    """Debian's and Ubuntu's kernels refuse perf_event_open to all but CAP_SYS_ADMIN above level 2 (3 is Debian's
    default): latency, which attaches its tracepoints and kprobes through it, needs CAP_SYS_ADMIN there; the drop-in
    grants it under latency's name with the reason, and a unit without it is named, with the other way out."""
    (tmp_path / "perf_event_paranoid").write_text(f"{level}\n")
    text = dropin(parse({}, "test"))
    assert "# latency\nCapabilityBoundingSet=CAP_SYS_ADMIN\n" in text
    why = sandbox.refusal(needs("latency", parse({}, "test")), sandboxed(set(sandbox.BASE["CapabilityBoundingSet"])))
    assert why is not None
    assert "the unit's CapabilityBoundingSet lacks CAP_SYS_ADMIN" in why
    assert f"kernel.perf_event_paranoid is {level} here" in why and "set it to 2 in /etc/sysctl.d" in why
    # Quota opens no perf events: its needs are the same at any level.
    assert not [n for n in needs("quota", parse({"quota": {"enabled": True}}, "test")) if n.value == "CAP_SYS_ADMIN"]


def test_perf_events_at_mainline_levels_need_nothing_more() -> None:
    assert not [n for n in needs("latency", parse({}, "test")) if n.value == "CAP_SYS_ADMIN"]


@pytest.mark.parametrize("name,config,lacks", [
    ("latency", {}, {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}),  # auto may choose sockops, which reads fds
    ("latency", {"latency": {"mode": "tracepoint"}}, {"CAP_SYS_PTRACE"}),
    ("quota", {"quota": {"enabled": True}}, {"CAP_SYS_PTRACE"}),
    ("servers", {}, {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}),
    ("resources", {"resources": {"enabled": True}}, {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}),  # dry-run reads too
])
def test_reading_other_processes_proc_needs_ptrace_and_for_fds_dac_read_search(name: str, config: dict,
                                                                               lacks: set[str]) -> None:
    """Following pods reads other processes' /proc/PID/ns/net, finding who listens their /proc/PID/fd: the kernel's
    ptrace read check refuses both without CAP_SYS_PTRACE for every container's and other user's process, and fd
    without CAP_DAC_READ_SEARCH besides (mode 0500). The unit's old set is refused, naming what it lacks; the
    shipped unit grants both, so the default config still needs no drop-in."""
    cfg = parse(config, "test")
    why = sandbox.refusal(needs(name, cfg), sandboxed(WITHOUT_PROC_READS)) or ""
    for cap in {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}:
        assert (f"the unit's CapabilityBoundingSet lacks {cap}" in why) == (cap in lacks), why
    assert sandbox.refusal(needs(name, cfg), sandboxed(UNIT_CAPS)) is None
    assert not [line for line in dropin(cfg).splitlines() if "PTRACE" in line or "DAC_READ_SEARCH" in line]


def test_quota_without_namespaces_reads_no_other_process() -> None:
    cfg = parse({"quota": {"enabled": True, "namespaces": False}}, "test")
    assert sandbox.refusal(needs("quota", cfg), sandboxed(WITHOUT_PROC_READS)) is None
