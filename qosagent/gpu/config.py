from __future__ import annotations

from typing import Literal

from qosagent.configbase import Section


class GpuConfig(Section):
    # auto: NVML when the library and a driver answer, else no GPU data (never an error).
    # fake: a scripted GPU read from fake_file each tick, to rehearse policies on a host without GPUs.
    backend: Literal["auto", "nvml", "fake", "none"] = "auto"
    fake_file: str | None = None
