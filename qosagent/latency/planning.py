"""Latency's probe planning: from the kernel's features and latency.mode to the Plan start() compiles and
attaches (sockops, tracepoint or kprobe mode; arrival clocks; the egress program; run-queue latency), or why none
can run. Pure: it reads only what features.probe() found, so `qosagent check` and the agent plan alike."""

from __future__ import annotations

from qosagent.capability import State, Verdict
from qosagent.features import Features
from qosagent.latency.config import LatencyConfig
from qosagent.latency.datapath import KPROBE_ARRIVAL, KPROBES
from qosagent.latency.model import Plan

SOCKET_TRACEPOINTS = ("sock/sock_recv_length", "sock/sock_send_length")
RUNQ_TRACEPOINTS = ("sched/sched_wakeup", "sched/sched_wakeup_new", "sched/sched_switch")


def verdict(cfg: LatencyConfig, features: Features) -> Verdict:
    """What this kernel offers latency.mode: the mode, where request clocks start, whether responses are read as
    they leave (TTFT) and run-queue latency (the Plan start() compiles and attaches), or why none can run."""
    sockops_ok = features.sockops_sendmsg and bool(features.cgroup2)
    tracepoints_ok = all(features.has_tracepoint(tp) for tp in SOCKET_TRACEPOINTS)
    set_state = features.has_tracepoint("sock/inet_sock_set_state")

    def kprobe_fns() -> bool:
        # Asked only where kprobe mode is considered: the answer reads /proc/kallsyms (~0.05 s, features.py).
        return all(features.kprobe_functions.get(fn, False) for fn, _ in KPROBES)

    notes = []
    arrival = egress = False
    if cfg.mode == "sockops" or (cfg.mode == "auto" and sockops_ok):
        if not sockops_ok:
            return Verdict(State.UNAVAILABLE, "latency.mode is sockops, but " + (
                "the kernel's sock_ops has no per-socket sendmsg callback (kernel < 6.15)"
                if not features.sockops_sendmsg else "no cgroup v2 hierarchy is mounted"))
        mode = "sockops"
        arrival = True  # the ingress program sees request bytes arrive
        egress = True  # and the egress program response bytes leave
    elif cfg.mode in ("auto", "tracepoint") and set_state and tracepoints_ok:
        mode = "tracepoint"
    elif cfg.mode in ("auto", "kprobe") and set_state and features.kprobes and kprobe_fns():
        mode = "kprobe"
        notes.append("kprobe fallback on " + "/".join(fn for fn, _ in KPROBES))
    else:
        def kp_why() -> str:  # only where kprobe mode was considered: it may read /proc/kallsyms
            return "no kprobes" if not features.kprobes else "no " + "/".join(
                fn for fn, _ in KPROBES if not features.kprobe_functions.get(fn, False)) + " to probe"
        missing = ("no sock:inet_sock_set_state tracepoint (kernel < 4.16)" if not set_state else
                   "no sock:sock_recv_length/sock_send_length tracepoints (kernel < 6.4)" if cfg.mode != "kprobe"
                   else kp_why())
        if cfg.mode == "auto":
            missing += f", {kp_why()} for the kprobe fallback" if set_state else ""
            missing += ", and no per-socket sock_ops hooks (kernel < 6.15 or no cgroup v2)"
        return Verdict(State.UNAVAILABLE, f"latency.mode {cfg.mode}: {missing}")
    if mode != "sockops":
        egress = bool(features.cgroup2)
        if not egress:
            notes.append("no cgroup v2 hierarchy: time to first token and inter-token latency unavailable")
    if mode == "kprobe":
        arrival = features.kprobe_functions.get(KPROBE_ARRIVAL[0], False)
        if arrival:
            notes.append(f"request arrival from a kprobe on {KPROBE_ARRIVAL[0]}")
        else:
            notes.append(f"no {KPROBE_ARRIVAL[0]} to probe: requests timed from their first read, not arrival")
    elif mode != "sockops":
        arrival = features.has_tracepoint("sock/sk_data_ready")
        if not arrival:
            notes.append("no sock:sk_data_ready (kernel < 6.6): requests timed from their first read, not arrival")
    runq = cfg.runqueue.enabled and all(features.has_tracepoint(tp) for tp in RUNQ_TRACEPOINTS)
    if cfg.runqueue.enabled and not runq:
        notes.append("run-queue latency off: sched tracepoints missing")
    # Without TTFT (the default SLO signal) or run-queue latency the capability is short of what it promises.
    degraded = not egress or (cfg.runqueue.enabled and not runq)
    return Verdict(State.DEGRADED if degraded else State.ACTIVE, "; ".join(notes),
                   Plan(mode=mode, arrival=arrival, egress=egress, runq=runq))

