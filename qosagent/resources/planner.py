"""What each group's controller files are to hold (pure): from its tier's `resources:`, the CPU quota the loop has
left it, and the cgroup version of its controller."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qosagent.cgroups import V2
from qosagent.resources.config import NO_LIMIT

if TYPE_CHECKING:
    from qosagent.config import Config, TierConfig
    from qosagent.resources.config import TierResources

PERIOD_US = 100_000  # the CFS bandwidth period the quota is written with (the kernel's default)
MIN_QUOTA_US = 1_000  # the kernel's smallest quota
PAGE = 4096  # memory values are kept in pages: written rounded down, so they read back as written
SHARES_MIN, SHARES_MAX = 2, 262144


def quota_us(cpus: float) -> int:
    return max(MIN_QUOTA_US, round(cpus * PERIOD_US))


def _pages(n: int) -> str:
    return str(n // PAGE * PAGE)


def values(controller: str, version: str, tier: "TierConfig", quota_cpus: float | None,
           has_idle: bool) -> tuple[tuple[str, str], ...]:
    """(file, value) in the order they are written. quota_cpus: the CPUs the loop leaves the tier (None: as
    configured); has_idle: the cgroup has a cpu.idle file (v2 on 5.15+, some v1 kernels)."""
    r = tier.resources
    if r is None:
        return ()
    out: list[tuple[str, str]] = []
    if controller == "cpu":
        cpus = quota_cpus if quota_cpus is not None else r.cpus
        weight = tier.cpu_weight()
        if version == V2:
            if cpus is not None:
                out.append(("cpu.max", f"{quota_us(cpus)} {PERIOD_US}"))
            out.append(("cpu.weight", str(weight)))
        else:
            if cpus is not None:
                out += [("cpu.cfs_period_us", str(PERIOD_US)), ("cpu.cfs_quota_us", str(quota_us(cpus)))]
            out.append(("cpu.shares", str(min(SHARES_MAX, max(SHARES_MIN, weight * 1024 // 100)))))
        if r.sched == "idle" and has_idle:
            out.append(("cpu.idle", "1"))
    elif controller == "memory":
        if version == V2:
            if r.memory is not None:
                out.append(("memory.min", _pages(r.memory)))
            high = memory_high(r)
            if high is not None:
                out.append(("memory.high", high))
            if r.memory_max is not None:
                out.append(("memory.max", _pages(r.memory_max)))
        else:
            # v1 has no limit that throttles without killing, so memory_high has nothing to become here; the hard
            # limit is set only when asked for by name (memory_max), never derived from the guarantee.
            if r.memory is not None:
                out.append(("memory.soft_limit_in_bytes", _pages(r.memory)))
            if r.memory_max is not None:
                out.append(("memory.limit_in_bytes", _pages(r.memory_max)))
    return tuple(out)


def memory_high(r: "TierResources") -> str | None:
    """v2 memory.high: memory_high as configured (max: none), else the guarantee itself, so that a tier above what
    it was promised is reclaimed and slowed before it can take from the others, and never killed for it."""
    high = r.memory_high if r.memory_high is not None else r.memory
    if high is None:
        return None
    return high if isinstance(high, str) else _pages(high)


def left_out(config: "Config", memory_version: str | None) -> list[str]:
    """What the tiers ask that this host's memory controller has no file for (`qosagent check` says it)."""
    if memory_version is None or memory_version == V2:
        return []
    return [f"tiers.{name}.resources.memory_high is left: cgroup v1's memory controller has no limit that throttles "
            "without killing (memory_max sets the hard one)"
            for name, t in sorted(config.tiers.items())
            if t.resources is not None and t.resources.memory_high not in (None, NO_LIMIT)]
