"""The GPU backend a config asks for (gpu.backend): NVML, the fake, or none. Apart from backend.py, which both
backends implement, so the seam's types import neither of them."""

from __future__ import annotations

import logging

from qosagent.gpu.backend import DISABLED, GpuBackend, GpuError, NoGpu
from qosagent.gpu.fake import FakeBackend
from qosagent.gpu.nvml import NvmlBackend

log = logging.getLogger("qosagent.gpu")


def make_backend(kind: str, fake_file: str | None = None) -> GpuBackend:
    """The backend config asks for, opened; 'auto' falls back to NoGpu with the reason logged once."""
    if kind == "none":
        return NoGpu("GPU backend disabled in config", DISABLED)
    if kind == "fake":
        backend: GpuBackend = FakeBackend.from_file(fake_file) if fake_file else FakeBackend.preset("h200x8")
    else:
        backend = NvmlBackend()
    try:
        backend.open()
    except GpuError as e:
        if kind == "auto":
            log.info("no GPU data: %s", e)
            return NoGpu(str(e), e.kind)
        raise
    return backend
