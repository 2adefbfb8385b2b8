"""Which latency modes the running kernel offers, by the agent's own probe, for tests parametrized over modes.

The same tests run natively (this machine's kernel) and in the kernel matrix's VMs (tests/vm), each time over the
modes that kernel has: sockops and tracepoint on 6.18, kprobe on Debian 12's 6.1. tests/integration/
test_kernel_modes.py checks the probe against the kernel's version, so a probe that wrongly turned a mode off
would not silently shrink the tests.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from typing import Any

ALL = ("sockops", "tracepoint", "kprobe")
READS = ("tracepoint", "kprobe")  # the modes that see the application's reads


@functools.cache
def features() -> Any:
    from qosagent.features import probe
    from qosagent.hostfs import HostFS

    return probe(HostFS("/"))


def verdict(mode: str) -> Any:
    """The latency capability's verdict on this kernel with latency.mode forced to `mode`."""
    from qosagent.capability import AgentContext
    from qosagent.config import parse
    from qosagent.gpu.backend import NoGpu
    from qosagent.hostfs import HostFS
    from qosagent.latency.capability import Latency

    cap = Latency(AgentContext(config=parse({"latency": {"mode": mode}}, "test"), hostfs=HostFS("/"),
                               gpu=NoGpu("test")))
    return cap.probe(features())


# "auto": the tests parametrized over modes run only the mode `latency.mode: auto` picks on this kernel (the kernel
# matrix's added kernels, where every further mode would cost minutes of emulation; tests/vm/test_kernel_matrix.py).
ONLY = "QOSAGENT_TEST_LATENCY_MODES"


@functools.cache
def offered_modes(*among: str) -> list[str]:
    """The modes (of `among`, default all) the kernel offers: the probe does not say unavailable."""
    from qosagent.capability import State

    return [m for m in (among or ALL) if verdict(m).state is not State.UNAVAILABLE]


def latency_modes(*among: str) -> list[str]:
    """The modes of `among` (default all) the tests run here: those the kernel offers, or where ONLY is "auto", only
    the one the agent picks by default."""
    offered = offered_modes(*among)
    if os.environ.get(ONLY) == "auto":
        return [m for m in offered if m == verdict("auto").plan.mode]
    return offered


def kernel_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)
