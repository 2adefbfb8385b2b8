"""cpufreq policies as the host offers them, read through HostFS: each policy's CPUs, driver, governor, frequency
range and the knob its driver offers for a frequency cap, chosen by probing what the driver offers:

- scaling_setspeed: under the userspace governor (acpi-cpufreq, intel_cpufreq and amd-pstate in passive mode).
- scaling_max_freq: any driver; the default elsewhere (intel_pstate active has no setspeed at all).
- max_perf_pct: intel_pstate's global cap, one file for every policy it drives.
- energy_performance_preference: alongside, where offered and the governor is not performance (EBUSY there).

Read by `features` (what `qosagent check` shows) and dvfs (which writes them) alike, so the two never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from qosagent.cpulist import parse_cpulist
from qosagent.hostfs import HostFS

CPU = "/sys/devices/system/cpu"
PSTATE = f"{CPU}/intel_pstate"
ACTUATORS = ("scaling_setspeed", "scaling_max_freq", "max_perf_pct")


@dataclass(frozen=True)
class Policy:
    name: str  # policyN, N the first of related_cpus, as the kernel names it
    dir: str  # host path of the policy's cpufreq directory
    cpus: tuple[int, ...]
    driver: str
    governor: str
    min_khz: int | None  # cpuinfo_min_freq, else the lowest known bound
    max_khz: int | None  # cpuinfo_max_freq, else the highest known bound
    available: tuple[int, ...] = ()  # scaling_available_frequencies, ascending
    epp_prefs: tuple[str, ...] = ()  # offered energy_performance_preference values; () when not usable
    actuator: str | None = None  # one of ACTUATORS; None: monitor only
    why: str = ""  # why this actuator (or none)


def ints(text: str | None) -> tuple[int, ...]:
    out = []
    for tok in (text or "").split():
        if tok.isdigit():
            out.append(int(tok))
    return tuple(sorted(out))


def _cpulist(text: str | None) -> tuple[int, ...]:
    """A policy's CPUs; an unreadable list means no CPUs (the policy is then monitored only)."""
    try:
        return tuple(sorted(parse_cpulist(text or "")))
    except ValueError:
        return ()


def _policy_dirs(fs: HostFS) -> list[str]:
    dirs = fs.glob(f"{CPU}/cpufreq", "policy*")
    if dirs:
        return dirs
    # Older kernels (and snapshots of them) have only cpuN/cpufreq, often one link per CPU to a shared policy.
    seen: dict[str, str] = {}
    for cpu in fs.glob(CPU, "cpu[0-9]*"):
        d = f"{cpu}/cpufreq"
        if fs.is_dir(d):
            seen.setdefault(fs.realpath(d), d)
    return list(seen.values())


def choose_actuator(fs: HostFS, d: str, driver: str, governor: str, wanted: str) -> tuple[str | None, str]:
    setspeed = fs.try_read(f"{d}/scaling_setspeed")
    offers = {
        "scaling_setspeed": governor == "userspace" and setspeed is not None and setspeed != "<unsupported>",
        "scaling_max_freq": fs.exists(f"{d}/scaling_max_freq"),
        "max_perf_pct": driver == "intel_pstate" and fs.exists(f"{PSTATE}/max_perf_pct"),
    }
    if wanted != "auto":
        if offers[wanted]:
            return wanted, "configured"
        return None, f"configured actuator {wanted} not offered by {driver}/{governor}"
    for a in ACTUATORS:
        if offers[a]:
            return a, f"{driver}/{governor}"
    return None, f"{driver}/{governor} offers no frequency knob"


def discover(fs: HostFS, wanted: str = "auto") -> list[Policy]:
    out = []
    for d in _policy_dirs(fs):
        cpus = _cpulist(fs.try_read(f"{d}/related_cpus") or fs.try_read(f"{d}/affected_cpus"))
        leaf = d.rsplit("/", 2)[-2] if d.endswith("/cpufreq") else ""
        if leaf[3:].isdigit() and int(leaf[3:]) not in cpus:
            # cpuN/cpufreq is a policy of its own (the link would have merged it): a related_cpus without N is a
            # broken snapshot, and the directory is the better witness.
            cpus = (int(leaf[3:]),)
        driver = fs.try_read(f"{d}/scaling_driver") or "unknown"
        governor = fs.try_read(f"{d}/scaling_governor") or "unknown"
        available = ints(fs.try_read(f"{d}/scaling_available_frequencies"))
        # cpuinfo_* are missing on some hosts (the real snapshot has none): the scaling bounds as the agent found
        # them are then the range, which never lets the agent go beyond what the host allowed.
        lo = ints(fs.try_read(f"{d}/cpuinfo_min_freq")) or available[:1] or ints(fs.try_read(f"{d}/scaling_min_freq"))
        hi = ints(fs.try_read(f"{d}/cpuinfo_max_freq")) or available[-1:] or ints(fs.try_read(f"{d}/scaling_max_freq"))
        epp: tuple[str, ...] = ()
        if fs.exists(f"{d}/energy_performance_preference") and governor != "performance":
            epp = tuple((fs.try_read(f"{d}/energy_performance_available_preferences") or "").split())
        actuator, why = choose_actuator(fs, d, driver, governor, wanted)
        name = d.rsplit("/", 1)[1] if not leaf else f"policy{cpus[0]}"
        out.append(Policy(name, d, cpus, driver, governor, lo[0] if lo else None, hi[0] if hi else None,
                          available, epp, actuator, why))
    return sorted(out, key=lambda p: p.cpus or (1 << 30,))
