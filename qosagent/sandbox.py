"""Whether this process has what a capability needs from the sandbox it runs in (the systemd unit, a container), and
the unit drop-in that grants what the shipped unit does not. Each capability says what it needs
(`Capability.sandbox_needs`); this module knows none of them.

The shipped unit (systemd/qosagent.service) grants what the default config needs: latency, measuring only
(`BASE`). Every other capability's needs are relaxations of that sandbox, granted per capability by a drop-in that
`qosagent check --systemd` prints for a config and `make install` writes for the installed one. An enabled
capability whose need this process lacks is unavailable, its reason naming the unit setting that refuses it, so
`/readyz` says not ready instead of the capability failing later at a write.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from qosagent.hostfs import HostFS

if TYPE_CHECKING:
    from qosagent.config import Config

DROPIN = "/etc/systemd/system/qosagent.service.d/capabilities.conf"


@dataclass(frozen=True)
class Need:
    setting: str  # the unit setting that grants it
    value: str  # a capability (CAP_SYS_NICE), a path (- prefix: only where it exists), a mount point, a switch (no)
    why: str
    # A host file the agent writes through its host root (HostFS, --host-root: /host/sys in the DaemonSet), so checked
    # there; False for what the agent writes in its own mount namespace (its state dir, its pins on bpffs).
    host: bool = False
    # For a path: the mounts below it that the capability writes on this host, each checked in its place (a v1 cgroup
    # hierarchy is a writable mount of its own under the tmpfs systemd mounts read-only at /sys/fs/cgroup); None,
    # or none found there, checks the path itself.
    within: Callable[[HostFS], Sequence[str]] | None = None


# What the shipped unit itself grants; tests/unit/test_sandbox.py checks it against systemd/qosagent.service.
BASE: dict[str, frozenset[str]] = {
    "CapabilityBoundingSet": frozenset({"CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN", "CAP_SYS_PTRACE",
                                        "CAP_DAC_READ_SEARCH"}),
    "ReadWritePaths": frozenset({"/run/qosagent"}),
    "RequiresMountsFor": frozenset({"/sys/kernel/tracing"}),
}
CGROUP_FS = "/sys/fs/cgroup"
CPUFREQ = ("-/sys/devices/system/cpu/cpufreq", "-/sys/devices/system/cpu/intel_pstate")


def state_dir(cfg: "Config") -> list[Need]:
    """Originals saved for a rollback after a crash; the unit's RuntimeDirectory is writable already."""
    if _under(cfg.state_dir, "/run/qosagent"):
        return []
    return [Need("ReadWritePaths", cfg.state_dir, "originals saved for the rollback (state_dir)")]


def other_processes(why: str, fds: bool) -> list[Need]:
    """What reading other processes' /proc entries needs of a root agent (hostfs.PROC_NEEDS): CAP_SYS_PTRACE for
    their network namespaces (/proc/PID/ns/net: pods followed), and with `fds` CAP_DAC_READ_SEARCH besides for their
    open sockets (/proc/PID/fd: who listens on a port). Without them the reads of every container's and every other
    user's process are refused, and counted (qosagent_proc_unreadable_total)."""
    caps = ["CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"] if fds else ["CAP_SYS_PTRACE"]
    return [Need("CapabilityBoundingSet", c, why) for c in caps]


PERF_PARANOID = "/proc/sys/kernel/perf_event_paranoid"


def perf_events(why: str) -> list[Need]:
    """What opening perf events (tracepoints, kprobes) needs beyond CAP_PERFMON on this host: nothing where
    kernel.perf_event_paranoid is at most 2, mainline's highest level; CAP_SYS_ADMIN above it, where Debian's and
    Ubuntu's kernels (3 is Debian's default) refuse perf_event_open to everyone else with EACCES, CAP_PERFMON or not.
    Setting it to 2 (a file in /etc/sysctl.d) is the other way, and leaves this need out."""
    level = _read(PERF_PARANOID).strip()
    if not (level.lstrip("-").isdigit() and int(level) > 2):
        return []
    return [Need("CapabilityBoundingSet", "CAP_SYS_ADMIN",
                 f"{why}: kernel.perf_event_paranoid is {level} here, above 2 only CAP_SYS_ADMIN may; "
                 "or set it to 2 in /etc/sysctl.d")]


