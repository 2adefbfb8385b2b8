"""Which threads the run-queue probes follow.

The kernel side marks a process in `runq_tgids` when it is seen serving a watched socket; the sched tracepoints
name threads, so the agent expands each marked process into its threads in `runq_pids`, and forgets processes that
are gone and threads that ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qosagent.ebpf.maps import Map
    from qosagent.hostfs import HostFS


def refresh_threads(tgids: "Map", pids: "Map", fs: "HostFS") -> None:
    """Make pids hold the threads of the processes in tgids, as /proc lists them now."""
    want: set[int] = set()
    for k in tgids.keys():
        tasks = fs.listdir(f"/proc/{k.pid}/task")
        if not tasks:
            tgids.delete(k)
            continue
        want.update(int(t) for t in tasks if t.isdigit())
    have = set()
    for k in pids.keys():
        if k.pid in want:
            have.add(k.pid)
        else:
            pids.delete(k)
    for tid in want - have:  # new threads only: an existing entry may hold a live wake-up time
        pids.update(pids.key(pid=tid), pids.value(v=0))
