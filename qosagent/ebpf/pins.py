"""Where the agent's BPF objects are pinned under bpf.pin_root: what one program pins and another opens by path (the
latency program reads quota's flow map), and what the next agent adopts."""

from __future__ import annotations

import os

QUOTA_LAYOUT = 3  # QOS_QUOTA_LAYOUT (bpf/include/qos_quota.h): the layout of quota's pinned maps


def quota_dir(pin_root: str) -> str:
    """quota's pins, one directory per layout, so that an agent of another layout never adopts them."""
    return os.path.join(pin_root, f"quota-v{QUOTA_LAYOUT}")


def tenant_flows(pin_root: str) -> str:
    """quota's pinned flow map (bpf/include/qos_flow.h): the tenant of each flow its classifier matched by header."""
    return os.path.join(quota_dir(pin_root), "tenant_flows")
