"""The resources section (the capability's switches and its suppression loop) and each tier's `resources:` (the
CPU and memory its serving processes get, and how the scheduler treats their threads)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from qosagent.configbase import RESTART, Mode, Section, duration_between
from qosagent.units import parse_size

Size = Annotated[int, BeforeValidator(parse_size), Field(description="bytes, or a size such as 512MiB or 8GiB")]
NO_LIMIT = "max"  # the kernel's own spelling of a memory limit that is none (v2 memory.high, memory.max)


def _size_or_max(v: object) -> object:
    if v == NO_LIMIT:
        return v
    try:
        return parse_size(v)
    except ValueError:
        raise ValueError(f"expected a size such as 512MiB or 8GiB, or max (no limit), got {v!r}") from None


SizeOrMax = Annotated[int | Literal["max"], BeforeValidator(_size_or_max),
                       Field(description="bytes, a size such as 8GiB, or max (no limit)")]

# A custom slice the kernel accepts (6.12+: 0.1 ms to 100 ms).
SLICE_MIN, SLICE_MAX = 100e-6, 0.1


class TierResources(Section):
    """What one tier's serving processes get; each key unset leaves its knob as the host has it (but memory_high,
    which follows memory)."""

    # Upper bound of each serving cgroup of the tier, in CPUs (cgroup v2 cpu.max, v1 cfs_quota_us/cfs_period_us).
    cpus: float | None = Field(default=None, gt=0, le=4096)
    # The memory guaranteed to each serving cgroup (v2 memory.min, v1 memory.soft_limit_in_bytes).
    memory: Size | None = None
    # Above this the cgroup is throttled and reclaimed, never killed (v2 memory.high); unset: `memory`, max: none.
    # cgroup v1 has no such limit: there it is left (planner.values).
    memory_high: SizeOrMax | None = None
    # The hard limit, above which the kernel's OOM killer acts (v2 memory.max, v1 memory.limit_in_bytes); unset:
    # left as the host has it.
    memory_max: Size | None = None
    # The cgroup's share of contended CPU in cgroup v2 units (1-10000; v1 cpu.shares = cpu_weight x 1024 / 100);
    # unset: 100 x the tier's weight, at most 10000.
    cpu_weight: int | None = Field(default=None, ge=1, le=10000)
    # Serving threads get the shorter scheduler slice (resources.latency_slice) or, without one, latency_nice; unset:
    # true for a tier whose slo_p99 is under 500 ms.
    latency_sensitive: bool | None = None
    # The scheduling policy of the serving threads: normal leaves it; batch and idle are SCHED_BATCH and SCHED_IDLE
    # (idle also sets cgroup v2 cpu.idle, and v1's where the kernel has it).
    sched: Literal["normal", "batch", "idle"] = "normal"

    @model_validator(mode="after")
    def _consistent(self) -> "TierResources":
        high = self.memory_high if isinstance(self.memory_high, int) else None
        if self.memory is not None and high is not None and high < self.memory:
            raise ValueError("memory_high is below memory: the guarantee would sit above the throttle")
        if self.memory_max is not None:
            for key, v, why in (("memory", self.memory, "the hard limit would sit under the guarantee"),
                                ("memory_high", high, "the kernel would kill before it throttles")):
                if v is not None and self.memory_max < v:
                    raise ValueError(f"memory_max is below {key}: {why}")
        if self.sched != "normal" and self.latency_sensitive:
            raise ValueError(f"sched {self.sched} contradicts latency_sensitive: true")
        return self


class SuppressConfig(Section):
    """The loop: while a tier is near its SLO (admission.near_slo x slo_p99 on admission.signal), the tiers below it
    lose CPU (their cpu.max), lowest weight first, step by step down to floor_cpus; when every tier is healthy again
    for healthy_ticks, it comes back step by step."""

    enabled: bool = True
    floor_cpus: float = Field(default=0.1, gt=0, le=4096, description="never less than this, in CPUs")
    factor: float = Field(default=0.7, gt=0, lt=1, description="each step keeps this share of the quota")
    every: duration_between(0.1, 600.0, "100ms and 10m") = 1.0  # type: ignore[valid-type]
    release_step: float = Field(default=0.25, gt=0, le=10, description="each step back adds this share")
    release_every: duration_between(0.1, 600.0, "100ms and 10m") = 2.0  # type: ignore[valid-type]
    healthy_ticks: int = Field(default=10, ge=1, le=100000)


class ResourcesConfig(Section):
    enabled: Annotated[bool, RESTART] = False
    mode: Mode = "dry-run"
    # How often serving processes are looked for and their cgroups, threads and files checked.
    reconcile_interval: duration_between(0.2, 3600.0, "200ms and 1h") = 2.0  # type: ignore[valid-type]
    # A serving process in a cgroup shared with what is not its tier's (the root, a slice, a login session, another
    # tier's processes) is moved into a cgroup of the agent's own (qosagent-<tier>) only with move: true; otherwise
    # it is reported and left.
    move: bool = False
    # The kubelet owns pod cgroups (kubepods): report what would change (report), or write there too (enforce).
    kubelet_cgroups: Literal["report", "enforce"] = "report"
    # The scheduler slice of latency-sensitive serving threads where the kernel takes a custom one (sched_setattr's
    # sched_runtime, Linux 6.12+; found by probing).
    latency_slice: duration_between(SLICE_MIN, SLICE_MAX, "100us and 100ms") = 0.0005  # type: ignore[valid-type]
    # Their nice value on kernels without custom slices.
    latency_nice: int = Field(default=-5, ge=-20, le=19)
    suppress: SuppressConfig = SuppressConfig()
    restore_on_stop: bool = True

