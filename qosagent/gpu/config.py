from __future__ import annotations

from typing import Literal


from qosagent.configbase import Section, duration_between


class GpuConfig(Section):
    # auto: NVML when the library and a driver answer, else no GPU data (never an error).
    # fake: a scripted GPU read from fake_file each tick, to rehearse policies on a host without GPUs.
    backend: Literal["auto", "nvml", "fake", "none"] = "auto"
    fake_file: str | None = None
    # While the backend could not be opened (no driver yet, devices not injected), how often it is tried again.
    reprobe_interval: duration_between(1.0, 3600.0, "1s and 1h") = 60.0  # type: ignore[valid-type]
