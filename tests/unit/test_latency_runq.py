"""Which threads the run-queue probes follow, and in which tier's row (qosagent/latency/runq.py), on a fixture /proc
and in-memory maps."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from qosagent.hostfs import HostFS
from qosagent.latency.bpfmaps import NO_SLOT, RUNQ_SHARED
from qosagent.latency.runq import Threads


class FakeMap:
    """The part of ebpf.maps.Map that Threads uses: keys with a pid, values as SimpleNamespaces; writes counted."""

    def __init__(self, entries: dict[int, Any]):
        self.entries = dict(entries)
        self.updates = 0

    def key(self, pid: int) -> SimpleNamespace:
        return SimpleNamespace(pid=pid)

    def value(self, **fields: int) -> SimpleNamespace:
        return SimpleNamespace(**fields)

    def keys(self) -> list[SimpleNamespace]:
        return [self.key(p) for p in sorted(self.entries)]

    def items(self) -> list[tuple[SimpleNamespace, Any]]:
        return [(self.key(p), v) for p, v in sorted(self.entries.items())]

    def delete(self, k: SimpleNamespace) -> None:
        del self.entries[k.pid]

    def update(self, k: SimpleNamespace, v: SimpleNamespace) -> None:
        self.entries[k.pid] = v
        self.updates += 1


def served(slot: int, several: int = 0) -> SimpleNamespace:
    return SimpleNamespace(slot=slot, several=several)


def wait(since: int, row: int) -> SimpleNamespace:
    return SimpleNamespace(since=since, row=row)


def proc(tmp_path, pid: int, *tids: int) -> None:
    for tid in tids:
        (tmp_path / "proc" / str(pid) / "task" / str(tid)).mkdir(parents=True)


def rows(pids: FakeMap) -> dict[int, tuple[int, int]]:
    return {pid: (v.since, v.row) for pid, v in pids.entries.items()}


def test_serving_processes_become_their_threads_and_the_gone_are_forgotten(tmp_path) -> None:
    proc(tmp_path, 10, 10, 11, 12)
    tgids = FakeMap({10: served(1), 20: served(1)})  # 20 has exited: no /proc/20
    # 11 waits since 555 ns in row 2; 13 was a thread of 10 that ended
    pids = FakeMap({11: wait(555, 2), 13: wait(777, 2)})
    threads = Threads()
    threads.rows = {11: 2, 13: 2}
    threads.refresh(tgids, pids, HostFS(str(tmp_path)), {1: 2})  # type: ignore[arg-type]
    assert set(tgids.entries) == {10}
    # The live wake-up time of 11 is kept (its row did not change); only new threads start at 0.
    assert rows(pids) == {10: (0, 2), 11: (555, 2), 12: (0, 2)}


def test_each_process_counts_in_its_first_slots_tier_row_or_the_shared_one_once_it_served_several(tmp_path) -> None:
    proc(tmp_path, 10, 10, 11)  # a gold server
    proc(tmp_path, 20, 20)  # a bronze server
    proc(tmp_path, 30, 30, 31)  # one serving both tiers
    proc(tmp_path, 40, 40)  # noted with the slot of a tenant a reload removed
    proc(tmp_path, 50, 50)  # noted only for unmatched traffic
    proc(tmp_path, 60, 60)  # noted only for a tenant without a slot (LAT_NO_SLOT): tierless, as unmatched traffic
    slot_rows = {0: 2, 1: 3, 2: 1}  # slot 0 is unmatched traffic's (none's row 2), 1 gold's (row 3), 2 bronze's (1)
    tgids = FakeMap({10: served(1), 20: served(2), 30: served(1, several=1), 40: served(7), 50: served(0),
                     60: served(NO_SLOT)})
    pids = FakeMap({})
    Threads().refresh(tgids, pids, HostFS(str(tmp_path)), slot_rows)  # type: ignore[arg-type]
    assert rows(pids) == {10: (0, 3), 11: (0, 3), 20: (0, 1), 30: (0, RUNQ_SHARED), 31: (0, RUNQ_SHARED),
                          40: (0, RUNQ_SHARED), 50: (0, 2), 60: (0, 2)}


def test_a_thread_whose_row_changes_is_rewritten_and_the_others_are_left_alone(tmp_path) -> None:
    proc(tmp_path, 10, 10, 11)
    tgids = FakeMap({10: served(1)})
    pids = FakeMap({})
    threads = Threads()
    fs = HostFS(str(tmp_path))
    threads.refresh(tgids, pids, fs, {1: 3})  # type: ignore[arg-type]
    pids.entries[11] = wait(999, 3)  # waiting now, as the probes stamped it
    writes = pids.updates
    threads.refresh(tgids, pids, fs, {1: 3})  # type: ignore[arg-type]
    assert pids.updates == writes and rows(pids)[11] == (999, 3)  # nothing changed: no write
    tgids.entries[10] = served(1, several=1)  # the process served another tier's socket since
    threads.refresh(tgids, pids, fs, {1: 3})  # type: ignore[arg-type]
    # Moved to the shared row; the wait in progress is dropped rather than counted in either row.
    assert rows(pids) == {10: (0, RUNQ_SHARED), 11: (0, RUNQ_SHARED)}
