"""The GPU seam: what the agent reads from and writes to GPUs, independent of NVML.

`NvmlBackend` is the real one (nvidia-ml-py); `FakeBackend` (fake.py) serves tests and rehearsals; `NoGpu` is a
host without GPUs. `sample()` never raises: a field that fails is None and its error is recorded, so one
NotSupported counter never hides the rest and a lost GPU never stops the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from qosagent.snapshot import PartKey

# Error kinds, named after NVML's return codes that the agent treats differently.
NOT_SUPPORTED = "not_supported"
NO_PERMISSION = "no_permission"
GPU_LOST = "gpu_lost"
UNAVAILABLE = "unavailable"  # no library, no driver, not initialized
FAILED = "failed"  # anything else
# Why a tick has no GPU readings, besides the kinds above (GpuState.cause, the metric's reason label).
DISABLED = "disabled"  # gpu.backend: none
SAMPLE_FAILED = "sample_failed"  # the backend raised where it must not


class GpuError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def normalize_bus_id(bus_id: str) -> str:
    """NVML's '00000000:3B:00.0' and sysfs's '0000:3b:00.0' name the same device; use sysfs's form."""
    s = bus_id.strip().lower()
    domain, sep, rest = s.partition(":")
    if not sep:
        return s
    if rest.count(":") == 0:  # 'bb:dd.f' with no domain
        return f"0000:{s}"
    return f"{int(domain, 16):04x}:{rest}"


@dataclass(frozen=True)
class GpuDevice:
    """What does not change while the agent runs."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str  # sysfs form, see normalize_bus_id
    cpu_affinity: tuple[int, ...] | None = None  # CPUs NVML calls ideal for this GPU
    numa_node: int | None = None  # NVML's memory affinity, when it has one


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # host PID
    used_bytes: int | None


@dataclass(frozen=True)
class GpuSample:
    index: int
    uuid: str
    memory_total: int | None = None
    memory_used: int | None = None  # bytes in use including the driver's reservation
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    clock_event_reasons: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    lost: bool = False
    errors: tuple[tuple[str, str], ...] = ()  # (field, error kind)

    @property
    def memory_used_ratio(self) -> float | None:
        if self.memory_total and self.memory_used is not None:
            return self.memory_used / self.memory_total
        return None


@dataclass(frozen=True)
class GpuState:
    """The tick's view of all GPUs. available=False means unknown: nothing may be decided on it."""

    available: bool
    reason: str = ""
    gpus: tuple[GpuSample, ...] = ()
    # When not available, the kind of reason (one of the error kinds, DISABLED, SAMPLE_FAILED): a bounded label.
    cause: str = ""
    errors_total: int = 0

    def by_index(self, index: int) -> GpuSample | None:
        for g in self.gpus:
            if g.index == index:
                return g
        return None


class GpuBackend(Protocol):
    name: str

    def open(self) -> None:
        """Initialize; raise GpuError(UNAVAILABLE, ...) when there is no library, driver or GPU."""

    def close(self) -> None: ...

    def devices(self) -> list[GpuDevice]: ...

    def sample(self) -> GpuState: ...

    def power_limit_constraints(self, index: int) -> tuple[float, float]: ...

    def power_limit(self, index: int) -> float: ...

    def set_power_limit(self, index: int, watts: float) -> None: ...

    def set_locked_clocks(self, index: int, min_mhz: int, max_mhz: int) -> None: ...

    def reset_locked_clocks(self, index: int) -> None: ...


@dataclass
class NoGpu:
    """A host without GPUs (or with GPUs switched off in config): always 'unknown', never an error."""

    reason: str = "no GPU backend"
    # The kind of error that left the agent without GPUs (GpuError.kind), or DISABLED by config.
    kind: str = UNAVAILABLE
    name: str = "none"
    _devices: list[GpuDevice] = field(default_factory=list)
    _last: GpuState | None = field(default=None, repr=False, compare=False)

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def devices(self) -> list[GpuDevice]:
        return []

    def sample(self) -> GpuState:
        # The same (frozen) state every tick while reason and kind stay: nothing built, and what is made from it
        # downstream may be handed on.
        last = self._last
        if last is None or last.reason != self.reason or last.cause != self.kind:
            last = self._last = GpuState(available=False, reason=self.reason, cause=self.kind)
        return last

    def _none(self, *_a: object) -> None:
        raise GpuError(UNAVAILABLE, self.reason)

    power_limit_constraints = power_limit = set_power_limit = set_locked_clocks = reset_locked_clocks = _none  # type: ignore[assignment]


GPU = PartKey("gpu", GpuState)  # the tick's one GPU sample, taken by the daemon
