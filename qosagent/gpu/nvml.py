"""GPU backend over nvidia-ml-py (`import pynvml`)."""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

from qosagent.gpu.backend import (
    FAILED,
    GPU_LOST,
    NO_PERMISSION,
    NOT_SUPPORTED,
    UNAVAILABLE,
    GpuDevice,
    GpuError,
    GpuProcess,
    GpuSample,
    GpuState,
    normalize_bus_id,
)

log = logging.getLogger("qosagent.gpu")
T = TypeVar("T")


def _kind(exc: Exception) -> str:
    import pynvml

    code = getattr(exc, "value", None)
    return {
        pynvml.NVML_ERROR_NOT_SUPPORTED: NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION: NO_PERMISSION,
        pynvml.NVML_ERROR_GPU_IS_LOST: GPU_LOST,
        pynvml.NVML_ERROR_UNINITIALIZED: UNAVAILABLE,
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: UNAVAILABLE,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED: UNAVAILABLE,
    }.get(code, FAILED)


def _bitmask_to_list(words: Any, bits_per_word: int = 64) -> tuple[int, ...]:
    out = []
    for w_index, word in enumerate(words):
        for bit in range(bits_per_word):
            if int(word) >> bit & 1:
                out.append(w_index * bits_per_word + bit)
    return tuple(out)


class NvmlBackend:
    name = "nvml"

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._devices: list[GpuDevice] = []
        self.errors_total = 0

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        import pynvml

        try:
            return fn(*args)
        except pynvml.NVMLError as e:
            raise GpuError(_kind(e), f"{fn.__name__}: {e}") from e

    def open(self) -> None:
        try:
            import pynvml
        except ImportError as e:  # pragma: no cover - a dependency of the package
            raise GpuError(UNAVAILABLE, f"nvidia-ml-py not importable: {e}") from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise GpuError(UNAVAILABLE, f"NVML not available: {e}") from e
        count = self._call(pynvml.nvmlDeviceGetCount)
        self._handles = [self._call(pynvml.nvmlDeviceGetHandleByIndex, i) for i in range(count)]
        self._devices = [self._describe(i, h) for i, h in enumerate(self._handles)]

    def close(self) -> None:
        import pynvml

        if self._handles:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass
            self._handles = []

    def _optional(self, errors: list[tuple[str, str]], field: str, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return self._call(fn, *args)
        except GpuError as e:
            errors.append((field, e.kind))
            if e.kind != NOT_SUPPORTED:
                self.errors_total += 1
            return None

    def _describe(self, index: int, h: Any) -> GpuDevice:
        import os

        import pynvml

        errs: list[tuple[str, str]] = []
        uuid = self._optional(errs, "uuid", pynvml.nvmlDeviceGetUUID, h) or f"gpu{index}"
        name = self._optional(errs, "name", pynvml.nvmlDeviceGetName, h) or "unknown"
        pci = self._optional(errs, "pci", pynvml.nvmlDeviceGetPciInfo, h)
        bus = normalize_bus_id(_text(pci.busId)) if pci is not None else ""
        ncpu = os.cpu_count() or 1
        words = (ncpu + 63) // 64
        cpus = self._optional(errs, "cpu_affinity", pynvml.nvmlDeviceGetCpuAffinity, h, words)
        node = None
        mem_aff = getattr(pynvml, "nvmlDeviceGetMemoryAffinity", None)
        if mem_aff is not None:
            nodes = self._optional(errs, "memory_affinity", mem_aff, h, 1, pynvml.NVML_AFFINITY_SCOPE_NODE)
            if nodes is not None:
                found = _bitmask_to_list(nodes)
                node = found[0] if len(found) == 1 else None
        return GpuDevice(index, _text(uuid), _text(name), bus, _bitmask_to_list(cpus) if cpus else None, node)

    def devices(self) -> list[GpuDevice]:
        return list(self._devices)

    def _sample_one(self, index: int, h: Any) -> GpuSample:
        import pynvml

        errs: list[tuple[str, str]] = []
        uuid = self._devices[index].uuid
        mem = self._optional(errs, "memory", pynvml.nvmlDeviceGetMemoryInfo, h)
        if any(kind == GPU_LOST for _, kind in errs):
            return GpuSample(index, uuid, lost=True, errors=tuple(errs))
        util = self._optional(errs, "utilization", pynvml.nvmlDeviceGetUtilizationRates, h)
        temp = self._optional(errs, "temperature", pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
        power_mw = self._optional(errs, "power", pynvml.nvmlDeviceGetPowerUsage, h)
        limit_mw = self._optional(errs, "power_limit", pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
        sm = self._optional(errs, "sm_clock", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
        memclk = self._optional(errs, "mem_clock", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM)
        # Renamed in newer NVML; the old name remains for older drivers.
        reasons_fn = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                      or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        reasons = self._optional(errs, "clock_event_reasons", reasons_fn, h)
        procs = self._optional(errs, "processes", pynvml.nvmlDeviceGetComputeRunningProcesses, h) or []
        lost = any(kind == GPU_LOST for _, kind in errs)
        return GpuSample(
            index=index,
            uuid=uuid,
            # total - free counts the driver's reservation as used, which is what pressure is about.
            memory_total=mem.total if mem else None,
            memory_used=(mem.total - mem.free) if mem else None,
            utilization_pct=float(util.gpu) if util else None,
            temperature_c=float(temp) if temp is not None else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            sm_clock_mhz=sm,
            mem_clock_mhz=memclk,
            clock_event_reasons=reasons,
            processes=tuple(
                GpuProcess(p.pid, p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else None) for p in procs
            ),
            lost=lost,
            errors=tuple(errs),
        )

    def sample(self) -> GpuState:
        if not self._handles:
            return GpuState(available=False, reason="NVML not open")
        gpus = tuple(self._sample_one(i, h) for i, h in enumerate(self._handles))
        return GpuState(available=True, gpus=gpus, errors_total=self.errors_total)

    def power_limit_constraints(self, index: int) -> tuple[float, float]:
        import pynvml

        lo, hi = self._call(pynvml.nvmlDeviceGetPowerManagementLimitConstraints, self._handles[index])
        return lo / 1000.0, hi / 1000.0

    def power_limit(self, index: int) -> float:
        import pynvml

        return self._call(pynvml.nvmlDeviceGetPowerManagementLimit, self._handles[index]) / 1000.0

    def set_power_limit(self, index: int, watts: float) -> None:
        import pynvml

        self._call(pynvml.nvmlDeviceSetPowerManagementLimit, self._handles[index], int(round(watts * 1000)))

    def set_locked_clocks(self, index: int, min_mhz: int, max_mhz: int) -> None:
        import pynvml

        self._call(pynvml.nvmlDeviceSetGpuLockedClocks, self._handles[index], int(min_mhz), int(max_mhz))

    def reset_locked_clocks(self, index: int) -> None:
        import pynvml

        self._call(pynvml.nvmlDeviceResetGpuLockedClocks, self._handles[index])


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
