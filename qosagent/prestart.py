"""What `qosagent run` begins before the rest of the agent is imported: latency's compile child, the longest thing a
cold start waits for (BCC's compile and the verifier's loads, ~1.5 s on free CPUs; docs/PERFORMANCE.md). The
composition root (capabilities.py) imports every capability, prometheus_client among their dependencies; begun
after that, the child started ~0.06 s later. Here only latency's own modules are imported, the sandbox asked,
tracefs, bpffs and cgroup2 mounted and the host probed, as Agent.start would; the Features found are handed to
Agent.start, which begins every capability's build as before (a build begun here is not begun twice) and probes
nothing again. A restart whose build is kept starts no child here either (pinned.begin)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from qosagent import features as features_mod
from qosagent import sandbox
from qosagent.latency.capability import Latency

if TYPE_CHECKING:
    from qosagent.config import Config
    from qosagent.hostfs import HostFS

log = logging.getLogger("qosagent.daemon")


def begin(cfg: "Config", fs: "HostFS") -> features_mod.Features | None:
    """Begin latency's build where latency is enabled and the sandbox grants what it needs; the host's Features
    when probed, else None (Agent.start then does all of it itself, and says what failed)."""
    if not Latency.enabled(cfg) or sandbox.refusal(Latency.sandbox_needs(cfg), hostfs=fs) is not None:
        return None
    try:
        mounted = features_mod.ensure_mounted(fs)
    except OSError:
        return None
    if mounted:
        log.info("mounted %s", ", ".join(mounted))
    found = features_mod.probe(fs)
    Latency.begin_build(cfg, found)
    return found
