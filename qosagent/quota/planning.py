"""The quota capability's probe planning: what the kernel and the hooks offer, as the Verdict whose plan start takes
(the other filters and programs on the hooks, which status names)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from qosagent.capability import State, Verdict
from qosagent.pods import service as pods_service
from qosagent.pods.cri import CriError, grpc_module
from qosagent.quota import tc
from qosagent.quota.interfaces import interfaces

if TYPE_CHECKING:
    from qosagent.config import Config
    from qosagent.features import Features
    from qosagent.hostfs import HostFS


def verdict(cfg: "Config", fs: "HostFS", features: "Features") -> Verdict:
    if os.geteuid() != 0:
        return Verdict(State.UNAVAILABLE, "needs root (CAP_BPF, CAP_NET_ADMIN)")
    if not features.kernel_headers:
        return Verdict(State.UNAVAILABLE, "no kernel headers for BCC (run make setup)")
    if not (features.clsact and features.cls_bpf):
        return Verdict(State.UNAVAILABLE, "the kernel lacks clsact or cls_bpf")
    if features.bpffs == "absent":
        return Verdict(State.UNAVAILABLE, "no bpffs to pin maps in (fail-static needs it)")
    names = interfaces(cfg, fs)
    notes = []
    q = cfg.quota
    try:
        with tc.IPRoute() as ipr:
            for n in names:
                idx = tc.ifindex(ipr, n)
                if idx is None:
                    return Verdict(State.UNAVAILABLE, f"interface {n!r} not found")
                for h in tc.ingress_filters(ipr, idx, n):
                    if not tc.is_ours(h, q.tc_prio, q.tc_handle):
                        notes.append(f"other filter: {h}")
                notes += [f"runs before ours: {p}" for p in tc.tcx_programs(n)]
    except OSError as e:
        return Verdict(State.UNAVAILABLE, f"cannot list tc filters: {e}")
    reason = f"ingress of {', '.join(names)}"
    if any(t.match.pods for t in cfg.tenants):
        try:
            grpc_module()
        except CriError as e:
            return Verdict(State.UNAVAILABLE, str(e))
        # A runtime not answering now (restarting with the node) is no reason to leave every tenant
        # unenforced: quota runs, and the pods' namespaces get their tenants once it answers (check fails).
        runtime: list[str] = []
        problem = pods_service.problem(cfg, fs, runtime)
        reason += f"; pods from {runtime[0]}" if runtime else f"; {problem}: no pods tenant until one answers"
    if q.namespaces:
        reason += "; serving network namespaces followed (egress of their host-side veths)"
    if notes:
        reason += "; " + "; ".join(notes)
    return Verdict(State.ACTIVE, reason, tuple(notes))
