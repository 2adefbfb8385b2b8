"""What this host offers, read once through HostFS; capabilities decide from it what they can use.

Probing never changes the host: a filesystem that is not mounted is reported as mountable, not mounted.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any

from qosagent import cgroups, cpufreq
from qosagent.ebpf.loader import headers_present
from qosagent.hostfs import HostFS, mount_types

TRACEFS = "/sys/kernel/tracing"
BPFFS = "/sys/fs/bpf"

# Tracepoints the agent may use, by tracefs group/name.
TRACEPOINTS = (
    "sock/inet_sock_set_state",
    "sock/sock_recv_length",
    "sock/sock_send_length",
    "sock/sk_data_ready",
    "sched/sched_wakeup",
    "sched/sched_wakeup_new",
    "sched/sched_switch",
)

# Kernel functions the latency capability's kprobe fallback (kernels before 6.4) attaches to, by name in kallsyms.
KPROBE_FUNCTIONS = ("tcp_cleanup_rbuf", "tcp_sendmsg", "sock_def_readable")


@dataclass
class Features:
    kernel: str = ""
    btf: bool = False
    kernel_headers: bool = False
    tracefs: str = "absent"  # mounted | mountable | absent
    bpffs: str = "absent"
    tracepoints: dict[str, bool] = field(default_factory=dict)
    kprobes: bool = False
    kprobe_functions: dict[str, bool] = field(default_factory=dict)  # KPROBE_FUNCTIONS found in kallsyms
    cls_bpf: bool = False
    clsact: bool = False
    tcx: bool = False
    cgroup2: str = ""  # where the cgroup v2 hierarchy is mounted, "" when it is not
    sockops_sendmsg: bool = False  # sock_ops' per-socket sendmsg callback (BPF_SOCK_OPS_TSTAMP_SENDMSG_CB, >= 6.15)
    cpufreq: dict[str, dict[str, str]] = field(default_factory=dict)  # policy -> driver, governor
    thermal_zones: dict[str, str] = field(default_factory=dict)  # zone -> type
    hwmon: dict[str, str] = field(default_factory=dict)  # hwmonN -> name
    numa_nodes: list[int] = field(default_factory=list)
    pci_gpus: list[str] = field(default_factory=list)  # sysfs bus ids
    nvml: str = "not probed"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def has_tracepoint(self, name: str) -> bool:
        return self.tracepoints.get(name, False)


def _kallsyms(fs: HostFS, names: tuple[str, ...]) -> set[str]:
    """Those of names the kernel has a symbol of. One search of the text per name: a set of all of its ~200,000
    names took 0.1 s, most of start's time on a warm restart after the imports."""
    # Addresses read as zeros without CAP_SYSLOG, which does not matter here. A module's symbol is followed by a tab
    # and the module's name, any other by the end of its line.
    text = (fs.try_read("/proc/kallsyms") or "") + "\n"
    return {n for n in names if f" {n}\n" in text or f" {n}\t" in text}


