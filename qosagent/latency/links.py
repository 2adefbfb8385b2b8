"""The latency programs' links on the cgroup2 root, which every mode with a cgroup2 hierarchy makes: the cgroup
watcher's sock_ops and learners (sockops mode), lat_egress (tracepoint and kprobe modes) and the adopter
(lat_adopt_ingress). BPF links, so that a killed agent leaves nothing attached."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from qosagent.capability import CapabilityError
from qosagent.cgroups import cgroup2_mount
from qosagent.ebpf.libbpf import link_create

if TYPE_CHECKING:
    from qosagent.ebpf.pinned import Program
    from qosagent.hostfs import HostFS

TAIL_FRAMING, TAIL_EGRESS = 0, 1  # lat_tail's slots (bpf/include/lat_http.h)


def cgroup_root(fs: "HostFS") -> str:
    """The host path of the cgroup2 hierarchy the programs are linked on."""
    root = cgroup2_mount(fs)
    if not root:
        raise CapabilityError("latency in sockops mode needs a cgroup v2 hierarchy, and none is mounted")
    return root


def link_root(fs: "HostFS", root: str, prog_fd: int, attach_type: int) -> int:
    """A link of the program on the cgroup2 root (its fd)."""
    fd = os.open(fs.path(root), os.O_RDONLY | os.O_DIRECTORY)
    try:
        return link_create(prog_fd, fd, attach_type)
    finally:
        os.close(fd)


def load_egress(prog: "Program") -> int:
    """lat_egress (its fd), with lat_egress_framing in its tail-call slot: the framing reader is verified as a
    program of its own (bpf/include/lat_http.h, lat_response_segment)."""
    egress = prog.fd("lat_egress")
    prog.map("lat_tail").update(TAIL_FRAMING, prog.fd("lat_egress_framing"))
    return egress


def load_egress_learn(prog: "Program", egress: int) -> int:
    """lat_egress_learn (its fd; sockops mode), with `egress` (load_egress's fd), which it tail-calls, in its slot:
    one copy of the egress parser compiled and verified, not two (bpf/latency_sockops.c)."""
    learn = prog.fd("lat_egress_learn")
    prog.map("lat_tail").update(TAIL_EGRESS, egress)
    return learn


def close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)
