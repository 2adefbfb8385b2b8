"""Which threads the run-queue probes follow (qosagent/latency/runq.py), on a fixture /proc and in-memory maps."""

from __future__ import annotations

from types import SimpleNamespace

from qosagent.hostfs import HostFS
from qosagent.latency.runq import refresh_threads


class FakeMap:
    """The part of ebpf.maps.Map that refresh_threads uses: keys with a pid, values with v."""

    def __init__(self, entries: dict[int, int]):
        self.entries = dict(entries)

    def key(self, pid: int) -> SimpleNamespace:
        return SimpleNamespace(pid=pid)

    def value(self, v: int) -> SimpleNamespace:
        return SimpleNamespace(v=v)

    def keys(self) -> list[SimpleNamespace]:
        return [self.key(p) for p in sorted(self.entries)]

    def delete(self, k: SimpleNamespace) -> None:
        del self.entries[k.pid]

    def update(self, k: SimpleNamespace, v: SimpleNamespace) -> None:
        self.entries[k.pid] = v.v


def test_serving_processes_become_their_threads_and_the_gone_are_forgotten(tmp_path) -> None:
    for tid in (10, 11, 12):
        (tmp_path / "proc/10/task" / str(tid)).mkdir(parents=True)
    tgids = FakeMap({10: 1, 20: 1})  # 20 has exited: no /proc/20
    pids = FakeMap({11: 555, 13: 777})  # 11 waits since 555 ns; 13 was a thread of 10 that ended
    refresh_threads(tgids, pids, HostFS(str(tmp_path)))  # type: ignore[arg-type]
    assert tgids.entries == {10: 1}
    # The live wake-up time of 11 is kept; only new threads start at 0.
    assert pids.entries == {10: 0, 11: 555, 12: 0}