def bpffs_of(pin_root: str) -> str:
    return "/sys/fs/bpf" if _under(pin_root, "/sys/fs/bpf") else pin_root


def _under(path: str, top: str) -> bool:
    return os.path.normpath(path) == top or os.path.normpath(path).startswith(top.rstrip("/") + "/")


UNIT_SECTION = ("RequiresMountsFor",)  # the rest are [Service] settings


def dropin(needs: dict[str, list[Need]]) -> str:
    """The drop-in granting what the enabled capabilities need (each one's `Capability.sandbox_needs`, by its name)
    beyond the shipped unit, each group of lines under the capability that needs it; empty when the shipped unit is
    enough."""
    sections: dict[str, list[str]] = {"Unit": [], "Service": []}
    for cap, ns in needs.items():
        by_setting: dict[str, list[Need]] = {}
        for n in ns:
            if not _granted(n):
                by_setting.setdefault(n.setting, []).append(n)
        for section in sections:
            lines = []
            for setting, group in by_setting.items():
                if (setting in UNIT_SECTION) != (section == "Unit"):
                    continue
                lines.append(f"{setting}={' '.join(n.value for n in group)}")
                if setting == "RequiresMountsFor":
                    lines.append(f"After={' '.join(_mount_unit(n.value) for n in group)}")
            if lines:
                sections[section] += [f"# {cap}", *lines]
    if not any(sections.values()):
        return ""
    return ("# qosagent: what this config's capabilities need beyond the shipped unit (`qosagent check --systemd`).\n"
            f"# Install as {DROPIN},\n# then `systemctl daemon-reload && systemctl restart qosagent`.\n"
            + "".join(f"[{name}]\n" + "\n".join(lines) + "\n" for name, lines in sections.items() if lines))


def _granted(n: Need) -> bool:
    return n.value in BASE.get(n.setting, frozenset())


def _mount_unit(path: str) -> str:
    """systemd's mount unit name for a path (/sys/fs/bpf -> sys-fs-bpf.mount)."""
    return path.strip("/").replace("-", "\\x2d").replace("/", "-") + ".mount"


@dataclass(frozen=True)
class Process:
    """What this process may do, read from itself: its effective capabilities, whether it may write a path, which
    filesystems are mounted where. A seam so that tests can describe a sandbox."""

    effective: Callable[[], frozenset[str] | None]
    writable: Callable[[str], bool]
    mounted: Callable[[str], str | None]  # the filesystem type mounted at exactly this path, or None
    under_systemd: bool


def this_process() -> Process:
    return Process(effective=_effective_caps, writable=_writable, mounted=_mounted,
                   under_systemd="INVOCATION_ID" in os.environ)


def refusal(needs: list[Need], proc: Process | None = None, hostfs: HostFS | None = None) -> str | None:
    """Why the sandbox refuses a capability what it needs (its `sandbox_needs`), naming the setting; None when
    nothing is refused (or when not root: an unprivileged agent is told so by each capability's own probe). A host
    path is checked, and named, where the agent writes it: under `hostfs`'s root."""
    proc = proc or this_process()
    hostfs = hostfs or HostFS("/")
    eff = proc.effective()
    if eff is None:
        return None
    where = "the unit's" if proc.under_systemd else "this process's"
    problems = []
    for n in needs:
        if n.setting == "CapabilityBoundingSet" and n.value not in eff:
            problems.append(f"{where} CapabilityBoundingSet lacks {n.value} ({n.why})")
        elif n.setting == "ReadWritePaths":
            for target in (n.within(hostfs) if n.within else None) or [n.value.lstrip("-")]:
                path = str(hostfs.path(target)) if n.host else target
                probe = _existing(path)
                if n.value.startswith("-") and probe != path:
                    continue
                if probe is not None and not proc.writable(probe):
                    problems.append(f"{path} is read-only here ({n.why}): " + _read_only_by(n, needs, proc, hostfs))
        elif n.setting == "RequiresMountsFor" and n.value in ("/sys/fs/bpf", "/sys/kernel/tracing"):
            want = "bpf" if n.value == "/sys/fs/bpf" else "tracefs"
            if proc.mounted(n.value) != want:
                problems.append(f"no {want} mounted at {n.value} ({n.why})"
                                + (f": the unit's RequiresMountsFor={n.value}" if proc.under_systemd else ""))
    if not problems:
        return None
    hint = " (`qosagent check --systemd` prints the drop-in that grants it)" if proc.under_systemd else ""
    return "; ".join(problems) + hint


