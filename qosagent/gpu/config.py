from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from qosagent.configbase import Duration, Section


class GpuConfig(Section):
    # auto: NVML when the library and a driver answer, else no GPU data (never an error).
    # fake: a scripted GPU read from fake_file each tick, to rehearse policies on a host without GPUs.
    backend: Literal["auto", "nvml", "fake", "none"] = "auto"
    fake_file: str | None = None
    # While the backend could not be opened (no driver yet, devices not injected), how often it is tried again.
    reprobe_interval: Duration = 60.0

    @field_validator("reprobe_interval")
    @classmethod
    def _reprobe_interval(cls, v: float) -> float:
        if not 1.0 <= v <= 3600.0:
            raise ValueError("expected between 1s and 1h")
        return v
