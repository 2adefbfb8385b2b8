from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from qosagent.configbase import RESTART, Duration, Mode, Regex, Section
from qosagent.cpulist import parse_cpulist


class Selector(Section):
    """One way to name inference processes; a selector with several keys needs all of them to match."""

    name: Regex | None = Field(default=None, description="regex on the process name (/proc/PID/comm)")
    cmdline: Regex | None = Field(default=None,
                                  description="regex searched in the command line (args joined by spaces)")
    cgroup: str | None = Field(default=None, description="cgroup path prefix, e.g. /kubepods.slice/kubepods-pod...")
    unit: str | None = Field(default=None, description="systemd unit, e.g. vllm.service")
    node: int | None = Field(default=None, ge=0, description="NUMA node for a matching process that uses no GPU")
    tenant: str | None = Field(default=None, description="the tenant this process serves alone (tier CPU guarantees)")

    @field_validator("cgroup")
    @classmethod
    def _cgroup(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("a cgroup path starts with /")
        return v

    @model_validator(mode="after")
    def _some_match(self) -> "Selector":
        if not (self.name or self.cmdline or self.cgroup or self.unit):
            raise ValueError("expected at least one of name, cmdline, cgroup, unit")
        return self


class PlacementConfig(Section):
    enabled: Annotated[bool, RESTART] = False
    mode: Mode = "dry-run"
    # How often processes are discovered, placed and verified; placement is not a per-tick concern.
    reconcile_interval: Duration = 5.0
    reserved_cpus: str = Field(default="", description="CPUs never given to placed processes (cpulist)")
    selectors: list[Selector] = Field(default_factory=list)
    # Every process NVML lists on a GPU is selected too (off: the GPU list only says which GPUs a selected one uses).
    gpu_processes: bool = False
    # A process whose GPUs sit on several nodes: pin to the node holding most of them, or leave it where it is.
    span_policy: Literal["majority", "unpinned"] = "majority"
    # Node for selected processes without a GPU when their selector names none; unset: most available CPUs.
    cpu_node: int | None = Field(default=None, ge=0)
    migrate_memory: bool = True
    # Reading numa_maps walks the page tables of a process; large servers make that worth doing rarely.
    locality_interval: Duration = 60.0
    restore_on_stop: bool = True
    # Tier -> CPUs its processes get for themselves on their node (a tenant served by its own process).
    exclusive_cpus: dict[str, int] = Field(default_factory=dict)

    @field_validator("reserved_cpus")
    @classmethod
    def _cpulist(cls, v: str) -> str:
        parse_cpulist(v)
        return v

    @field_validator("exclusive_cpus")
    @classmethod
    def _exclusive(cls, v: dict[str, int]) -> dict[str, int]:
        for tier, n in v.items():
            if n < 1:
                raise ValueError(f"{tier}: expected at least 1 CPU, got {n}")
        return v

    @field_validator("reconcile_interval", "locality_interval")
    @classmethod
    def _interval(cls, v: float) -> float:
        if not 0.5 <= v <= 3600:
            raise ValueError("expected between 500ms and 1h")
        return v