def _read_only_by(need: Need, needs: list[Need], proc: Process, hostfs: HostFS) -> str:
    """The settings that make a needed path read-only: those the needs relax, as the unit sets them; outside systemd,
    for a host file under a host root, the mount of the host's /sys there."""
    path = need.value.lstrip("-")
    if not proc.under_systemd:
        if need.host and str(hostfs.root) != "/":
            return (f"the host's /sys is mounted read-only at {hostfs.path('/sys')} (on Kubernetes, add the "
                    "component deploy/kubernetes/components/writable-sys)")
        return "mounted read-only"
    why = f"ReadOnlyPaths=/sys without ReadWritePaths={path}"
    if _under(path, CGROUP_FS) and any(n.setting == "ProtectControlGroups" for n in needs):
        why = f"ProtectControlGroups=yes (ReadWritePaths= does not override it) or {why}"
    return "the unit's " + why


def _existing(path: str) -> str | None:
    """The path itself, or its nearest existing parent (what a mkdir under it would need to write)."""
    p = os.path.normpath(path)
    while p != "/" and not os.path.exists(p):
        p = os.path.dirname(p)
    return p if p != "/" else None


# The capability numbers of linux/capability.h for the names the needs use.
_CAP_BITS = {"CAP_DAC_READ_SEARCH": 2, "CAP_NET_ADMIN": 12, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21,
             "CAP_SYS_NICE": 23, "CAP_PERFMON": 38, "CAP_BPF": 39}


def caps_from_status(status: str) -> frozenset[str]:
    """The capability names of the CapEff line of /proc/PID/status."""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            bits = int(line.split()[1], 16)
            return frozenset(name for name, bit in _CAP_BITS.items() if bits >> bit & 1)
    return frozenset()


def _effective_caps() -> frozenset[str] | None:
    if os.geteuid() != 0:
        return None
    with open("/proc/self/status") as f:
        return caps_from_status(f.read())


def _writable(path: str) -> bool:
    """Whether the filesystem holding `path` is mounted writable here: what ReadOnlyPaths= and ReadWritePaths= (or a
    pod's read-only host mount) decide. Not the path's own mode: cgroup2's root directory is 0555, which root without
    CAP_DAC_OVERRIDE (the unit grants none) may not create in, while the files under it that resources writes are
    root's own, 0644 (found under systemd in the VM: resources refused on every pure cgroup-v2 host)."""
    try:
        return not os.statvfs(path).f_flag & os.ST_RDONLY
    except OSError:
        return False


def _mounted(path: str) -> str | None:
    return mount_type(_read("/proc/self/mounts"), path)


def mount_type(mounts: str, path: str) -> str | None:
    """The type of the last filesystem mounted at exactly `path` in /proc/PID/mounts' text."""
    found = None
    for line in mounts.splitlines():
        f = line.split()
        if len(f) >= 3 and f[1] == path:
            found = f[2]
    return found


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def unit_settings(text: str) -> dict[str, list[str]]:
    """A unit file's settings (each occurrence's value), for the tests that hold BASE to the shipped unit."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            k, _, v = line.partition("=")
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def granted_by(settings: dict[str, list[str]], setting: str) -> Iterable[str]:
    return (v for value in settings.get(setting, []) for v in value.split())
