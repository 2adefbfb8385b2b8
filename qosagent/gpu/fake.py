"""A scripted GPU backend: presets of real machines, settable readings, an error matrix, recorded writes.

Used by tests and by `gpu.backend: fake` to rehearse policies on a host without GPUs. With a file, the state is
re-read whenever the file changes, so a running agent can be driven from outside.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from qosagent.gpu.backend import (
    UNAVAILABLE,
    GpuDevice,
    GpuError,
    GpuProcess,
    GpuSample,
    GpuState,
)

GiB = 1 << 30


@dataclass
class FakeGpu:
    device: GpuDevice
    memory_total: int = 141 * GiB
    memory_used: int = 10 * GiB
    utilization_pct: float = 0.0
    temperature_c: float = 40.0
    power_w: float = 100.0
    power_limit_w: float = 700.0
    power_limit_range: tuple[float, float] = (200.0, 700.0)
    default_power_limit_w: float = 700.0
    sm_clock_mhz: int = 1980
    mem_clock_mhz: int = 3201
    locked_clocks: tuple[int, int] | None = None
    clock_event_reasons: int = 0
    processes: list[GpuProcess] = field(default_factory=list)


def _h200(index: int, node: int, bus: str, cpus: range) -> FakeGpu:
    dev = GpuDevice(index, f"GPU-fake-{index:04d}", "NVIDIA H200", bus, tuple(cpus), node)
    return FakeGpu(dev)


# An 8-GPU, two-socket HGX H200 layout: GPUs 0-3 on node 0, 4-7 on node 1, 48 CPUs per socket.
_H200X8_BUSES = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
                 "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]


def _mig(index: int, profile: str, gib: int) -> FakeGpu:
    # A MIG instance of one H100 (00:01:00.0): NVML reports memory per instance, and inside a container usually no
    # process on it, or none whose PID the agent can resolve.
    dev = GpuDevice(index, f"MIG-fake-{index:04d}", f"NVIDIA H100 80GB HBM3 MIG {profile}", "0000:01:00.0",
                    tuple(range(0, 2)), 0)
    return FakeGpu(dev, memory_total=gib * GiB, memory_used=gib * GiB // 10, power_limit_w=350.0,
                   power_limit_range=(200.0, 350.0), default_power_limit_w=350.0)


def _preset(name: str) -> list[FakeGpu]:
    if name == "h100-mig":
        return [_mig(0, "3g.40gb", 40), _mig(1, "2g.20gb", 20), _mig(2, "1g.10gb", 10)]
    if name == "h200x8":
        return [_h200(i, i // 4, bus, range(0, 48) if i < 4 else range(48, 96)) for i, bus in enumerate(_H200X8_BUSES)]
    if name == "single":
        return [_h200(0, 0, "0000:01:00.0", range(0, 2))]
    if name == "none":
        return []
    raise ValueError(f"unknown fake GPU preset {name!r}; expected h200x8, single, h100-mig or none")


class FakeBackend:
    name = "fake"

    def __init__(self, gpus: list[FakeGpu], path: str | None = None):
        self.gpus = gpus
        self.path = path
        self._stamp: tuple[int, int, int] | None = None  # the file's inode, mtime and size when last read
        # (operation, gpu index or None for all) -> error kind; operations: open, sample, memory, processes,
        # temperature, power, set_power_limit, set_locked_clocks, reset_locked_clocks, power_limit_constraints.
        self.errors: dict[tuple[str, int | None], str] = {}
        self.writes: list[tuple[str, int, Any]] = []
        self.opened = False

    @classmethod
    def preset(cls, name: str) -> "FakeBackend":
        return cls(_preset(name))

    @classmethod
    def from_file(cls, path: str) -> "FakeBackend":
        backend = cls([], path)
        backend._reload()
        return backend

    def _reload(self) -> None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise GpuError(UNAVAILABLE, f"fake GPU file {self.path}: {e.strerror}") from None
        # The inode too: a file renamed over it within the same mtime tick (a jiffy) may keep mtime and size.
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        with open(self.path, encoding="utf-8") as f:
            data = json.load(f)
        self._stamp = stamp
        if not self.gpus or data.get("preset") != getattr(self, "_preset_name", None):
            self.gpus = _preset(data.get("preset", "h200x8"))
            self._preset_name = data.get("preset")
        for key, values in data.get("gpus", {}).items():
            gpu = self.gpus[int(key)]
            for k, v in values.items():
                if k == "memory_used_ratio":
                    gpu.memory_used = int(gpu.memory_total * float(v))
                elif k == "processes":
                    gpu.processes = [GpuProcess(int(p[0]), int(p[1]) if p[1] is not None else None) for p in v]
                elif hasattr(gpu, k) and k != "device":
                    setattr(gpu, k, v)
                else:
                    raise ValueError(f"fake GPU file {self.path}: unknown field gpus.{key}.{k}")
        self.errors = {}
        for op_key, kind in data.get("errors", {}).items():
            op, _, idx = op_key.partition(":")
            self.errors[(op, None if idx in ("", "*") else int(idx))] = kind

    def fail(self, op: str, kind: str, index: int | None = None) -> None:
        self.errors[(op, index)] = kind

    def clear(self, op: str, index: int | None = None) -> None:
        self.errors.pop((op, index), None)

    def _check(self, op: str, index: int | None = None) -> None:
        kind = self.errors.get((op, index)) or self.errors.get((op, None))
        if kind:
            raise GpuError(kind, f"fake: {op} on GPU {index}: {kind}")

    def open(self) -> None:
        self._check("open")
        self.opened = True

    def close(self) -> None:
        self.opened = False

    def devices(self) -> list[GpuDevice]:
        return [g.device for g in self.gpus]

    def _sample_one(self, g: FakeGpu) -> GpuSample:
        i = g.device.index
        errs: list[tuple[str, str]] = []

        def read(op: str, value: Any) -> Any:
            try:
                self._check(op, i)
                return value
            except GpuError as e:
                errs.append((op, e.kind))
                return None

        try:
            self._check("sample", i)
        except GpuError as e:
            return GpuSample(i, g.device.uuid, lost=e.kind == "gpu_lost", errors=((("sample", e.kind)),))
        return GpuSample(
            index=i,
            uuid=g.device.uuid,
            memory_total=read("memory", g.memory_total),
            memory_used=read("memory", g.memory_used),
            utilization_pct=read("utilization", g.utilization_pct),
            temperature_c=read("temperature", g.temperature_c),
            power_w=read("power", g.power_w),
            power_limit_w=read("power", g.power_limit_w),
            sm_clock_mhz=read("clocks", g.sm_clock_mhz),
            mem_clock_mhz=read("clocks", g.mem_clock_mhz),
            clock_event_reasons=read("clocks", g.clock_event_reasons),
            processes=tuple(read("processes", g.processes) or ()),
            errors=tuple(errs),
        )

    def sample(self) -> GpuState:
        if self.path:
            try:
                self._reload()
            except (GpuError, ValueError, OSError) as e:
                return GpuState(available=False, reason=str(e))
        if not self.opened:
            return GpuState(available=False, reason="fake GPU not open")
        samples = tuple(self._sample_one(g) for g in self.gpus)
        return GpuState(available=True, gpus=samples, errors_total=sum(len(s.errors) for s in samples))

    def power_limit_constraints(self, index: int) -> tuple[float, float]:
        self._check("power_limit_constraints", index)
        return self.gpus[index].power_limit_range

    def power_limit(self, index: int) -> float:
        self._check("power", index)
        return self.gpus[index].power_limit_w

    def set_power_limit(self, index: int, watts: float) -> None:
        self._check("set_power_limit", index)
        lo, hi = self.gpus[index].power_limit_range
        if not lo <= watts <= hi:
            raise GpuError("failed", f"fake: power limit {watts} W outside [{lo}, {hi}]")
        self.gpus[index].power_limit_w = watts
        self.writes.append(("set_power_limit", index, watts))

    def set_locked_clocks(self, index: int, min_mhz: int, max_mhz: int) -> None:
        self._check("set_locked_clocks", index)
        self.gpus[index].locked_clocks = (min_mhz, max_mhz)
        self.writes.append(("set_locked_clocks", index, (min_mhz, max_mhz)))

    def reset_locked_clocks(self, index: int) -> None:
        self._check("reset_locked_clocks", index)
        self.gpus[index].locked_clocks = None
        self.writes.append(("reset_locked_clocks", index, None))


def with_device(gpu: FakeGpu, **changes: Any) -> FakeGpu:
    """A copy of gpu whose static device description differs (for topology tests)."""
    return replace(gpu, device=replace(gpu.device, **changes))
