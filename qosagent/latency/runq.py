"""Which threads the run-queue probes follow, and in which tier's row.

The kernel side notes a process in `runq_tgids` when it is seen serving a watched socket, with the slot of the first
socket's tenant (the first configured tenant's once one comes: unmatched traffic is no tier's) and whether it
served a tenant of another tier since (bpf/include/lat_state.h, lat_note_process); the sched tracepoints name
threads, so the agent expands each noted process into its threads in `runq_pids`, each with the run-queue row its
waits count in: the row of that slot's tier, or the shared row once the process served several tiers. It forgets
processes that are gone and threads that ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from qosagent.latency.bpfmaps import NO_SLOT, RUNQ_SHARED

if TYPE_CHECKING:
    from qosagent.ebpf.maps import Map
    from qosagent.hostfs import HostFS


class Threads:
    """The threads the run-queue probes follow, as last written to runq_pids: thread id -> its row."""

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}

    def refresh(self, tgids: "Map", pids: "Map", fs: "HostFS", slot_rows: Mapping[int, int]) -> None:
        """Make pids hold the threads of the processes in tgids, as /proc lists them now, each with its process's
        row (slot_rows: a slot's tier's row; a slot not in it, as one whose tenant a reload removed, has the shared
        row; LAT_NO_SLOT, tierless like unmatched traffic, has slot 0's, `none`'s). Only the keys are listed: the
        rows are those written last (the same number of calls as without)."""
        want: dict[int, int] = {}
        for k, served in tgids.items():
            tasks = fs.listdir(f"/proc/{k.pid}/task")
            if not tasks:
                tgids.delete(k)
                continue
            slot = 0 if served.slot == NO_SLOT else served.slot  # noted only with tierless slots: unmatched's row
            row = RUNQ_SHARED if served.several else slot_rows.get(slot, RUNQ_SHARED)
            want.update((int(t), row) for t in tasks if t.isdigit())
        have = set()
        for k in pids.keys():
            if k.pid in want:
                have.add(k.pid)
            else:
                pids.delete(k)
        for tid, row in want.items():
            # New threads, and those whose process was found serving another tier or whose tenant a reload moved.
            # An existing entry may hold a live wake-up time: left alone while its row stays, else the wait it may
            # be in is not counted (rewriting its wake-up time could count one that never was).
            if tid not in have or self.rows.get(tid) != row:
                pids.update(pids.key(pid=tid), pids.value(since=0, row=row))
        self.rows = want