def _btf_strings(fs: HostFS) -> bytes:
    try:
        with open(fs.path("/sys/kernel/btf/vmlinux"), "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _filesystems(fs: HostFS) -> set[str]:
    text = fs.try_read("/proc/filesystems") or ""
    return {line.split()[-1] for line in text.splitlines() if line.strip()}


def probe(fs: HostFS, nvml_state: str = "not probed") -> Features:
    on_host = str(fs.root) == "/"
    f = Features(kernel=platform.release() if on_host else (fs.try_read("/proc/sys/kernel/osrelease") or ""))
    f.btf = fs.exists("/sys/kernel/btf/vmlinux")
    # BCC compiles against headers at this real path (a DaemonSet mounts /lib/modules at the same place).
    f.kernel_headers = headers_present()
    mounts = mount_types(fs)
    known = _filesystems(fs)
    for attr, path, fstype in (("tracefs", TRACEFS, "tracefs"), ("bpffs", BPFFS, "bpf")):
        if mounts.get(path) == fstype:
            setattr(f, attr, "mounted")
        elif fstype in known:
            setattr(f, attr, "mountable")
    syms = _kallsyms(fs, ("register_kprobe", *KPROBE_FUNCTIONS, "cls_bpf_classify", "clsact_init", "ingress_init",
                           "tcx_prog_attach"))
    btf_names = _btf_strings(fs) if f.btf else b""
    for tp in TRACEPOINTS:
        name = tp.split("/", 1)[1]
        # With tracefs unmounted, BTF still tells: every tracepoint has a btf_trace_<name> typedef.
        f.tracepoints[tp] = fs.exists(f"{TRACEFS}/events/{tp}") or b"\0btf_trace_" + name.encode() + b"\0" in btf_names
    # The enumerator's name is in the running kernel's BTF strings exactly when its sock_ops has that callback.
    f.sockops_sendmsg = b"\0BPF_SOCK_OPS_TSTAMP_SENDMSG_CB\0" in btf_names
    f.cgroup2 = cgroups.cgroup2_mount(fs) or ""
    f.kprobes = fs.exists("/sys/bus/event_source/devices/kprobe") or "register_kprobe" in syms
    f.kprobe_functions = {fn: fn in syms for fn in KPROBE_FUNCTIONS}
    f.cls_bpf = "cls_bpf_classify" in syms or _module_file(fs, f.kernel, "net/sched/cls_bpf.ko")
    f.clsact = "clsact_init" in syms or "ingress_init" in syms or _module_file(fs, f.kernel, "net/sched/sch_ingress.ko")
    f.tcx = "tcx_prog_attach" in syms
    # The policies as dvfs will see them (names included), so check and run never disagree.
    for pol in cpufreq.discover(fs):
        f.cpufreq[pol.name] = {"driver": pol.driver, "governor": pol.governor}
    for zone in fs.glob("/sys/class/thermal", "thermal_zone*"):
        f.thermal_zones[zone.rsplit("/", 1)[1]] = fs.try_read(f"{zone}/type") or "unknown"
    for chip in fs.glob("/sys/class/hwmon", "hwmon*"):
        f.hwmon[chip.rsplit("/", 1)[1]] = fs.try_read(f"{chip}/name") or "unknown"
    f.numa_nodes = sorted(
        int(n[len("node"):]) for n in fs.listdir("/sys/devices/system/node") if n.startswith("node") and n[4:].isdigit()
    )
    for dev in fs.glob("/sys/bus/pci/devices", "*"):
        vendor = (fs.try_read(f"{dev}/vendor") or "").lower()
        klass = fs.try_read(f"{dev}/class") or ""
        if vendor == "0x10de" and klass.startswith(("0x03", "0x12")):
            f.pci_gpus.append(dev.rsplit("/", 1)[1])
    f.nvml = nvml_state
    return f


def _module_file(fs: HostFS, kernel: str, rel: str) -> bool:
    base = f"/lib/modules/{kernel}/kernel/{rel}"
    return any(fs.exists(base + ext) for ext in ("", ".xz", ".zst", ".gz"))


def ensure_mounted(fs: HostFS) -> list[str]:
    """Mount tracefs, bpffs and the cgroup v2 hierarchy where they are missing; returns what was mounted. Needs
    CAP_SYS_ADMIN."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    mounts = mount_types(fs)
    done = []
    cgroup2 = cgroups.cgroup2_mount_target(fs, mounts)
    for path, fstype in [(TRACEFS, "tracefs"), (BPFFS, "bpf")] + ([(cgroup2, "cgroup2")] if cgroup2 else []):
        if mounts.get(path) == fstype:
            continue
        target = str(fs.path(path))
        if libc.mount(fstype.encode(), target.encode(), fstype.encode(), 0, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")
        done.append(path)
    return done
